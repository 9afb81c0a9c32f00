"""Where a run's time goes: a profile of a window of steps (TensorBoard's profile plugin layout),
the trackers users already use (MLflow read back with its client, W&B offline), all on at once
without a host sync more per step. One XLA:CPU run and one CPU run serve most tests; two short
XLA:CPU runs with gradient accumulation into gs:// (the storage emulator) serve the profile's
graphs and its upload."""

import gzip
import json
import sys

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
    assert found[0].parent.name == "steps_12_16"


@pytest.fixture(scope="session")
def accumulated(mrpc_slice, tiny_model, gcs_emulator, tmp_path_factory):
    """6 optimizer steps of 2 micro-batches each on XLA:CPU into gs://, without and with
    --profile-steps 3:4. Returns {"plain": metrics, "profiled": metrics}."""
    out = tmp_path_factory.mktemp("accumulated")
    runs = {}
    for name, extra in (("plain", []), ("profiled", ["--profile-steps", "3:4"])):
        proc, runs[name] = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice,
                                    "--max-steps", 6, "--grad-accum", 2, "--buckets", 128,
                                    "--output-dir", f"gs://xla-train-test/accumulated-{name}", *extra],
                                   out, env=gcs_emulator)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


def test_profiling_keeps_the_runs_graphs(accumulated):
    """The window's annotations cut no graph and move no cut: as many compilations and executions
    as without them (torch_xla's StepTrace around a step of 2 micro-batches fused them into one
    new graph: 5 compilations and 16 executions against 4 and 18)."""
    keys = ("compiles", "executions", "host_syncs_per_step", "aten_fallbacks")
    plain, profiled = ({k: accumulated[name]["xla"].get(k) for k in keys} for name in ("plain", "profiled"))
    assert profiled == plain and plain["executions"] > 2 * 6


def test_a_profile_reaches_a_gs_output_folder(accumulated, gcs_emulator):
    """Each host's trace, written locally, is uploaded as OUTPUT_DIR/profile/plugins/profile/RUN/
    HOST.xplane.pb (RUN named by the window, alike on every host of a pod). Its events hold every
    micro-batch of steps 3 and 4, and no other step's."""
    from google.cloud import storage

    bucket = storage.Client().bucket("xla-train-test")
    blobs = {b.name.rsplit("/", 1)[1]: b for b in bucket.list_blobs(prefix="accumulated-profiled/profile/")}
    assert {b.name.rsplit("/", 1)[0] for b in blobs.values()} == {
        "accumulated-profiled/profile/plugins/profile/steps_3_4"}
    (xplane,) = (b for name, b in blobs.items() if name.endswith(".xplane.pb"))
    assert xplane.size > 1000
    (trace,) = (b for name, b in blobs.items() if name.endswith(".trace.json.gz"))
    events = json.loads(gzip.decompress(trace.download_as_bytes()))["traceEvents"]
    assert sorted(e["args"]["step_num"] for e in events if e.get("name") == "train_step") == ["3", "3", "4", "4"]
    assert not list(bucket.list_blobs(prefix="accumulated-plain/profile/"))


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
    (["--profile-steps", "1:2"], "--profile-steps needs an --output-dir"),
    (["--report-to", "comet"], "--report-to takes tensorboard, mlflow, wandb or none, comma-separated; not 'comet'"),
])
def test_bad_observer_options_are_one_line(args, message, capsys):
    from xla_train.commands.cli import main

    assert main(["train", "--backend", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_tracker_that_cannot_start_stops_the_run_before_training(mrpc_slice, tiny_model, capsys, monkeypatch,
                                                                   tmp_path):
    from xla_train.commands.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "1", "--report-to", "mlflow"]) == 2
    assert capsys.readouterr().err == ("xla-train: error: --report-to mlflow needs MLFLOW_TRACKING_URI or a local "
                                       "--output-dir\n")
    # without the trackers extra (make test-torch's environment): one line naming it
    for module in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)  # `import mlflow` then raises ModuleNotFoundError
        assert main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                     "--max-steps", "1", "--report-to", module, "--output-dir", str(tmp_path / module)]) == 2
        assert capsys.readouterr().err == (f"xla-train: error: --report-to {module} needs {module}, which is not "
                                           "installed: pip install 'xla-train[trackers]'\n")
