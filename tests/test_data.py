"""Reading MRPC, the batch plan's shapes, and the bucket chooser."""

import numpy as np
import pytest

from xla_train.core.batching import BatchPlan
from xla_train.core.errors import UserError
from xla_train.core.shapes import CostModel, choose_buckets, parse_buckets
from xla_train.tasks import Source, load_mrpc, load_task, read_glue_tsv
from xla_train.tasks.sequence import tokenize


def test_bundled_mrpc_has_the_glue_row_counts():
    ds = load_mrpc()
    assert len(ds["train"]) == 3668 and len(ds["validation"]) == 408
    assert set(ds["train"]["label"]) == {0, 1}


@pytest.mark.parametrize("body, message", [
    ("Quality\t#1 ID\t#2 ID\t#1 String\n", "lacks column(s) #2 String"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tonly three\n", "expected 5 tab-separated fields, found 4"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\nyes\t1\t2\ta\tb\n", "label must be 0 or 1, found 'yes'"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n2\t1\t2\ta\tb\n", "label must be 0 or 1, found '2'"),
    ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n", "no rows (empty split)"),
    ("", "empty data file"),
])
def test_malformed_tsv_names_the_problem(tmp_path, body, message):
    f = tmp_path / "train.tsv"
    f.write_text(body)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_glue_tsv(f)


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(UserError, match="data folder not found"):
        load_mrpc(tmp_path / "nope")
    with pytest.raises(UserError, match="missing data file"):
        load_mrpc(tmp_path)


def _lengths(n=203, seed=0):
    return np.random.default_rng(seed).integers(10, 100, size=n)


def test_bucket_plan_has_fixed_shapes_and_groups_by_length():
    lengths = _lengths()
    plan = BatchPlan(lengths, batch_size=8, buckets=[32, 64, 100], shuffle=True, seed=1)
    batches = list(plan)
    assert len(batches) == len(plan) == 26
    for keys in batches:
        assert len(keys) == 8
        pads = {pad for _, pad, _ in keys}
        assert len(pads) == 1 and pads.pop() in (32, 64, 100)
        assert all(lengths[row] <= pad for row, pad, _ in keys)
    # repeat filling: every row appears, the 5 filler slots repeat real rows, all valid
    rows = [r for keys in batches for r, _, _ in keys]
    assert set(rows) == set(range(203)) and len(rows) == 208
    assert all(v == 1 for keys in batches for _, _, v in keys)
    assert plan.padding_efficiency() > 0.7


def test_eval_plan_masks_filler_and_shards_without_duplicates():
    lengths = _lengths(101)
    seen = []
    for rank in range(2):
        plan = BatchPlan(lengths, batch_size=8, buckets=[128], fill="mask", num_replicas=2, rank=rank)
        seen += [row for keys in plan for row, _, valid in keys if valid]
    assert sorted(seen) == list(range(101))


def test_replicas_share_each_steps_shape():
    lengths = _lengths(300)
    plans = [BatchPlan(lengths, 4, buckets=[32, 64, 100], shuffle=True, seed=3, num_replicas=2, rank=r)
             for r in range(2)]
    for a, b in zip(*plans):
        assert a[0][1] == b[0][1]
        assert not {r for r, _, _ in a} & {r for r, _, _ in b}


def test_dynamic_and_max_length_padding():
    lengths = _lengths()
    dyn = BatchPlan(lengths, 8, padding="dynamic", fill="mask")
    for keys in dyn:
        assert keys[0][1] == max(lengths[r] for r, _, v in keys if v)
    fixed = BatchPlan(lengths, 8, padding="max_length", max_length=128)
    assert {keys[0][1] for keys in fixed} == {128}


def test_row_longer_than_longest_bucket_is_an_error():
    with pytest.raises(UserError, match="do not fit the longest bucket 64"):
        BatchPlan(_lengths(), 8, buckets=[32, 64])


def test_parse_buckets():
    assert parse_buckets("64,32, 128", 128) == [32, 64, 128]
    assert parse_buckets("auto", 128) == "auto"
    for bad in ("a,b", "0,64", ""):
        with pytest.raises(UserError):
            parse_buckets(bad, 128)
    with pytest.raises(UserError, match="longer than `max_length`"):
        parse_buckets("64,256", 128)


def test_auto_buckets_trade_compilations_for_padding():
    lengths = _lengths(3000)
    cheap = CostModel(compile_seconds=0.0, token_seconds=1e-4)
    dear = CostModel(compile_seconds=60.0, token_seconds=1e-4)
    # 1000 steps of batch 8 over 3000 rows, against 20 steps
    many, est_many = choose_buckets(lengths, 1000 * 8 / 3000, 128, cheap)
    few, est_few = choose_buckets(lengths, 1000 * 8 / 3000, 128, dear)
    short, _ = choose_buckets(lengths, 20 * 8 / 3000, 128, dear)
    assert len(many) > len(few) >= len(short) == 1
    assert many[-1] >= lengths.max() and few[-1] >= lengths.max()
    assert est_many["padding_efficiency"] > est_few["padding_efficiency"]
    # the chosen set is no worse than any single bucket or the fixed 32/64/96/128 recipe
    for buckets in ([104], [32, 64, 96, 128]):
        padded = np.asarray(buckets)[np.searchsorted(buckets, lengths)].sum() * 1000 * 8 / 3000
        assert est_few["estimated_seconds"] <= dear.total(len(buckets), padded) + 1e-6


def test_rows_longer_than_max_length_are_truncated_and_counted(mrpc_slice):
    from transformers import AutoTokenizer

    from xla_train.models import bundled_model_path

    _, splits = load_task(Source(data_dir=mrpc_slice))
    data, truncated = tokenize(splits, AutoTokenizer.from_pretrained(bundled_model_path()), 40)
    full, _ = tokenize(splits, AutoTokenizer.from_pretrained(bundled_model_path()), 512)
    assert truncated["train"] == sum(n > 40 for n in full["train"]["length"]) > 0
    assert max(data["train"]["length"]) == 40
