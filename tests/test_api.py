"""The bring-your-own-loop API: prepare, backward, optimizer_step, gather_for_metrics."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from xla_train import Engine


def test_prepare_repoints_the_optimizer_and_gather_drops_filler():
    engine = Engine(backend="cpu")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    loss = model(torch.ones(4, 3)).sum()
    engine.backward(loss)
    before = model.weight.detach().clone()
    assert engine.optimizer_step(optimizer) is True
    assert not torch.equal(before, model.weight)
    preds, refs = engine.gather_for_metrics((torch.tensor([1, 0, 1]), torch.tensor([1, 1, 0])),
                                            valid=torch.tensor([1, 1, 0]))
    assert preds.tolist() == [1, 0] and refs.tolist() == [1, 1]


def test_gradient_accumulation_steps_every_n_micro_batches():
    engine = Engine(backend="cpu", grad_accum=3)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    stepped = []
    for _ in range(6):
        engine.backward(model(torch.ones(1, 2)).sum())
        stepped.append(engine.optimizer_step(optimizer))
    assert stepped == [False, False, True, False, False, True]


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_course_loop_ported_to_the_engine(backend, mrpc_slice, tiny_model, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "scripts/custom_loop_mrpc.py", "--backend", backend, "--model",
                           str(tiny_model), "--data-dir", str(mrpc_slice), "--max-steps", "12",
                           "--metrics-out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PJRT_DEVICE": "CPU"}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["n"] == 48 and result["steps"] == 12
    assert 0 <= result["accuracy"] <= 1


def test_tpu_pod_dry_run_prints_the_gcloud_commands():
    """With a PyPI name; tests/test_install.py covers a local wheel (scp first) and git+URL."""
    proc = subprocess.run([sys.executable, "scripts/tpu_pod.py", "--tpu", "pod-1", "--zone", "us-central2-b",
                           "--package", "xla-train", "--dry-run", "--run-id", "r1", "--launch-id", "l1", "--",
                           "--model", "bert-base-uncased", "--data-dir", "hub"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    install, train = proc.stdout.strip().splitlines()
    prefix = "gcloud compute tpus tpu-vm ssh pod-1 --zone=us-central2-b --worker=all --command "
    assert install == prefix + "'python3 -m pip install --upgrade '\"'\"'xla-train[tpu]'\"'\"''"
    assert train == prefix + ("'PJRT_DEVICE=TPU XLA_TRAIN_RUN_ID=r1 XLA_TRAIN_LAUNCH_ID=l1 python3 -m xla_train "
                              "train --model bert-base-uncased --data-dir hub'")


def test_tpu_pod_detach_keeps_the_job_alive_after_ssh(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/tpu_pod.py", "--tpu", "pod-1", "--zone", "us-central2-b",
                           "--package", "xla-train", "--dry-run", "--detach", "--", "--data-dir", "hub"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    command = shlex.split(proc.stdout.strip().splitlines()[-1])[-1]
    # every host gets the one run id made here (the replica that writes checkpoints may be on any host)
    run_id = command.split("XLA_TRAIN_RUN_ID=")[1].split()[0]
    launch_id = command.split("XLA_TRAIN_LAUNCH_ID=")[1].split()[0]
    assert len(run_id) == 12 and int(run_id, 16) >= 0 and len(launch_id) == 8
    assert command == (f"nohup sh -c 'PJRT_DEVICE=TPU XLA_TRAIN_RUN_ID={run_id} XLA_TRAIN_LAUNCH_ID={launch_id} "
                       "python3 -m xla_train train --data-dir hub' > xla_train.log 2>&1 < /dev/null & echo started: "
                       "~/xla_train.log")
    # what the host's shell runs, with `python3 -m xla_train` standing for itself: detached, output in the log
    fake = command.replace("python3 -m xla_train train", "echo trained")
    run = subprocess.run(["sh", "-c", fake + "; wait"], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "HOME": str(tmp_path)})  # ssh starts in the home folder
    assert run.stdout.strip() == f"started: {tmp_path}/xla_train.log"
    assert (tmp_path / "xla_train.log").read_text().strip() == "trained --data-dir hub"
