"""Data parallelism checked against a single-process run on the same global batch: SPMD over 4
XLA:CPU devices, two gloo processes, and torchrun. The tiny model has no dropout, so the runs
must agree to float precision."""

import os
import subprocess
import sys

import torch

from conftest import ROOT, assert_same_weights, run_cli


def test_spmd_over_four_devices_matches_one_device(mrpc_slice, tiny_model, tmp_path):
    common = ["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 5,
              "--log-every", 1, "--buckets", "64,128"]
    proc, spmd = run_cli([*common, "--strategy", "spmd", "--batch-size", 2, "--output-dir", tmp_path / "spmd"],
                         tmp_path, env={"CPU_NUM_DEVICES": "4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, single = run_cli([*common, "--batch-size", 8, "--output-dir", tmp_path / "single"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert spmd["world_size"] == 4 and single["world_size"] == 1
    assert spmd["train_samples"] == single["train_samples"] == 40
    torch.testing.assert_close([l for _, l, _ in spmd["train_loss"]], [l for _, l, _ in single["train_loss"]],
                               atol=1e-5, rtol=0)
    assert_same_weights(tmp_path / "spmd", tmp_path / "single", atol=1e-6)
    assert spmd["eval"]["n"] == 48
    assert spmd["xla"]["aten_fallbacks"] == 0


def test_two_gloo_processes_match_one_process(mrpc_slice, tiny_model, tmp_path):
    common = ["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 6]
    proc, two = run_cli([*common, "--num-processes", 2, "--batch-size", 8, "--output-dir", tmp_path / "two"],
                        tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, one = run_cli([*common, "--batch-size", 16, "--output-dir", tmp_path / "one"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert two["world_size"] == 2 and two["replicas_identical"]
    assert two["eval"]["n"] == one["eval"]["n"] == 48
    assert_same_weights(tmp_path / "two", tmp_path / "one", atol=1e-6)


def test_torchrun_starts_the_same_entry_point(mrpc_slice, tiny_model, tmp_path):
    out = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "xla_train", "train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
         "--max-steps", "4", "--metrics-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and m["replicas_identical"] and m["eval"]["n"] == 48
