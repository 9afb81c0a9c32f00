"""The gpu_fallback accelerator and strategies on the CPU with the bundled MiniLM (gloo processes:
test_distributed.py)."""

import json

import pytest
import torch

# The first six losses of the bundled MiniLM with the course's hyperparameters (the defaults) on
# the CPU (buckets 64,128, seed 42), as measured here. Data order, padding, head initialisation,
# dropout and the optimizer all feed into them: a silent change in any of those fails the test.
PINNED_LOSSES = [0.690841, 0.685246, 0.702139, 0.685597, 0.682586, 0.64638]


# The CPU run that pins them is tests/test_recipes.py's MRPC recipe run (one run serves both).


@pytest.mark.slow  # inductor builds C++ for every graph: minutes on 2 cores while its cache is cold
def test_compile_trains_the_same_losses_with_one_graph_per_bucket(mrpc_slice, tiny_dropout_model, tmp_path):
    """--compile on the CPU, in this process so that dynamo's own counters are read here: the tiny
    BERT with dropout 0.1, 24 steps (an epoch is 20) over buckets 64,128, against the same run eager.
    The same losses at every step (dropout's masks come from torch's generator in both); a graph
    per bucket in training and one per bucket in evaluation, none after the first epoch, no graph
    break; the metrics count them as dynamo does."""
    from torch._dynamo.utils import counters

    from xla_train.commands.cli import main

    args = ["train", "--backend", "cpu", "--model", tiny_dropout_model, "--data-dir", mrpc_slice, "--buckets",
            "64,128", "--max-steps", 24, "--log-every", 1]
    runs = {}
    for flag in ([], ["--compile"]):
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        out = tmp_path / f"metrics{len(runs)}.json"
        assert main([*map(str, args), *flag, "--metrics-out", str(out)]) == 0
        runs[bool(flag)] = (json.loads(out.read_text()), counters["stats"]["unique_graphs"] - graphs,
                            sum(counters["graph_break"].values()) - breaks)
    (eager, eager_graphs, _), (compiled, graphs, breaks) = runs[False], runs[True]
    assert eager_graphs == 0 and eager["torch_compile"] is None

    def losses(m):
        return [loss for _, loss, _ in m["train_loss"]]

    assert len(losses(compiled)) == 24
    torch.testing.assert_close(losses(compiled), losses(eager), atol=1e-5, rtol=0)  # measured: equal to 1e-6
    assert compiled["buckets"] == [64, 128]
    assert graphs == compiled["torch_compile"]["compiles"] == 2 * 2  # (training, evaluation) x 2 buckets
    assert compiled["torch_compile"]["compiles_after_first_epoch"] == 0 and breaks == 0
    assert compiled["goodput"]["seconds"]["compile"] == pytest.approx(compiled["torch_compile"]["compile_seconds"],
                                                                       abs=2e-3)
