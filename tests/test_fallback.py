"""The gpu_fallback accelerator and strategies on the CPU with the bundled MiniLM (gloo processes: test_distributed.py)."""

import pytest
import torch
from conftest import run_cli

# The first six losses of the bundled MiniLM with the course's hyperparameters (the defaults) on
# the CPU (buckets 64,128, seed 42), as measured here. Data order, padding, head initialisation,
# dropout and the optimizer all feed into them: a silent change in any of those fails the test.
PINNED_LOSSES = [0.690841, 0.685246, 0.702139, 0.685597, 0.682586, 0.64638]


@pytest.mark.torch_native
def test_cpu_run_and_its_first_losses(mrpc_slice, tmp_path):
    proc, m = run_cli(["--backend", "cpu", "--data-dir", mrpc_slice, "--buckets", "64,128", "--max-steps", 6,
                       "--log-every", 1], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["backend"] == "cpu" and m["xla"] is None and m["world_size"] == 1
    assert m["steps"] == 6 and m["train_samples"] == 48
    assert m["eval"]["n"] == 48
    assert [s for s, _, _ in m["train_loss"]] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close([loss for _, loss, _ in m["train_loss"]], PINNED_LOSSES, atol=1e-4, rtol=0)
