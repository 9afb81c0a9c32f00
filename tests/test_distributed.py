"""Data parallelism checked against a single-process run on the same global batch: SPMD over 4
XLA:CPU devices, two gloo processes, and torchrun. The tiny model has no dropout, so the runs
must agree to float precision."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, assert_same_weights, run_cli, run_python, write_slice

from xla_train.core.errors import UserError


def test_spmd_over_four_devices_matches_one_device(mrpc_slice, tiny_model, tiny_bucketed_run, tmp_path):
    """The global batch of 8 split over 4 devices against the one-device run of conftest."""
    proc, spmd = run_cli(["--backend", "xla", "--model", tiny_model, "--data-dir", mrpc_slice, *TINY,
                          "--strategy", "spmd", "--batch-size", 2, "--output-dir", tmp_path / "spmd"],
                         tmp_path, env={"CPU_NUM_DEVICES": "4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, single_dir = tiny_bucketed_run
    assert spmd["world_size"] == 4 and single["world_size"] == 1
    assert spmd["train_samples"] == single["train_samples"] == 16 * 8
    torch.testing.assert_close([loss for _, loss, _ in spmd["train_loss"]],
                               [loss for _, loss, _ in single["train_loss"]], atol=1e-5, rtol=0)
    assert_same_weights(tmp_path / "spmd", single_dir, atol=1e-6)
    assert spmd["eval"]["n"] == 48
    assert spmd["xla"]["aten_fallbacks"] == 0


@pytest.mark.torch_native
def test_two_gloo_processes_match_one_process(tiny_model, tmp_path):
    """44 dev rows do not fill the last 2 x 8 batch: every row is still scored once. DDP and
    FSDP2 (--strategy fsdp: each process holds half of every weight) train the same model."""
    data = write_slice(tmp_path / "mrpc", 160, 44)
    common = ["--backend", "cpu", "--model", tiny_model, "--data-dir", data, "--max-steps", 6]
    proc, two = run_cli([*common, "--num-processes", 2, "--batch-size", 8, "--output-dir", tmp_path / "two"],
                        tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, one = run_cli([*common, "--batch-size", 16, "--output-dir", tmp_path / "one"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert two["world_size"] == 2 and two["replicas_identical"] and two["train_samples"] == 6 * 8 * 2
    assert two["eval"]["n"] == one["eval"]["n"] == 44
    assert two["eval"] == one["eval"]
    assert_same_weights(tmp_path / "two", tmp_path / "one", atol=1e-6)
    proc, fsdp = run_cli([*common, "--num-processes", 2, "--batch-size", 8, "--strategy", "fsdp",
                          "--output-dir", tmp_path / "fsdp"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fsdp["replicas_identical"] and fsdp["eval"] == one["eval"]
    assert fsdp["memory"]["param_bytes_per_device"] == -(-fsdp["memory"]["param_bytes_total"] // 2)
    assert_same_weights(tmp_path / "fsdp", tmp_path / "one", atol=1e-6)
    # the saved models load in plain transformers
    from transformers import AutoModelForSequenceClassification

    for folder in ("two", "fsdp"):
        assert AutoModelForSequenceClassification.from_pretrained(tmp_path / folder).config.num_labels == 2


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


@pytest.mark.parametrize("args, env, devices", [
    (["--backend", "xla", "--strategy", "spmd"], {"CPU_NUM_DEVICES": "4"}, 4),  # one process, 4 XLA:CPU devices
    (["--backend", "cpu", "--num-processes", "2"], {}, 2),  # two gloo processes
])
def test_buckets_auto_plans_for_the_devices_the_run_will_have(args, env, devices, tiny_model, full_train, tmp_path):
    """`--buckets auto` plans the job before launch: with every device counted, 3,668 MRPC rows
    in global batches of 8 x devices take 115 steps an epoch on 4 devices, 230 on 2."""
    proc, m = run_cli([*args, "--model", tiny_model, "--max-steps", 1, *full_train], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("buckets auto:"))
    per_epoch = -(-3668 // (8 * devices))
    assert f"global batch {8 * devices} = 8 x {devices} device(s) x 1 accumulated" in plan, plan
    assert f"{per_epoch} steps per epoch, {3 * per_epoch} for 3 epochs" in plan, plan
    assert m["world_size"] == devices and m["buckets_auto"]["steps_per_epoch"] == per_epoch
    assert m["buckets"] == m["buckets_auto"]["buckets"]


@pytest.fixture(scope="module")
def full_train(tmp_path_factory):
    """MRPC's 3,668 training rows as an own CSV file, with 8 validation rows (a cheap evaluation)."""
    import csv

    from xla_train.tasks import BUNDLED_MRPC, read_glue_tsv

    folder = tmp_path_factory.mktemp("full")
    for name, source, n in (("train.csv", "train.tsv", None), ("dev.csv", "dev.tsv", 8)):
        rows = read_glue_tsv(BUNDLED_MRPC / source)
        with open(folder / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence1", "sentence2", "label"])
            writer.writerows(list(zip(rows["text1"], rows["text2"], rows["label"]))[:n])
    return ["--train-file", folder / "train.csv", "--validation-file", folder / "dev.csv"]


def test_a_pod_host_with_a_local_output_folder_stops(tmp_path):
    """Host 1 of a 2-host TPU slice, described the way torch_xla reads it without the metadata
    server (TPU_SKIP_MDS_QUERY, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES): a local --output-dir would
    hold host 0's checkpoints only, so the run stops before any work."""
    env = {"PJRT_DEVICE": "TPU", "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "h0,h1",
           "TPU_ACCELERATOR_TYPE": "v4-16"}
    proc, _ = run_cli(["--backend", "xla", "--output-dir", tmp_path / "run"], tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"xla-train: error: --output-dir {tmp_path / 'run'}: a run on 2 hosts needs a gs:// output, which every "
        "host reads alike (a local folder holds host 0's checkpoints only)")
    assert not (tmp_path / "run").exists()


def test_only_the_first_host_writes_the_run_record(tmp_path):
    from xla_train.io.storage import open_store
    from xla_train.options import TrainOptions
    from xla_train.run.folder import RECORD, RunFolder

    cfg = TrainOptions(output_dir=str(tmp_path / "run"))
    assert RunFolder(open_store(cfg.output_dir), cfg, writer=False).claim() is None
    assert not (tmp_path / "run").exists()
    run_id = RunFolder(open_store(cfg.output_dir), cfg).claim()
    assert json.loads((tmp_path / "run" / RECORD).read_text())["run_id"] == run_id


def test_a_slower_pod_host_accepts_the_record_host_0_just_wrote(tmp_path, monkeypatch):
    """Host 0 claims the folder first; host 1, reading it a moment later, takes the record of the
    same run (same config, not finished; or the run id the launcher gave every host) instead of
    refusing a folder that "already holds a run" (the others would wait in the TPU's start-up)."""
    from xla_train.io.storage import open_store
    from xla_train.options import TrainOptions
    from xla_train.run.folder import RUN_ID_VARIABLE, RunFolder

    cfg = TrainOptions(output_dir=str(tmp_path / "run"))
    monkeypatch.delenv(RUN_ID_VARIABLE, raising=False)
    run_id = RunFolder(open_store(cfg.output_dir), cfg).claim()  # host 0
    host1 = RunFolder(open_store(cfg.output_dir), cfg, writer=False)
    host1.check()
    assert host1.claim() == run_id
    other = TrainOptions(output_dir=str(tmp_path / "run"), seed=7)  # not this run: refused as before
    with pytest.raises(UserError, match="already holds a run"):
        RunFolder(open_store(cfg.output_dir), other, writer=False).check()
    with pytest.raises(UserError, match="already holds a run"):  # host 0 itself never takes it
        RunFolder(open_store(cfg.output_dir), cfg).check()

    # scripts/tpu_pod.py gives every host the same id: it decides, and a host that reads before
    # host 0 wrote the record has the id too (the main replica may live on any host)
    monkeypatch.setenv(RUN_ID_VARIABLE, "pod-run-1")
    fresh = TrainOptions(output_dir=str(tmp_path / "pod"))
    assert RunFolder(open_store(fresh.output_dir), fresh, writer=False).claim() == "pod-run-1"
    assert RunFolder(open_store(fresh.output_dir), fresh).claim() == "pod-run-1"
    RunFolder(open_store(fresh.output_dir), fresh, writer=False).check()
    monkeypatch.setenv(RUN_ID_VARIABLE, "another-run")
    with pytest.raises(UserError, match="already holds a run"):
        RunFolder(open_store(fresh.output_dir), fresh, writer=False).check()


def test_forked_replicas_get_the_job_without_pickling_it(tiny_model):
    """xmp.spawn pickles its function and arguments into every replica with torch's pickler
    (torch_xla/_internal/pjrt.py, run_multiprocess), which moves every tensor into shared memory.
    With fork, the job is handed to the replicas through a module-level reference instead: what
    gets pickled is a key, and the model's storage stays where it is."""
    import functools
    import io
    from multiprocessing.reduction import (
        ForkingPickler,  # with torch's reductions (torch.multiprocessing)
    )

    import torch.multiprocessing  # noqa: F401  registers them
    from transformers import AutoModelForSequenceClassification

    from xla_train.core.roles import Roles
    from xla_train.parallel import launchers

    def pickled(entry, args):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(functools.partial(entry, *args))
        return len(buf.getvalue())

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model)
    job = (object.__new__(Roles), len, (model,))
    size = pickled(*launchers.spawn_arguments(*job, start_method="fork"))
    launchers._HANDED_OFF.clear()
    assert size < 1000 and not any(p.is_shared() for p in model.parameters())
    pickled(*launchers.spawn_arguments(*job, start_method="spawn"))  # spawn cannot inherit: pickled
    assert all(p.is_shared() for p in model.parameters())


def _replica_part(part, folder):
    """What one replica does in test_one_failing_replica_ends_them_all."""
    import signal
    import time

    from xla_train.core.errors import UserError

    while len([n for n in os.listdir(folder) if n.startswith("pid-")]) < 2:  # both replicas are up
        time.sleep(0.05)
    if part == "stuck":  # stands for a replica waiting in a collective: a SIGTERM only asks it to stop
        while True:
            time.sleep(0.1)
    if part == "fails":
        raise UserError("cannot write the run's files to OUT: RuntimeError: connection reset by peer")
    if part == "bug":
        return 1 / 0
    os.kill(os.getpid(), signal.SIGKILL)  # "killed": the kernel's out-of-memory killer


def _pool_entry(index, parts):
    from xla_train.core.select import select_roles
    from xla_train.parallel import launchers

    launchers._run_replica(index, select_roles("cpu"), _replica_part, (parts[index], launchers.worker_folder()))


FAILING_POOL = """
import concurrent.futures, functools, json, multiprocessing, os, sys
import torch
sys.path.insert(0, {tests!r})
from test_distributed import _pool_entry
from xla_train.parallel import launchers
from xla_train.core.errors import UserError
from xla_train.core.signals import StopRequest
try:
    with StopRequest(), launchers.replica_failures():
        context = torch.multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=context) as pool:
            list(pool.map(functools.partial(_pool_entry, parts=("stuck", {part!r})), range(2)))
except UserError as e:
    print(json.dumps({{"line": str(e), "code": e.exit_code, "variable_left": launchers._CHANNEL in os.environ,
                      "children": len(multiprocessing.active_children())}}))
"""


def _what_the_pool_told(proc, waiting):
    """(the JSON a FAILING_POOL process prints, its stderr), once it has ended; its whole session
    is killed and the test fails if it still runs after 60 s."""
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{waiting} after 60 s")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out), err


@pytest.mark.parametrize("part, line, code", [
    ("fails", "cannot write the run's files to OUT: RuntimeError: connection reset by peer", 2),
    ("bug", "replica 1 failed: ZeroDivisionError: division by zero", 1),
    ("killed", "a replica process ended without a word", 1),
])
def test_one_failing_replica_ends_them_all(part, line, code):
    """Several XLA replicas cannot run here, so this drives the replicas' entry in the pool that
    xmp.spawn uses under PJRT (torch_xla/_internal/pjrt.py, run_multiprocess: a fork-context
    ProcessPoolExecutor, results collected in order with executor.map), inside the launcher's
    SIGTERM handler as the CLI runs it. Replica 0 never returns and ignores SIGTERM, as one
    waiting in a collective would; replica 1 fails. Without the entry's handling the launcher
    waits for ever (here: killed, with its process group, after 60 s)."""
    proc = subprocess.Popen([sys.executable, "-c", FAILING_POOL.format(tests=str(ROOT / "tests"), part=part)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    told, err = _what_the_pool_told(proc, "the launcher still waits for its replicas")
    assert told["line"].startswith(line) and told["code"] == code
    assert not told["variable_left"] and told["children"] == 0
    assert ("Traceback" in err and "ZeroDivisionError" in err) == (part == "bug")  # a bug keeps its traceback


def test_only_the_launchers_children_are_its_replicas():
    """A process that a replica starts inherits the launch's variable, but is no replica: it must
    neither register nor kill the replicas when it fails. Here a child of the launcher stands for a
    replica, and the child it starts for a process a replica starts."""
    from xla_train.parallel import launchers

    ask = "from xla_train.parallel import launchers; print(launchers.worker_folder())"
    replica = f"import subprocess, sys; {ask}; subprocess.run([sys.executable, '-c', {ask!r}])"
    with launchers.replica_failures():
        assert launchers.worker_folder() is None  # the launcher itself
        folder = os.environ[launchers._CHANNEL].partition(":")[2]
        proc = subprocess.run([sys.executable, "-c", replica], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == [folder, "None"], proc.stderr[-3000:]


def test_a_failure_in_any_process_reaches_every_one(tmp_path):
    """Engine.on_every: every process writes its part (under FSDPv2, a host's shards); the one that
    fails, here the second of two gloo workers and not the main one, tells every process its line
    (each process has a row of its own in the table they reduce, so no two messages mix). Seeded
    alike, the two workers draw different noise (Engine.seed: each replica its own stream, issue 61;
    tests/test_replica_seeds.py)."""
    from pathlib import Path

    from xla_train import Engine, notebook_launcher

    def fn(out):
        engine = Engine()
        engine.seed(42)
        torch.save(torch.rand(8), Path(out, f"noise-{engine.rank}.pt"))

        def write():
            if engine.rank == 1:
                raise OSError(28, "No space left on device")
            Path(out, "written").write_text("")

        try:
            engine.on_every(write, "cannot write the shards")
            outcome = "done"
        except UserError as e:
            outcome = f"{e.exit_code} {e}"
        Path(out, f"rank-{engine.rank}").write_text(outcome)

    notebook_launcher(fn, (str(tmp_path),), backend="cpu", num_processes=2)
    assert (tmp_path / "written").exists()
    told = [(tmp_path / f"rank-{r}").read_text() for r in (0, 1)]
    assert told == ["2 cannot write the shards: No space left on device"] * 2
    noise = [torch.load(tmp_path / f"noise-{r}.pt") for r in (0, 1)]
    torch.manual_seed(42)
    assert torch.equal(noise[0], torch.rand(8)) and not torch.equal(noise[0], noise[1])  # replica 0: as one process


FORK_OR_SPAWN = """
import json, os, sys, torch
from xla_train import launch

FORKED = []  # filled below, in the launching process: forked workers inherit it, spawned ones import this file afresh


def work(folder, launch_index):
    a = torch.randn(600, 600)
    (a @ a).sum() + torch.randn(2_000_000).exp().sum()  # OpenMP-parallel ops in the worker
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    with open(os.path.join(folder, f"{launch_index}-{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump({"forked": bool(FORKED), "threads": torch.get_num_threads(), "total": total.item()}, f)


if __name__ == "__main__":
    FORKED.append(True)
    a = torch.randn(2000, 2000)
    (a @ a).sum()  # the launcher's OpenMP pool has run with 2 threads
    torch.set_num_threads(1)
    launch(work, (sys.argv[1], 0), backend="cpu", num_processes=2)  # one thread now: forked
    torch.set_num_threads(2)
    (a @ a).sum()
    launch(work, (sys.argv[1], 1), backend="cpu", num_processes=2)  # 2 threads: forking would hang, spawned
"""


def test_gloo_workers_fork_unless_openmp_threads_would_hang_them(tmp_path):
    """Forked gloo workers skip importing everything again (gpu_fallback/launcher.py, fork_hazard).
    A child forked after torch's OpenMP pool ran with 2 threads hangs in its first parallel region
    (GNU libgomp keeps no threads across fork): such a launcher spawns its workers. With one thread
    no parallel region uses the pool, even one that ran before, and the workers are forked. Each
    worker runs parallel ops and a gloo reduction; a hang fails the test after 120 s."""
    script = tmp_path / "launch_twice.py"
    script.write_text(FORK_OR_SPAWN)
    proc = subprocess.Popen([sys.executable, script, tmp_path], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the gloo workers still run after 120 s: hung")
    assert proc.returncode == 0, err[-3000:]
    told = {(n, r): json.loads((tmp_path / f"{n}-{r}.json").read_text()) for n in (0, 1) for r in (0, 1)}
    assert all(t["total"] == 2 for t in told.values())
    assert [told[0, r]["forked"] for r in (0, 1)] == [True, True] and told[0, 0]["threads"] == 1
    assert [told[1, r]["forked"] for r in (0, 1)] == [False, False] and told[1, 0]["threads"] == 2


def test_spmd_processes_agree_through_a_reduction_over_every_device(tmp_path):
    """Under SPMD each host's process has its own signals, but world_size is 1. The stop flags
    become each process's rows of a tensor sharded over every device (torch_xla's `minibatch`:
    a process's data is its part), gathered whole onto every device inside the graph (so their
    copy to the host compiles no program of its own), and the largest is taken on the device.
    One process here (4 XLA:CPU devices): the result is its own flags, and the compiled graph
    gathers the rows across the devices with an all-gather, the collective that spans the
    hosts on a pod."""
    script = """
import torch, torch_xla
from xla_train.core.select import select_roles
roles = select_roles("xla", strategy="spmd")
roles.start()
rows = roles.strategy.gather_rows(torch.tensor([3, 0], dtype=torch.int32))
print(roles.strategy.peers, tuple(rows.shape), torch_xla._XLAC._get_xla_sharding_spec(rows))
print(rows.amax(0).cpu().tolist())
"""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_FLAGS": f"--xla_dump_to={tmp_path}"}
    proc = run_python(["-c", script], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["1 (4, 2) {replicated}", "[3, 0]"]
    compiled = [p.read_text() for p in tmp_path.glob("*cpu_after_optimizations.txt")]
    assert len(compiled) == 1 and "all-gather(" in compiled[0]


POD_HOST_1 = {"PJRT_DEVICE": "TPU", "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "h0,h1",
              "TPU_ACCELERATOR_TYPE": "v4-16"}


@pytest.mark.xla
def test_one_process_per_host_of_a_pod_is_refused(monkeypatch, capsys):
    """torch_xla's single-process path makes every host a world of one (TPU_PROCESS_BOUNDS=1,1,1):
    `--num-processes 1` on host 1 of 2 (described with torch_xla's variables) stops in one line;
    the refusal of other counts names TPU_PROCESS_BOUNDS, not TPU_VISIBLE_CHIPS."""
    from xla_train.commands.cli import main

    for name, value in POD_HOST_1.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--backend", "xla", "--num-processes", "1"]) == 2
    assert capsys.readouterr().err == ("xla-train: error: --num-processes 1 on a TPU slice of 2 hosts would train 2 "
                                       "separate models; leave it out (one replica per chip), or use --strategy spmd\n")
    assert main(["train", "--backend", "xla", "--num-processes", "3"]) == 2
    err = capsys.readouterr().err
    assert "set TPU_PROCESS_BOUNDS" in err and "TPU_VISIBLE_CHIPS" not in err


def test_a_vfio_device_alone_is_no_tpu(monkeypatch):
    """/dev/vfio/0 is on any host that passes a PCI device through; without a Google TPU PCI device
    (torch_xla's check) or /dev/accel0 the host has no TPU."""
    from xla_train.core import xla

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/vfio/0" or (p != "/dev/accel0" and real(p)))
    assert os.path.exists("/dev/vfio/0") and not xla.tpu_present()
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/accel0" or real(p))
    assert xla.tpu_present()


def test_a_failure_on_another_pod_host_ends_this_hosts_replicas(gcs_emulator, tmp_path):
    """Several hosts cannot run here. This host's two replicas are stuck (as in a collective
    whose peer on another host has failed); that host leaves its line in the job's gs:// output
    (`launchers.tell_pod`), and this host's watchdog reads it and ends the replicas with that line,
    instead of waiting for ever. The marker is per launch (`watch_pod`)."""
    import time

    from xla_train.parallel import launchers

    url = f"gs://xla-train-test/{tmp_path.name}"
    with launchers.watch_pod(launchers.pod_marker(url, "launch-1")):  # job.launch's, on every pod host
        env = {**os.environ, **gcs_emulator}
        assert launchers.pod_failure() is None
        proc = subprocess.Popen([sys.executable, "-c", FAILING_POOL.format(tests=str(ROOT / "tests"), part="stuck")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        time.sleep(3)
        launchers.tell_pod(UserError("replica 5 failed: RuntimeError: out of memory", 1))  # host 1's replica
        told, _ = _what_the_pool_told(proc, "this host's replicas still wait")
        assert told["line"] == "replica 5 failed: RuntimeError: out of memory" and told["code"] == 1
        assert told["children"] == 0
    assert launchers.POD_FAILURES not in os.environ  # as it was before the launch
    with launchers.watch_pod(launchers.pod_marker(url, "launch-2")):
        assert launchers.pod_failure() is None  # the next start of the same run does not see launch 1's failure


def test_spmd_hosts_tell_each_other_their_failures(gcs_emulator, tmp_path, monkeypatch):
    """Under SPMD each host runs one process and no launcher watches it: `pod_watch` tells the
    other hosts of its failure, and ends it (with their line) when another host failed."""
    from xla_train.parallel import launchers

    monkeypatch.setenv(launchers.POD_FAILURES, launchers.pod_marker(f"gs://xla-train-test/{tmp_path.name}", "l1"))
    with pytest.raises(UserError), launchers.pod_watch():
        raise UserError("cannot write checkpoint gs://b/run/checkpoints/step-00000004: full", 2)
    failed = launchers.pod_failure()
    assert (str(failed), failed.exit_code) == ("cannot write checkpoint gs://b/run/checkpoints/step-00000004: full", 2)
    waiting = ("import time\nfrom xla_train.parallel import launchers\n"
               "with launchers.pod_watch():\n    time.sleep(120)\n")
    proc = subprocess.run([sys.executable, "-c", waiting], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **gcs_emulator})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("xla-train: error: cannot write checkpoint "
                                                    "gs://b/run/checkpoints/step-00000004: full")
