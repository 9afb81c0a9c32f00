"""The XLA path, for real on PJRT's CPU device: few graphs, no syncs, no fallbacks, learning."""

import os

import pytest
import torch
from conftest import EVALUATION_SETUP, TINY, assert_same_weights, run_cli, write_slice

TRAIN_ROWS, EVAL_ROWS, BATCH = 80, 48, 8


@pytest.fixture(scope="session")
def bucketed_run(tmp_path_factory):
    """Two epochs over the first 80 training rows of the bundled MRPC (10 steps each) with the
    bundled MiniLM, two buckets, lr 2e-4, the loss read every 5 steps. XLA:CPU at its default
    optimisation level: the MiniLM's steps run 3 times slower at the tests' -O0
    (conftest.XLA_COMPILE_FLAGS). Its 5 compilations (about 60 s) are most of the run: the set-up
    took 128 s with 40 steps over 160 rows and 104 s with these, alone and back to back
    (2026-11-28, the machine shared)."""
    out = tmp_path_factory.mktemp("xla")
    proc, m = run_cli(["--backend", "xla", "--data-dir", write_slice(out / "mrpc", TRAIN_ROWS, EVAL_ROWS),
                       "--epochs", 2, "--lr", "2e-4", "--buckets", "64,128", "--log-every", 5], out,
                      env={"XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m


def test_bucketed_run_reports_xla_numbers(bucketed_run):
    m = bucketed_run
    assert m["backend"] == "xla" and m["world_size"] == 1 and m["device"].startswith("xla:0")
    assert m["steps"] == 20 and m["epochs"] == 2.0 and m["train_samples"] == 2 * TRAIN_ROWS
    assert m["eval"]["n"] == EVAL_ROWS
    assert m["buckets"] == [64, 128]
    assert 0 < m["padding_efficiency"] <= 1


def test_graphs_are_bounded_by_buckets(bucketed_run):
    xla = bucketed_run["xla"]
    # per bucket: one training graph and one evaluation graph, plus the very first training
    # step (its optimizer has no state yet): 2 * 2 + 1 = 5.
    assert xla["compiles"] <= 2 * len(bucketed_run["buckets"]) + 1
    assert xla["compiles_after_first_epoch"] == 0


def test_no_host_syncs_or_cpu_fallbacks(bucketed_run):
    xla = bucketed_run["xla"]
    assert xla["aten_fallbacks"] == 0
    # one read of the loss every --log-every 5 steps, nothing else
    assert xla["host_syncs_per_step"] <= 1 / 5
    # exactly one graph execution per training step and per evaluation batch
    eval_batches = EVAL_ROWS // BATCH * 2
    assert xla["executions"] == bucketed_run["steps"] + eval_batches


def test_loss_goes_down(bucketed_run):
    # mean loss over steps 1-5, 6-10 (epoch 1), 11-15 and 16-20 (epoch 2)
    losses = [loss for _, loss, _ in bucketed_run["train_loss"]]
    assert [s for s, _, _ in bucketed_run["train_loss"]] == [5, 10, 15, 20]
    assert losses[3] < losses[0] and losses[2] + losses[3] < losses[0] + losses[1]


def test_dynamic_padding_compiles_far_more_graphs(dynamic_run, tiny_bucketed_run):
    """The reason the package exists: the course's per-batch padding compiles a graph for nearly
    every batch; buckets compile a handful. Measured here: 17 against 5 over 16 steps."""
    _, dynamic, _ = dynamic_run
    buckets = tiny_bucketed_run[0]
    ratio = dynamic["xla"]["compiles"] / buckets["xla"]["compiles"]
    assert buckets["xla"]["compiles"] <= 5
    assert ratio >= 3, (buckets["xla"], dynamic["xla"])


def test_xla_computes_what_eager_torch_computes(mrpc_slice, tiny_model, tiny_bucketed_run, tmp_path):
    """The same run on the eager CPU backend: the same losses at every step and the same weights."""
    proc, eager = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                           "--output-dir", tmp_path / "eager"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla, xla_dir = tiny_bucketed_run
    assert [s for s, _, _ in xla["train_loss"]] == list(range(1, 17))
    torch.testing.assert_close([loss for _, loss, _ in xla["train_loss"]],
                               [loss for _, loss, _ in eager["train_loss"]], atol=1e-5, rtol=0)
    assert xla["param_checksum"] == pytest.approx(eager["param_checksum"], rel=1e-6)
    assert_same_weights(xla_dir, tmp_path / "eager", atol=1e-5)


def test_gradient_checkpointing_keeps_its_barrier_and_computes_the_same_run(mrpc_slice, tiny_model,
                                                                             tiny_bucketed_run, tmp_path):
    """--gradient-checkpointing on XLA: torch_xla's checkpoint puts optimization barriers into the
    training graphs (what keeps XLA from undoing the recomputation); the losses and weights
    are those of the run without it, with as many graphs and no more host syncs."""
    dump = tmp_path / "hlo"
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                       "--gradient-checkpointing", "--output-dir", tmp_path / "run"], tmp_path,
                      # the session's flags kept (-O0: conftest.XLA_COMPILE_FLAGS), not XLA's default level
                      env={"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the graphs as torch_xla hands them to XLA (XLA:CPU's own pipeline expands barriers at its
    # end; a TPU's keeps them through scheduling): the training graphs carry barriers
    graphs = [f.read_text() for f in dump.glob("*before_optimizations.txt")]
    assert sum("opt-barrier" in g for g in graphs) >= 2, len(graphs)  # the first step's graph, then the stateful one
    xla, xla_dir = tiny_bucketed_run
    assert m["memory"]["gradient_checkpointing"] and not xla["memory"]["gradient_checkpointing"]
    assert m["memory"]["activation_bytes_estimate"] < xla["memory"]["activation_bytes_estimate"]
    torch.testing.assert_close([loss for _, loss, _ in m["train_loss"]],
                               [loss for _, loss, _ in xla["train_loss"]], atol=1e-5, rtol=0)
    assert_same_weights(tmp_path / "run", xla_dir, atol=1e-5)
    assert m["xla"]["compiles"] == xla["xla"]["compiles"]
    assert m["xla"]["host_syncs_per_step"] == xla["xla"]["host_syncs_per_step"]


def test_bf16_with_gradient_accumulation(mrpc_slice, tiny_model, tmp_path):
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 6,
                       "--precision", "bf16", "--grad-accum", 2, "--buckets", "64,128", "--log-every", 3], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["precision"] == "bf16" and m["steps"] == 6 and m["train_samples"] == 6 * 2 * BATCH
    assert m["xla"]["aten_fallbacks"] == 0
    assert all(0 < loss < 2 for _, loss, _ in m["train_loss"])


def test_compile_cache_counters_are_reported(mrpc_slice, tiny_model, tmp_path):
    """The persistent cache writes every graph; a second run finds them. XLA:CPU cannot load a
    cached executable (TPU and GPU can), which the run reports as load failures, not hits."""
    args = ["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 2,
            "--buckets", "128", "--compile-cache", tmp_path / "cache"]
    proc, first = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first["xla"]["cache_misses"] >= first["xla"]["compiles"] > 0
    assert any((tmp_path / "cache").iterdir())
    assert any((tmp_path / "cache" / "p0").iterdir())  # a folder per process (process index 0 here)
    proc, second = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["xla"]["cache_hits"] + second["xla"]["cache_load_failures"] > 0


EVALUATE_ONCE = EVALUATION_SETUP.format(engine="", batch=8) + """
for _ in range(2):  # the second pass runs compiled graphs only
    before = met.metric_data("TransferFromDeviceTime")
    results = evaluate_model(engine, model, loader, task.objective, task.objective.load_metric())
    transfers = met.metric_data("TransferFromDeviceTime")[0] - (before[0] if before else 0)
print(json.dumps({"batches": len(loader), "transfers": transfers, "n": results["n"]}))
"""


def test_evaluation_copies_to_the_host_once_per_split(mrpc_slice, tiny_model, tmp_path):
    """The predictions of every batch are gathered on the device and copied to the host once, at
    the end of the split: the host never waits for a batch (it did for each)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", EVALUATE_ONCE, str(tiny_model), str(mrpc_slice)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batches"] == 6 and out["n"] == 48 and out["transfers"] == 1
