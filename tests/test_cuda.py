"""The CUDA fallback on a real GPU. CI has none, so CI skips these (and says so); they ran on a lent
NVIDIA H100 (benchmarks/RESULTS.md, "The CUDA path on a GPU"). The same runs as the CPU tests,
with the GPU's own checks: it computes what the CPU computes (fp32), bf16 autocast trains, and a
run stopped by SIGTERM resumes exactly."""


import pytest
import torch
from conftest import TINY, assert_same_weights, run_cli, stop_and_resume

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@pytest.fixture(scope="session")
def cuda_run(mrpc_slice, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda")
    proc, m = run_cli(["--backend", "cuda", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                       "--output-dir", tmp / "out"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, tmp / "out"


def test_cuda_computes_what_the_cpu_computes(cuda_run, mrpc_slice, tiny_model, tmp_path):
    """fp32 (PyTorch leaves TF32 off for matrix products): the same losses at every step and the
    same weights as the eager CPU run."""
    m, out = cuda_run
    assert m["backend"] == "cuda" and "NVIDIA" in m["device"]  # the GPU by name
    proc, cpu = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                         "--output-dir", tmp_path / "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _, _ in m["train_loss"]] == [s for s, _, _ in cpu["train_loss"]]
    torch.testing.assert_close([loss for _, loss, _ in m["train_loss"]],
                               [loss for _, loss, _ in cpu["train_loss"]], atol=1e-4, rtol=0)
    assert_same_weights(out, tmp_path / "cpu", atol=1e-4)
    assert m["memory"]["peak_bytes"] > 0  # torch.cuda's own count


def test_cuda_bf16_autocast_trains(cuda_run, mrpc_slice, tiny_model, tmp_path):
    fp32, _ = cuda_run
    proc, m = run_cli(["--backend", "cuda", "--precision", "bf16", "--model", tiny_model, "--data-dir", mrpc_slice,
                       *TINY, "--output-dir", tmp_path / "bf16"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["precision"] == "bf16"
    losses = [loss for _, loss, _ in m["train_loss"]]
    assert all(abs(a - b) < 0.05 for a, b in zip(losses, [loss for _, loss, _ in fp32["train_loss"]]))
    assert 0 <= m["eval"]["accuracy"] <= 1


def test_cuda_sigterm_then_resume_equals_the_uninterrupted_run(mrpc_slice, tiny_dropout_model, tmp_path):
    """The GPU's random state (dropout) is saved and restored with the checkpoint."""
    args = ["--backend", "cuda", "--epochs", "10", "--log-every", "3", "--model", tiny_dropout_model,
            "--data-dir", mrpc_slice, "--max-steps", 40, "--save-every", 4]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "stopped"
    _, _, resumed = stop_and_resume(args, out, tmp_path)
    assert 4 <= resumed["first_step"] < 40 and resumed["steps"] == whole["steps"] == 40
    for (_, a, _), (_, b, _) in zip(resumed["train_loss"], whole["train_loss"]):
        assert abs(a - b) < 1e-5
    assert_same_weights(out, tmp_path / "whole", atol=1e-5)


def test_cuda_gradient_checkpointing_lowers_the_peak_and_keeps_the_losses(mrpc_slice, tmp_path):
    """The bundled MiniLM at batch 32 x 128 tokens: with --gradient-checkpointing torch.cuda's peak
    is lower and the losses are the same (fp32, no dropout difference: the same seed)."""
    runs = {}
    for name, extra in (("kept", []), ("checkpointed", ["--gradient-checkpointing"])):
        proc, runs[name] = run_cli(["--backend", "cuda", "--data-dir", mrpc_slice, "--batch-size", 32, "--buckets", 128,
                                    "--max-steps", 5, "--log-every", 1, *extra], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    kept, checkpointed = runs["kept"], runs["checkpointed"]
    assert checkpointed["memory"]["peak_bytes"] < kept["memory"]["peak_bytes"]
    torch.testing.assert_close([loss for _, loss, _ in checkpointed["train_loss"]],
                               [loss for _, loss, _ in kept["train_loss"]], atol=1e-4, rtol=0)


def test_cuda_second_compiled_run_takes_its_graphs_from_the_cache(mrpc_slice, tiny_model, tmp_path):
    """--compile (CUDA graphs) with --compile-cache, the same job twice in fresh processes: the
    second loads every graph from the folder the first filled, in less compile time, and trains
    the same losses; --tf32 is accepted here (and torch's TF32 advice stays off the console without it)."""
    cache = tmp_path / "cache"
    args = ["--backend", "cuda", "--model", tiny_model, "--data-dir", mrpc_slice, "--buckets", 128, "--max-steps", 4,
            "--log-every", 1, "--compile", "--compile-cache", cache]
    runs = []
    for _ in range(2):
        proc, m = run_cli(args, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "TensorFloat32" not in proc.stderr
        runs.append(m["torch_compile"])
    first, second = runs
    assert first["cache_hits"] == 0 and first["cache_misses"] == first["compiles"] > 0
    assert second["cache_hits"] == second["compiles"] == first["compiles"] and second["cache_misses"] == 0
    assert second["compile_seconds"] < first["compile_seconds"]
    proc, m = run_cli([*args, "--tf32"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
