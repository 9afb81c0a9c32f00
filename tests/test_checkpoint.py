"""Checkpoints survive preemption: SIGTERM then --resume equals the uninterrupted run, a process
killed while saving leaves the previous checkpoint whole, and a diverging loss keeps the last
good one. Runs are real CLI processes on the CPU backend (deterministic; dropout on)."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_same_weights,
    run_cli,
    start_cli,
    stop_and_resume,
    wait_for,
)

COMMON = ["--backend", "cpu", "--epochs", "10", "--log-every", "3"]


def test_sigterm_then_resume_equals_the_uninterrupted_run(mrpc_slice, tiny_dropout_model, tmp_path):
    """Gradient accumulation over 3 micro-batches: 20 batches make 6 steps an epoch, 2 left over.
    With LoRA adapters (dropout in the model and the adapters): the checkpoints hold the trained
    tensors only, the frozen base comes from the model's files again. (Whole models resume exactly
    in the FSDP tests: test_fsdp.py, and the Ctrl-C test below.)"""
    args = [*COMMON, "--model", tiny_dropout_model, "--data-dir", mrpc_slice, "--max-steps", 45, "--save-every", 4,
            "--grad-accum", 3, "--batch-size", 8, "--lora", "--lr", 1e-3]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    out = tmp_path / "stopped"

    def stopped(last, stopped_at):
        assert last.startswith("xla-train: stopped by SIGTERM after step ") and "continue with --resume" in last
        assert 4 <= stopped_at < 45 and stopped_at % 6 != 0  # mid-epoch
        assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "COMPLETE").exists()
        saved = out / "checkpoints" / f"step-{stopped_at:08d}" / "model.safetensors"
        assert saved.stat().st_size < 100_000  # adapters and head: 4 MB with the frozen base

    _, stopped_at, resumed = stop_and_resume(args, out, tmp_path, stopped=stopped)
    assert resumed["first_step"] == stopped_at and resumed["steps"] == whole["steps"] == 45
    assert_same_weights(out, tmp_path / "whole", file="adapter_model.safetensors")
    assert [s for s, _, _ in resumed["train_loss"]] == [s for s, _, _ in whole["train_loss"]]
    for (_, a, lr_a), (_, b, lr_b) in zip(resumed["train_loss"], whole["train_loss"]):
        assert abs(a - b) < 1e-6 and lr_a == lr_b
    assert resumed["eval"] == whole["eval"]


@pytest.mark.parametrize("lora", [True], ids=["lora"])
def test_ctrl_c_stops_two_gloo_fsdp_workers_at_one_step_and_resumes_exactly(lora, mrpc_slice, tiny_dropout_model,
                                                                           tmp_path):
    """SIGINT to the launcher only: it passes the stop on, the workers agree on the step at a log
    point, save one checkpoint together and exit 130; --resume finishes the run as if it had not
    stopped. The workers shard the model with FSDP2 (--strategy fsdp): the checkpoint holds each
    worker's own shards (shards/host-<rank>/, no whole tensor), and each takes its shards back,
    AdamW's moments too. With --lora:
    the frozen base sharded too, the adapters and the head trained, saved and resumed. (The whole
    model under FSDP2, stopped and resumed across two workers: tests/test_dpo.py's
    test_two_gloo_fsdp_processes_stopped_and_resumed_train_as_one.)"""
    out = tmp_path / "run"
    args = [*COMMON, "--num-processes", 2, "--strategy", "fsdp", "--model", tiny_dropout_model,
            "--data-dir", mrpc_slice, "--max-steps", 15, "--save-every", 4, *(["--lora", "--lr", 1e-3] if lora else [])]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    def stopped(last, stopped_at):
        assert last.startswith("xla-train: stopped by SIGINT after step ")
        assert stopped_at % 3 == 0 and stopped_at < 15  # a log point (--log-every 3)
        folder = out / "checkpoints" / f"step-{stopped_at:08d}"
        rng = torch.load(folder / "rng.pt", weights_only=True)["rng"]
        assert rng.shape[0] == 2  # both workers' random states
        assert not (folder / "model.safetensors").exists()
        assert all((folder / "shards" / f"host-{rank}" / ".metadata").is_file() for rank in (0, 1))

    _, stopped_at, m = stop_and_resume(args, out, tmp_path, sig=signal.SIGINT, stopped=stopped)  # exit 130
    assert m["first_step"] == stopped_at and m["steps"] == 15 and m["replicas_identical"]
    assert [s for s, _, _ in whole["train_loss"]] == [3, 6, 9, 12, 15]  # across the end of epoch 1 (10 steps)
    assert m["memory"]["param_bytes_per_device"] == -(-m["memory"]["param_bytes_total"] // 2)
    torch.testing.assert_close(m["train_loss"], whole["train_loss"], atol=1e-6, rtol=0)
    saved = "adapter_model.safetensors" if lora else "model.safetensors"
    assert_same_weights(out, tmp_path / "whole", atol=1e-6, file=saved)
    assert m["eval"] == whole["eval"]
    assert (m["trainable_params"] < 0.05 * m["total_params"]) == lora


def test_sighup_saves_a_checkpoint_and_exits_129(mrpc_slice, tiny_model, tmp_path):
    """A dropped ssh session (SIGHUP) is a stop like SIGTERM: the step ends, a checkpoint is saved,
    one line, exit 129; without the handler SIGHUP would end the process with nothing saved."""
    out = tmp_path / "run"
    run = start_cli([*COMMON, "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 200,
                     "--save-every", 2, "--output-dir", out])
    wait_for(lambda: (out / "checkpoints" / "step-00000002" / "COMPLETE").exists(), run)
    run.send_signal(signal.SIGHUP)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 128 + signal.SIGHUP == 129, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("xla-train: stopped by SIGHUP after step ") and "continue with --resume" in last
    stopped_at = int(last.split("after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "COMPLETE").exists()


def listing(url):
    """{step: file names} of the checkpoint folders under `url`, read from the disk or the bucket."""
    found = {}
    if url.startswith("gs://"):
        from google.cloud import storage

        bucket, _, prefix = url[5:].partition("/")
        for blob in storage.Client().bucket(bucket).list_blobs(prefix=f"{prefix}/checkpoints/"):
            folder, name = blob.name.split("/")[-2:]
            found.setdefault(int(folder[5:]), set()).add(name)
    else:
        for d in Path(url, "checkpoints").glob("step-*"):
            found[int(d.name[5:])] = {f.name for f in d.iterdir()}
    return found


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_killed_during_a_save_keeps_the_previous_checkpoint(where, mrpc_slice, gcs_emulator, tmp_path):
    """The bundled MiniLM (a 270 MB checkpoint) is killed (SIGKILL) while a checkpoint is written:
    locally into a hidden folder, on Cloud Storage object by object (an interrupted upload)."""
    out = str(tmp_path / "run") if where == "local" else f"gs://xla-train-test/{tmp_path.name}"
    args = ["--backend", "cpu", "--data-dir", mrpc_slice, "--keep-last", 5, "--output-dir", out]
    run = start_cli([*args, "--max-steps", 40, "--save-every", 2])
    wait_for(lambda: "COMPLETE" in listing(out).get(2, ()), run)
    if where == "local":
        partial = wait_for(lambda: next(Path(out, "checkpoints").glob(".partial-*"), None), run)
    else:
        partial = wait_for(lambda: next((s for s, f in listing(out).items() if "COMPLETE" not in f), None), run)
    run.kill()
    run.wait()
    found = listing(out)
    complete = sorted(s for s, files in found.items() if "COMPLETE" in files)
    assert complete and all(found[s] >= {"model.safetensors", "optimizer.pt", "state.json"} for s in complete)
    latest = complete[-1]
    if where == "local":
        assert partial.exists() and partial.name == f".partial-step-{latest + 2:08d}", "killed inside a save"
    else:
        assert partial == latest + 2 and found[partial] and "COMPLETE" not in found[partial]

    proc, m = run_cli([*args, "--max-steps", latest + 1, "--resume"], tmp_path, env=gcs_emulator)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["first_step"] == latest and m["steps"] == latest + 1
    assert m["checkpoint"] == f"{out}/checkpoints/step-{latest + 1:08d}"
    if where == "local":
        assert not list(Path(out, "checkpoints").glob(".partial-*"))  # cleaned up by the next save


def test_cloud_storage_save_list_resume(mrpc_slice, tiny_dropout_model, gcs_emulator, tmp_path):
    out = f"gs://xla-train-test/{tmp_path.name}"
    args = ["--backend", "cpu", "--model", tiny_dropout_model, "--data-dir", mrpc_slice, "--save-every", 3,
            "--output-dir", out]
    proc, first = run_cli([*args, "--max-steps", 7], tmp_path, env=gcs_emulator)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(listing(out)) == [6, 7]  # --keep-last 2; the end of the run is saved too
    assert all(files == {"COMPLETE", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json"}
               for files in listing(out).values())
    proc, resumed = run_cli([*args, "--max-steps", 9, "--resume"], tmp_path, env=gcs_emulator)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["first_step"] == 7 and resumed["steps"] == 9 and sorted(listing(out)) == [7, 9]
    # the final model, loadable by plain transformers after a download
    from google.cloud import storage
    from transformers import AutoModelForSequenceClassification

    local = tmp_path / "download"
    local.mkdir()
    for blob in storage.Client().bucket("xla-train-test").list_blobs(prefix=f"{tmp_path.name}/"):
        if "/checkpoints/" not in blob.name:
            blob.download_to_filename(local / blob.name.rsplit("/", 1)[1])
    model = AutoModelForSequenceClassification.from_pretrained(local)
    assert model.num_labels == 2


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(mrpc_slice, tiny_model, tmp_path):
    out = tmp_path / "run"
    proc, _ = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--lr", "1e30",
                       "--max-steps", 10, "--save-every", 1, "--log-every", 1, "--output-dir", out], tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "xla-train: the training loss was not finite at step " in last
    bad = int(last.split("at step ")[1].split(";")[0])
    assert bad >= 2
    good = out / "checkpoints" / f"step-{bad - 1:08d}"
    assert f"last good checkpoint: {good}" in last
    assert (good / "COMPLETE").exists() and not (out / "checkpoints" / f"step-{bad:08d}").exists()


def test_main_worker_failing_to_publish_stops_both_gloo_workers(mrpc_slice, tiny_model, tmp_path):
    """The main worker's final write raises an error that is not an OSError (as a Cloud Storage
    transport error or a SafetensorError would): both workers learn it through the shared flag and
    stop, the error is shown in one line, and the run exits non-zero instead of hanging."""
    inject = tmp_path / "inject"
    inject.mkdir()
    # sitecustomize runs at the start of every Python process: the launcher's (its forked workers
    # inherit the patch) and spawned workers' alike
    (inject / "sitecustomize.py").write_text(
        "from xla_train.io import storage\n"
        "def publish(self):\n"
        "    raise RuntimeError('connection reset by peer')\n"
        "storage.LocalStore.publish = publish\n")
    out = tmp_path / "run"
    start = time.monotonic()
    proc, _ = run_cli([*COMMON, "--num-processes", 2, "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 4,
                       "--output-dir", out], tmp_path,
                      env={"PYTHONPATH": os.pathsep.join([str(inject), str(ROOT), os.environ.get("PYTHONPATH", "")])},
                      timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = f"xla-train: error: cannot write the run's files to {out}: RuntimeError: connection reset by peer"
    assert proc.stderr.splitlines().count(line) == 1  # told once, by the launcher
    assert time.monotonic() - start < 240
    assert (out / "checkpoints" / "step-00000004" / "COMPLETE").exists()  # the last checkpoint stays


def test_a_checkpoint_that_cannot_be_written_says_what_was_kept(mrpc_slice, tiny_model, tmp_path):
    """The disk fills while checkpoint 4 is written: one line, which names the complete
    checkpoint left in place (step 2) for --resume; nothing of step 4 appears."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import safetensors.torch\n"
        "calls, save_file = [], safetensors.torch.save_file\n"
        "def failing(*args, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        raise OSError(28, 'No space left on device')\n"
        "    return save_file(*args, **kwargs)\n"
        "safetensors.torch.save_file = failing\n")
    out = tmp_path / "run"
    proc, _ = run_cli(["--backend", "cpu", "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 6,
                       "--save-every", 2, "--output-dir", out], tmp_path,
                      env={"PYTHONPATH": os.pathsep.join([str(inject), str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"xla-train: error: cannot write checkpoint {out}/checkpoints/step-00000004: No space left on device; the "
        f"latest complete checkpoint, {out}/checkpoints/step-00000002, is kept: continue from it with --resume")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").exists()


def test_pod_hosts_upload_their_shards_and_the_marker_comes_last(gcs_emulator, tmp_path):
    """A sharded checkpoint on Cloud Storage as two hosts write it (two stores, each with a local
    folder of its own, as each host's process has): what an interrupted save of the step left is
    cleared first, host 1 uploads its shards, host 0 the rest and the marker last; a host fetches
    the common files and, on its own, its shards only."""
    from xla_train.io.storage import open_store

    url, name = f"gs://xla-train-test/{tmp_path.name}", "step-00000004"
    main, other = open_store(url), open_store(url)
    assert main.local_folder() != other.local_folder()
    interrupted = main.staging(name)
    (interrupted / "stale.bin").write_bytes(b"x")
    main.upload(interrupted, name)
    main.clear(name)
    assert main.checkpoints() == {}

    def stage(store, host):
        folder = store.staging(name)
        (folder / "shards" / f"host-{host}").mkdir(parents=True)
        for f in (".metadata", "__0_0.distcp"):
            (folder / "shards" / f"host-{host}" / f).write_bytes(f"{host}{f}".encode())
        return folder

    other.upload(stage(other, 1), name)
    assert main.checkpoints() == {4: False}  # not complete before the main host's marker
    folder = stage(main, 0)
    (folder / "state.json").write_text("{}")
    (folder / "COMPLETE").write_text("")
    main.commit(folder, name)
    assert main.checkpoints() == {4: True}

    reader = open_store(url)
    common = reader.fetch(name)
    assert sorted(p.name for p in common.iterdir()) == ["COMPLETE", "state.json"]
    shards = reader.fetch(name, "shards/host-1")
    files = sorted(str(p.relative_to(shards)) for p in shards.rglob("*") if p.is_file())
    assert files == ["COMPLETE", "shards/host-1/.metadata", "shards/host-1/__0_0.distcp", "state.json"]
    assert (shards / "shards" / "host-1" / ".metadata").read_bytes() == b"1.metadata"


def test_every_spmd_host_resumes_from_the_one_saved_random_state():
    """Under SPMD a checkpoint holds one random-state row (world size 1), while each host's process
    has its process index as rank: host 1 of 2 must read row 0, not fail on row 1. Data-parallel
    replicas read their own row. (Several hosts cannot run here: the engine is described.)"""
    from types import SimpleNamespace

    from xla_train.run.checkpoint import replica_row

    one = torch.arange(5)[None]
    assert replica_row(one, SimpleNamespace(rank=1, world_size=1)).tolist() == [0, 1, 2, 3, 4]
    rows = torch.arange(10).view(2, 5)
    assert replica_row(rows, SimpleNamespace(rank=1, world_size=2)).tolist() == [5, 6, 7, 8, 9]
