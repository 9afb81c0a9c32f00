"""An output folder holds one run, locally and on Cloud Storage (the emulator): a new run into a
used folder stops unless --overwrite, which removes the old run first; --resume of a finished run
changes nothing. And the console: a fresh run prints what matters and no library noise; Ctrl-C at
any moment ends with one line and exit code 130."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, write_slice

from xla_train.commands.cli import main


def put(where, previous_run, tmp_path):
    """A copy of the finished run: a local folder, or objects under a fresh prefix in the bucket."""
    if where == "local":
        shutil.copytree(previous_run, tmp_path / "run")
        return str(tmp_path / "run")
    from google.cloud import storage

    bucket = storage.Client().bucket("xla-train-test")
    for f in previous_run.rglob("*"):
        if f.is_file():
            bucket.blob(f"{tmp_path.name}/{f.relative_to(previous_run)}").upload_from_filename(str(f))
    return f"gs://xla-train-test/{tmp_path.name}"


def snapshot(url):
    """{relative name: content hash} of everything under `url`."""
    if url.startswith("gs://"):
        from google.cloud import storage

        prefix = url.split("/", 3)[3] + "/"
        return {b.name[len(prefix):]: b.md5_hash
                for b in storage.Client().bucket("xla-train-test").list_blobs(prefix=prefix)}
    root = os.path.abspath(url)
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


def record(url):
    from xla_train.io.storage import open_store

    return json.loads(open_store(url).read_text("xla_train_run.json"))


@pytest.fixture(params=["local", "gcs"])
def used_folder(request, previous_run, gcs_emulator, tmp_path):
    return put(request.param, previous_run, tmp_path)


def train(tiny_model, mrpc_slice, out, *extra):
    return main(["train", "--backend", "cpu", "--model", str(tiny_model), "--data-dir", str(mrpc_slice),
                 "--max-steps", "4", "--save-every", "2", "--output-dir", out, *map(str, extra)])


def test_a_new_run_into_a_used_folder_stops(used_folder, tiny_model, mrpc_slice, capsys):
    before = snapshot(used_folder)
    assert train(tiny_model, mrpc_slice, used_folder) == 2
    err = capsys.readouterr().err
    assert err == (f"xla-train: error: {used_folder} already holds a run (checkpoints at steps 2, 4, a fine-tuned "
                   "model, finished at step 4): continue it with --resume, or replace it with --overwrite\n")
    assert snapshot(used_folder) == before


def test_resuming_a_finished_run_changes_nothing(used_folder, tiny_model, mrpc_slice, tmp_path, capsys):
    before = snapshot(used_folder)
    assert train(tiny_model, mrpc_slice, used_folder, "--resume", "--metrics-out", tmp_path / "m.json") == 0
    out = capsys.readouterr().out
    finished = record(used_folder)["finished"]
    assert out == (f"{used_folder} holds a finished run ({record(used_folder)['run_id']}): step 4, dev accuracy "
                   f"{finished['eval']['accuracy']:.4f}  f1 {finished['eval']['f1']:.4f}  (n=48); nothing to do "
                   "(a larger --max-steps or --epochs trains on, --overwrite starts over)\n")
    assert snapshot(used_folder) == before and not (tmp_path / "m.json").exists()


def test_overwrite_replaces_the_run(used_folder, tiny_model, mrpc_slice, tmp_path, capsys):
    old = record(used_folder)
    assert train(tiny_model, mrpc_slice, used_folder, "--overwrite", "--max-steps", 3, "--save-every", 3,
                 "--metrics-out", tmp_path / "m.json") == 0
    assert f"--overwrite: removed the run in {used_folder}" in capsys.readouterr().out
    new = record(used_folder)
    m = json.loads((tmp_path / "m.json").read_text())
    assert new["run_id"] != old["run_id"] and new["run_id"] == m["run_id"]
    assert new["finished"]["step"] == m["steps"] == 3 and m["first_step"] == 0
    checkpoints = {name.split("/")[1] for name in snapshot(used_folder) if name.startswith("checkpoints/")}
    assert checkpoints == {"step-00000003"}  # the old run's steps 2 and 4 are gone


def test_the_record_is_written_before_the_first_checkpoint(previous_run):
    """Checkpoints carry the run's id; the folder's record names the same run."""
    state = json.loads((previous_run / "checkpoints" / "step-00000002" / "state.json").read_text())
    assert state["run_id"] == record(str(previous_run))["run_id"]


def test_a_finished_run_leaves_its_small_files_whole(previous_run):
    """The run record, metrics.json and the task file are written whole (temporary file, then a
    rename): each parses, and no temporary file is left behind."""
    names = [p.relative_to(previous_run).as_posix() for p in previous_run.rglob("*") if p.is_file()]
    assert not [n for n in names if n.endswith((".tmp", ".partial"))], names
    assert record(str(previous_run))["finished"]["step"] == 4
    for name in ("metrics.json", "compilations.json", "xla_train_task.json"):
        assert json.loads((previous_run / name).read_text(encoding="utf-8"))


def test_atomic_write_is_whole_or_nothing(tmp_path):
    from xla_train.io.files import atomic_write

    path = tmp_path / "made" / "on the way" / "metrics.json"
    assert atomic_write(path, "first\n") == path  # its missing folders are made
    assert path.read_text(encoding="utf-8") == "first\n"

    def killed(f):
        f.write("half of the new file")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, killed)
    assert path.read_text(encoding="utf-8") == "first\n"  # the old file, whole
    atomic_write(path, lambda f: f.write("é\r\n"), fsync=False)
    assert path.read_bytes() == "é\r\n".encode()  # UTF-8, newlines as given
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temporary file left


def test_a_fresh_run_prints_what_matters(tmp_path):
    """The bundled MiniLM (a new classifier head) on the CPU with PJRT_DEVICE unset: our lines,
    the progress bar, no load report, no XLA warning, no shard-writing bar."""
    data = write_slice(tmp_path / "data", 16, 16)
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")  # a fresh user's: no entry of the data cache
    proc = subprocess.run([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--data-dir", str(data),
                           "--max-steps", "2", "--output-dir", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert [ln.split(":")[0].split(" ")[0] for ln in lines] == ["task", "buckets", "model", "memory", "epoch", "dev",
                                                                 "report", "goodput"]
    assert lines[-1].startswith("goodput 0.") and "training steps " in lines[-1] and "startup " in lines[-1]
    assert re.search(r"startup [\d.]+ = imports [\d.]+ \+ data [\d.]+ \+ model [\d.]+ \+ device [\d.]+,", lines[-1])
    assert "| model | the bundled MiniLM-L6-H384 |" in (tmp_path / "out" / "report" / "report.md").read_text()
    assert "new classification head for 2 output(s) (classifier.bias, classifier.weight)" in lines[2]
    assert lines[3].startswith("memory plan per device: parameters 86.") and "device unknown" in lines[3]
    assert lines[5].startswith("dev accuracy ") and "(training " in lines[5]
    for noise in ("LOAD REPORT", "Defaulting to PJRT_DEVICE", "Writing model shards", "Loading weights", "WARNING"):
        assert noise not in proc.stdout + proc.stderr
    assert {ln.split(":")[0] for ln in proc.stderr.replace("\r", "\n").splitlines() if ln.strip()} == {"Training"}


def test_env_says_when_pjrt_device_is_unset():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    proc = subprocess.run([sys.executable, "-m", "xla_train", "env"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0
    assert "PJRT_DEVICE   (unset: torch_xla picks TPU if present, else CPU)" in proc.stdout


@pytest.mark.parametrize("when", ["importing", "reading data", "training"])
def test_ctrl_c_at_any_moment_is_one_line_and_130(when, mrpc_slice, tiny_model):
    """SIGINT while the libraries import (0.3 s in), while the data is read (the task's line is
    out), or in the training loop (the progress bar has started)."""
    proc = subprocess.Popen([sys.executable, "-m", "xla_train", "train", "--backend", "cpu", "--model", str(tiny_model),
                             "--data-dir", str(mrpc_slice), "--max-steps", "500"], cwd=ROOT,
                            env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    if when == "importing":
        time.sleep(0.3)
    else:
        stream = proc.stdout if when == "reading data" else proc.stderr
        wanted = "task mrpc" if when == "reading data" else "Training:"
        seen = ""
        while wanted not in seen:
            chunk = stream.read(1)
            assert chunk, f"the run ended before {wanted!r}"
            seen += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last == "xla-train: interrupted" or last.startswith("xla-train: stopped by SIGINT after step ")


def test_pod_hosts_probing_one_prefix_at_once(gcs_emulator, tmp_path):
    """Every host's parent checks that the gs:// output is writable at the same moment: each
    probe has its own name, so no host deletes another's (or fails on a probe already gone)."""
    url = f"gs://xla-train-test/{tmp_path.name}"
    code = f"from xla_train.io.storage import open_store; open_store({url!r}).check_writable()"
    env = {**os.environ, **gcs_emulator, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    assert snapshot(url) == {}  # every probe removed
