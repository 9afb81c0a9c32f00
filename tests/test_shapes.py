"""The shape plan: one answer to what lengths a batch may have, how many rows a step takes and how
many steps an epoch runs (in-process)."""

import types

import datasets
import pytest

from xla_train.core.batching import BatchPlan
from xla_train.core.errors import UserError
from xla_train.core.shapes import Padding, PaddingRequest, Shapes, check_steps, settle_padding


def _job(train_rows, grad_accum, padding="buckets", buckets="auto"):
    lengths = [20 + (i * 7) % 60 for i in range(train_rows)]
    data = datasets.DatasetDict(train=datasets.Dataset.from_dict({"length": lengths}),
                                validation=datasets.Dataset.from_dict({"length": lengths[:16]}))
    cfg = PaddingRequest(padding, buckets, max_length=128, epochs=3)
    backend = types.SimpleNamespace(compile_seconds=1.0, token_seconds=1e-4)
    return cfg, data, backend, lengths


def test_printed_steps_per_epoch_are_the_steps_an_epoch_runs(capsys):
    """160 rows, batch 8, --grad-accum 3: 20 micro-batches make 6 optimizer steps (the last 2 are
    skipped); the --buckets auto line said 7 when it rounded rows / 24 up."""
    cfg, data, backend, lengths = _job(160, 3)
    shapes = Shapes(batch_size=8, devices=1, grad_accum=3)
    shapes.padding = settle_padding(cfg, shapes, data, ["validation"], backend)
    line = capsys.readouterr().out
    loop = BatchPlan(lengths, 8, padding=shapes.padding, shuffle=True)  # the loader the loop iterates
    runs = len(loop) // 3
    assert runs == shapes.steps_per_epoch(160) == 6
    assert "6 steps per epoch, 18 for 3 epochs" in line and "for 18 steps" in line, line
    assert shapes.estimate["steps_per_epoch"] == 6 and shapes.global_batch == 8 and shapes.rows_per_step == 24


def test_padding_modes_answer_which_lengths_a_batch_may_have():
    buckets = Padding("buckets", [64, 32], 128)
    assert buckets.lengths == [32, 64] == buckets.bucket_list and buckets.pad_to(33) == 64
    fixed = Padding("max_length", [32, 64], 128)
    assert fixed.lengths == [128] and fixed.bucket_list is None and fixed.pad_to(5) == 128
    dynamic = Padding("dynamic", None, 128)
    assert dynamic.lengths is None and dynamic.pad_to(37) == 37 and dynamic.recompiles_per_length
    with pytest.raises(UserError, match="rows of up to 70 tokens do not fit the longest bucket 64"):
        buckets.check_fit([10, 70])
    fixed.check_fit([10, 120])


def test_a_plan_counts_every_device_and_refuses_an_epoch_without_a_step():
    shapes = Shapes(batch_size=8, devices=4, grad_accum=2)
    assert shapes.global_batch == 32 and shapes.rows_per_step == 64
    assert shapes.steps_per_epoch(3668) == 115 // 2 and shapes.total_steps(3668, 3, max_steps=10) == 10
    with pytest.raises(UserError, match="20 training rows make 1 batch"):
        check_steps(shapes, 20)


def test_a_resumed_run_keeps_its_buckets(capsys):
    cfg, data, backend, _ = _job(160, 1)
    shapes = Shapes(batch_size=8, devices=1)
    shapes.padding = settle_padding(cfg, shapes, data, ["validation"], backend, resumed_buckets=[88])
    assert shapes.padding.bucket_list == [88] and shapes.estimate is None and capsys.readouterr().out == ""
