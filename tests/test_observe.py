"""Where a run's time goes: a profile of a window of steps (TensorBoard's profile plugin layout),
the trackers users already use (MLflow read back with its client, W&B offline), all on at once
without a host sync more per step. One XLA:CPU run and one CPU run serve every test."""

import json

import pytest
from conftest import run_cli

TRACKED = ["--report-to", "tensorboard,mlflow,wandb"]


@pytest.fixture(scope="session")
def observed(mrpc_slice, tiny_model, tmp_path_factory):
    """20 XLA:CPU steps of the tiny BERT (the loss read every 10) profiled from 12 to 16,
    reporting to all three trackers (MLflow at an sqlite URI the test names, W&B offline)."""
    out = tmp_path_factory.mktemp("observed")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{out / 'tracking.db'}", "WANDB_MODE": "offline",
           "WANDB_API_KEY": "", "HOME": str(out)}
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 20,
                       "--buckets", "64,128", "--profile-steps", "12:16", *TRACKED, "--output-dir", out / "run"],
                      out, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out


def test_an_xla_profile_lands_where_tensorboards_profile_plugin_looks(observed):
    """The plugin lists runs as LOGDIR/plugins/profile/RUN/ holding HOST.xplane.pb."""
    _, out = observed
    found = list((out / "run" / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(found) == 1 and found[0].stat().st_size > 1000, found


def test_mlflow_holds_the_loss_history_and_the_final_metrics(observed):
    from mlflow import MlflowClient

    m, out = observed
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'tracking.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("xla-train").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [h.step for h in history] == [s for s, _, _ in m["train_loss"]] == [10, 20]
    for h, (_, loss, _) in zip(history, m["train_loss"]):
        assert h.value == pytest.approx(loss, abs=1e-5)
    assert run.data.metrics["final/accuracy"] == pytest.approx(m["eval"]["accuracy"])
    assert run.data.params["max_steps"] == "20" and run.info.run_name == m["run_id"]


def test_wandb_writes_an_offline_run_in_the_output_folder(observed):
    _, out = observed
    runs = list((out / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs


def test_observing_adds_no_host_sync(observed):
    """Profile and trackers on: still one read of the loss per log point (2 in 20 steps), no CPU
    fallback, no graph after the first epoch's."""
    m, _ = observed
    assert m["xla"]["host_syncs_per_step"] <= 0.1 and m["xla"]["aten_fallbacks"] == 0


def test_a_cpu_run_leaves_a_torch_profiler_trace(mrpc_slice, tiny_model, tmp_path):
    proc, m = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 3,
                       "--profile-steps", "2:3", "--output-dir", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (trace,) = (tmp_path / "run" / "profile").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e.get("name") for e in events} >= {"train_step_2", "train_step_3"}
    assert abs(sum(v for k, v in m["goodput"]["seconds"].items() if k != "wall")
               - m["goodput"]["seconds"]["wall"]) <= 0.05 * m["goodput"]["seconds"]["wall"]


@pytest.mark.parametrize("args, message", [
    (["--profile-steps", "5"], "--profile-steps must be A:B"),
    (["--profile-steps", "4:2", "--output-dir", "out"], "A must not be after B"),
    (["--profile-steps", "1:2"], "--profile-steps needs a local --output-dir"),
    (["--report-to", "comet"], "--report-to takes tensorboard, mlflow, wandb or none, comma-separated; not 'comet'"),
])
def test_bad_observer_options_are_one_line(args, message, capsys):
    from xla_train.cli import main

    assert main(["train", "--backend", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_tracker_that_cannot_start_stops_the_run_before_training(mrpc_slice, tiny_model, capsys, monkeypatch):
    from xla_train.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "1", "--report-to", "mlflow"]) == 2
    assert capsys.readouterr().err == ("xla-train: error: --report-to mlflow needs MLFLOW_TRACKING_URI or a local "
                                       "--output-dir\n")
