"""The gpu_fallback backend on the CPU: one process, and two real gloo processes."""

from conftest import run_cli, write_slice


def test_cpu_run(mrpc_slice, tmp_path):
    proc, m = run_cli(["--backend", "cpu", "--data-dir", mrpc_slice, "--max-steps", 10, "--log-every", 5], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["backend"] == "cpu" and m["xla"] is None and m["world_size"] == 1
    assert m["steps"] == 10 and m["train_samples"] == 80
    assert m["eval"]["n"] == 48
    assert [s for s, _, _ in m["train_loss"]] == [5, 10]


def test_two_gloo_processes_agree_and_score_every_dev_row_once(tmp_path):
    data = write_slice(tmp_path / "mrpc", 160, 408)
    proc, m = run_cli(["--backend", "cpu", "--num-processes", 2, "--data-dir", data, "--max-steps", 6,
                       "--output-dir", tmp_path / "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["world_size"] == 2 and m["train_samples"] == 6 * 8 * 2
    assert m["replicas_identical"] is True
    assert m["eval"]["n"] == 408
    # the saved model loads in plain transformers
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert model.config.num_labels == 2
