"""TensorBoard events, the run report and the recompilation explainer, for real on XLA:CPU."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli, run_python, write_slice

from xla_train.observe.report import TAGS, read_scalars

WARNING = "xla-train: warning: recompilation:"


def run_patched(patch, args):
    """`xla-train train ARGS` in a fresh process on XLA:CPU, after running `patch` (Python) in it."""
    script = (f"{patch}\nimport sys\nfrom xla_train.commands import cli\n"
              f"sys.exit(cli.main({['train', *map(str, args)]!r}))\n")
    return run_python(["-c", script], {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"},
                      timeout=600)


def warnings_in(stderr):
    return [line for line in stderr.splitlines() if WARNING in line]


@pytest.fixture(scope="session")
def short_data(tmp_path_factory):
    """160 training rows (20 steps of 8) and one evaluation batch."""
    return write_slice(tmp_path_factory.mktemp("data") / "mrpc", 160, 8)


@pytest.fixture(scope="session")
def xla_run(short_data, tiny_model, tmp_path_factory):
    """One epoch of 20 steps with one bucket, logging every 10 steps, into an output folder."""
    tmp = tmp_path_factory.mktemp("run")
    out = tmp / "out"
    proc, m = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", short_data, "--max-steps", 20,
                       "--buckets", "128", "--log-every", 10, "--output-dir", out], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, m, out


def test_event_files_hold_every_tag_at_each_log_point(xla_run):
    _, m, out = xla_run
    scalars = read_scalars(out / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "throughput", "compiles", "compile_seconds", "host_syncs"):
        assert scalars[TAGS[key]][0] == [10, 20], key
    assert scalars[TAGS["accuracy"]] == ([20], [pytest.approx(m["eval"]["accuracy"])])
    assert scalars[TAGS["f1"]][0] == [20]
    # the logged losses are the run's own, the gradient norm and throughput are real numbers
    assert scalars[TAGS["loss"]][1] == pytest.approx([loss for _, loss, _ in m["train_loss"]], rel=1e-5)
    assert all(v > 0 for v in scalars[TAGS["grad_norm"]][1] + scalars[TAGS["throughput"]][1])
    # counters over steps: the one bucket's graphs (first step, then the stateful step) by step 10
    assert scalars[TAGS["compiles"]][1] == [2, 2]


def test_logging_adds_no_host_sync(xla_run):
    proc, m, _ = xla_run
    # one transfer per log point (loss and gradient norm together), nothing else
    assert m["xla"]["host_syncs_per_step"] <= 0.1
    assert m["xla"]["aten_fallbacks"] == 0
    assert m["xla"]["executions"] == 20 + 1  # one graph per step and per evaluation batch
    assert m["xla"]["replicas_sharing_counters"] == 1
    assert WARNING not in proc.stderr


def test_run_folder_holds_metrics_compilations_and_report(xla_run):
    _, m, out = xla_run
    assert json.loads((out / "metrics.json").read_text())["steps"] == m["steps"] == 20
    log = json.loads((out / "compilations.json").read_text())
    assert log["warning"] is None
    train = [e for e in log["compilations"] if e["phase"] == "train"]
    assert [(e["step"], e["shape"]) for e in train] == [(1, [8, 128]), (2, [8, 128])]
    assert sum(e["graphs"] for e in log["compilations"]) == m["xla"]["compiles"]
    assert all(e["seconds"] > 0 and e["cause"] for e in log["compilations"])
    for name in ("overview", "loss_lr", "throughput", "padding"):
        png = out / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    md = (out / "report" / "report.md").read_text()
    assert "| 1 | train | (8, 128) | 1 |" in md and "| 128 | 20 |" in md


def test_report_command_rebuilds_the_report(xla_run, tmp_path):
    _, _, out = xla_run
    (out / "report" / "overview.png").unlink()
    proc = subprocess.run([sys.executable, "-m", "xla_train", "report", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out / "report" / "report.md")
    assert (out / "report" / "overview.png").stat().st_size > 10_000


def test_report_says_when_threaded_replicas_share_the_counters(xla_run):
    """Colab's TPU v2-8/v3-8 run two replicas as threads of one process; torch_xla's counters are
    the process's, so the report says whose they are (not runnable here: one replica per process)."""
    from xla_train.observe.report import markdown

    _, m, out = xla_run
    log = json.loads((out / "compilations.json").read_text())
    assert "share" not in markdown(m, log)
    shared = {**m, "xla": {**m["xla"], "replicas_sharing_counters": 2}}
    assert "| XLA counters below | this process's, which 2 replicas (threads) share |" in markdown(shared, log)


def test_report_on_a_folder_without_a_run_is_a_user_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "xla_train", "report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"xla-train: error: {tmp_path} holds no run (no metrics.json); "
                                                f"write one with xla-train train --output-dir {tmp_path}"]


def test_off_bucket_batch_mid_run_is_named(short_data, tiny_model, tmp_path):
    """A collator that pads the 6th training batch to 120 instead of the bucket 128 (a stand-in
    for a custom collator's bug): XLA compiles a real new graph at step 6 and the explainer names
    the shape and the bucket it missed. Only xla_train's own collator is replaced."""
    out = tmp_path / "out"
    patch = """
from xla_train.core import batching
calls = [0]
pad = batching.PadCollator.__call__
def off_bucket(self, items):
    calls[0] += 1
    if calls[0] == 6:
        items = [(features, 120, valid) for features, _, valid in items]
    return pad(self, items)
batching.PadCollator.__call__ = off_bucket
"""
    proc = run_patched(patch, ["--backend", "xla", "--model", tiny_model, "--data-dir", short_data, "--max-steps", 6,
                               "--buckets", "128", "--output-dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = warnings_in(proc.stderr)
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert ("step 6 compiled a new graph for input shape (8, 120): length 120 is not one of the buckets [128] "
            "(it fits bucket 128)") in warnings[0]
    log = json.loads((out / "compilations.json").read_text())
    assert log["warning"] in warnings[0]
    assert {"step": 6, "shape": [8, 120], "graphs": 1}.items() <= next(
        e for e in log["compilations"] if e["step"] == 6).items()
    assert "| 6 | train | (8, 120) | 1 |" in (out / "report" / "report.md").read_text()


def test_sync_inside_the_step_is_named_by_its_python_frame(short_data, tiny_model, tmp_path):
    """transformers' stock SDPA mask check (`padding_mask.all()`) reads the device inside every
    forward. The run avoids it with its own attention function; with that switched off (the
    seed's setup), the explainer names transformers' frame behind the sync."""
    out = tmp_path / "out"
    patch = """
from xla_train.core import xla
xla._register_attention = lambda: None  # keep transformers' stock "sdpa"
xla.XLA_ATTENTION = "sdpa"
"""
    proc = run_patched(patch, ["--backend", "xla", "--model", tiny_model, "--data-dir", short_data, "--max-steps", 2,
                               "--buckets", "128", "--output-dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = warnings_in(proc.stderr)
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "step 1: a device-to-host read inside the training step cut its graph, at " \
           "_ignore_bidirectional_mask_sdpa (" in warnings[0]
    assert "transformers/masking_utils.py:" in warnings[0]
    first = json.loads((out / "compilations.json").read_text())["compilations"][0]
    assert first["step"] == 1 and first["graphs"] == 2  # the sync cuts the step in two graphs
    assert first["frame"].startswith("_ignore_bidirectional_mask_sdpa")


def test_dynamic_padding_warns_once_past_the_threshold(dynamic_run):
    """The course's per-batch padding: every new batch length compiles; the run warns once, when
    the training graphs pass the threshold (one unbounded bucket + 2 = 3), naming the shape."""
    proc, m, out = dynamic_run
    log = json.loads((out / "compilations.json").read_text())
    train = [e for e in log["compilations"] if e["phase"] == "train"]
    assert [e["step"] for e in train[:4]] == [1, 2, 3, 4]  # lengths 69, 68, 79, 65 with seed 42
    fourth = train[3]
    warnings = warnings_in(proc.stderr)
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert (f"4 training graphs compiled by step {fourth['step']} (more than 3), the latest for new input shape "
            f"{tuple(fourth['shape'])}") in warnings[0]
    assert "--padding dynamic compiles a graph for every batch length" in warnings[0]


def test_fallback_backend_writes_events_without_xla_counters(short_data, tiny_model, tmp_path):
    out = tmp_path / "out"
    proc, m = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", short_data, "--max-steps", 4,
                       "--log-every", 2, "--output-dir", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(out / "tensorboard")
    assert scalars[TAGS["loss"]][0] == [2, 4] and scalars[TAGS["grad_norm"]][0] == [2, 4]
    assert not any(tag.startswith("xla/") for tag in scalars)
    assert json.loads((out / "compilations.json").read_text())["compilations"] == []
    assert (out / "report" / "overview.png").stat().st_size > 10_000


def graphs_in(debug_log):
    """[(graph hash, graph outputs, Python frames)] for each compilation torch_xla's analysis logged."""
    return [(block.split("Graph Hash: ")[1].split()[0], int(block.split("Number of Graph Outputs: ")[1].split()[0]),
             block.split("Python Frame Triggered Execution:")[1].split("-----")[0])
            for block in debug_log.split("Compilation Analysis: Compilation Cause")[1:]]


def test_replicas_agreeing_at_a_log_point_compile_no_new_step_graph(xla_run, short_data, tiny_model, tmp_path):
    """The several-replica agreement on one XLA:CPU replica: the stop flags go through a real
    xm.all_gather (at every step here; several replicas do it at log points). The step's graph is
    cut before the flags are built, so the gather compiles as a small graph of its own and the
    step runs the graphs the plain run compiled: built on the pending step, the gather would make
    step and gather one new graph (a second full-step compile per bucket)."""
    out = tmp_path / "out"
    patch = """
import torch_xla.core.xla_model as xm
from xla_train.run.state import RunState
from xla_train.parallel.xla_strategies import XlaDdp
RunState._agree = RunState._agree_across  # the path several replicas take
XlaDdp.gather = lambda self, tensor: xm.all_gather(tensor, dim=0)  # a real collective on one replica
"""
    proc = run_patched(patch, ["--backend", "xla", "--model", tiny_model, "--data-dir", short_data, "--max-steps", 4,
                               "--buckets", "128", "--log-every", 2, "--output-dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = graphs_in((xla_run[2] / "xla_debug.log").read_text())
    agreeing = graphs_in((out / "xla_debug.log").read_text())
    step_graphs = {h for h, outputs, _ in plain if outputs > 100}
    assert {h for h, outputs, _ in agreeing if outputs > 100} == step_graphs, (plain, agreeing)
    new = [(h, outputs) for h, outputs, frames in agreeing if "_agree_across" in frames and h not in step_graphs]
    # the flags' gathers alone (the stop check's two flags, the finite check's one): one output each
    assert len(new) == 2 and all(outputs == 1 for _, outputs in new), agreeing


def test_goodput_splits_the_wall_time_into_phases_that_add_up(xla_run, previous_run):
    """XLA:CPU (compilations) and the CPU: start-up, compilation, training steps, data, evaluation,
    checkpoints and the rest add up to the wall time (within 5%: nothing is counted twice); the
    ratio is the training steps' share; start-up's parts (imports, data, model, device set-up)
    add up to it (within the rounding), each measured; the report shows them."""
    _, xla, out = xla_run
    cpu = json.loads((previous_run / "metrics.json").read_text())
    for m in (xla, cpu):
        goodput, seconds = m["goodput"], m["goodput"]["seconds"]
        assert set(seconds) == {"startup", "compile", "train_steps", "data", "eval", "checkpoint", "other", "wall"}
        assert abs(sum(v for k, v in seconds.items() if k != "wall") - seconds["wall"]) <= 0.05 * seconds["wall"]
        assert seconds["train_steps"] > 0 and seconds["startup"] > 0 and seconds["eval"] > 0
        assert goodput["ratio"] == round(seconds["train_steps"] / seconds["wall"], 4)
        startup = goodput["startup"]
        assert list(startup) == ["imports", "data", "model", "device"]
        assert all(v > 0 for v in startup.values()), startup  # each part takes some time: none is left out
        assert abs(sum(startup.values()) - seconds["startup"]) <= 0.003, (startup, seconds["startup"])
    assert xla["goodput"]["seconds"]["compile"] > 0 and cpu["goodput"]["seconds"]["compile"] == 0
    assert cpu["goodput"]["seconds"]["checkpoint"] > 0  # checkpoints at steps 2 and 4
    assert "| goodput (training steps / wall) |" in (out / "report" / "report.md").read_text()
    assert "| time: training steps |" in (out / "report" / "report.md").read_text()
    assert "| start-up by part | imports " in (out / "report" / "report.md").read_text()
