"""`--strategy fsdp` on XLA: FSDPv2 on 4 XLA:CPU devices trains the same model as one device on the
same global batch, saves it whole (plain transformers loads it), checkpoints the host's shards and
resumes from them exactly after a stop;
with --lora too. The XLA run is shared by the tests of this module. FSDP2 over two gloo processes is tested in
test_distributed.py (equal to one process) and test_checkpoint.py (Ctrl-C and an exact resume)."""

import json
import os

import pytest
import torch
from conftest import EVALUATION_SETUP, TINY, assert_same_weights, resume_midway, run_cli, run_python, stop_and_resume
from test_lora import _dev_accuracy

FSDP = ["--backend", "xla", "--strategy", "fsdp", "--gradient-checkpointing", "--batch-size", 2, *TINY,
        "--save-every", 4]
FOUR = {"CPU_NUM_DEVICES": "4"}


@pytest.fixture(scope="session")
def xla_fsdp_run(mrpc_slice, tiny_model, tmp_path_factory):
    """16 steps of the tiny BERT sharded over 4 XLA:CPU devices, 2 rows each: conftest's one-device
    run's global batch of 8. With --gradient-checkpointing, as a model bigger than a chip would be
    trained (in fp32 recomputation changes no number)."""
    out = tmp_path_factory.mktemp("fsdp")
    proc, m = run_cli([*FSDP, "--model", tiny_model, "--data-dir", mrpc_slice, "--output-dir", out / "run"], out,
                      env=FOUR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, m, out / "run"


def test_fsdp_over_four_devices_matches_one_device(xla_fsdp_run, tiny_bucketed_run, tiny_model):
    proc, fsdp, out = xla_fsdp_run
    single, single_dir = tiny_bucketed_run
    assert fsdp["world_size"] == 4 and fsdp["train_samples"] == single["train_samples"] == 16 * 8
    torch.testing.assert_close([loss for _, loss, _ in fsdp["train_loss"]],
                               [loss for _, loss, _ in single["train_loss"]], atol=1e-5, rtol=0)
    assert_same_weights(out, single_dir, atol=1e-6)
    assert fsdp["eval"] == single["eval"]
    # each device holds a quarter of the weights, gradients and AdamW moments
    memory = fsdp["memory"]
    assert memory["param_bytes_per_device"] == -(-memory["param_bytes_total"] // 4)
    assert memory["optimizer_bytes_per_device"] == -(-2 * memory["param_bytes_total"] // 4)
    assert "memory plan per device: parameters 1.0 MiB (of 3.9 MiB)" in proc.stdout
    # clean graphs: shards come to the host without a graph of their own (a `.cpu()` of each split
    # tensor compiles one: 380 in this run with every checkpoint's tensors, then one per evaluation
    # batch); the one graph more than one device's: the second step, whose AdamW state is sharded
    xla = fsdp["xla"]
    assert xla["aten_fallbacks"] == 0 and xla["compiles_after_first_epoch"] == 0
    assert xla["compiles"] <= single["xla"]["compiles"] + 1, (xla, single["xla"])
    assert xla["host_syncs_per_step"] == single["xla"]["host_syncs_per_step"]
    assert "For backward hooks" not in proc.stderr


def test_the_fsdp_model_is_saved_whole_and_trained_and_checkpoints_hold_shards(xla_fsdp_run, tiny_model):
    """The final folder holds the model's own keys (no `_orig_module.`), whole tensors, and the
    trained weights, not the starting ones (transformers #36004); a checkpoint holds the host's
    shards of the same weights and of AdamW's moments, under the same keys."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    _, _, out = xla_fsdp_run
    start = AutoModelForSequenceClassification.from_pretrained(tiny_model).state_dict()
    final = load_file(str(out / "model.safetensors"))
    assert final.keys() == {k for k in start if k in final} and len(final) >= len(start) - 1
    assert all(final[k].shape == start[k].shape for k in final)
    assert not torch.equal(final["classifier.weight"], start["classifier.weight"])
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 2
    # the checkpoint holds the host's shards, not whole copies, in torch.distributed.checkpoint's
    # format: torch's own converter puts them together
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = out / "checkpoints" / "step-00000016"
    assert not (folder / "model.safetensors").exists()
    assert sorted(p.name for p in (folder / "shards").iterdir()) == ["host-0"]
    dcp_to_torch_save(folder / "shards" / "host-0", out.parent / "consolidated.pt")
    saved = torch.load(out.parent / "consolidated.pt", weights_only=True)
    assert saved["model"].keys() == final.keys()
    for k in final:
        torch.testing.assert_close(saved["model"][k], final[k], atol=0, rtol=0)
    assert len(saved["optimizer"]) == 2 * len(final)  # AdamW's two moments of every parameter
    assert torch.load(folder / "optimizer.pt", weights_only=True)["sharded_moments"] == sorted(saved["optimizer"])


def test_xla_fsdp_resumes_exactly_after_sigterm(xla_fsdp_run, mrpc_slice, tiny_model, tmp_path):
    _, whole, whole_dir = xla_fsdp_run
    _, stopped_at, resumed = stop_and_resume([*FSDP, "--model", tiny_model, "--data-dir", mrpc_slice],
                                           tmp_path / "run", tmp_path, env=FOUR)
    assert 4 <= stopped_at < 16 and resumed["first_step"] == stopped_at
    assert [h[0] for h in resumed["train_loss"]] == [h[0] for h in whole["train_loss"]]
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=1e-6, rtol=0)
    assert_same_weights(tmp_path / "run", whole_dir, atol=1e-6)
    assert resumed["eval"] == whole["eval"]
    # the loaded AdamW moments are sharded like their parameters: no graph more than the whole run's
    assert resumed["xla"]["compiles"] <= whole["xla"]["compiles"]


COVERAGE = """
import sys
import numpy as np
import torch
import torch_xla.runtime as xr

xr.use_spmd()
import torch_xla.distributed.spmd as xs
from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards

from xla_train.core.select import select_roles
from xla_train.core.errors import UserError

backend = select_roles("xla", strategy="fsdp").strategy
part = xs.XLAShard(torch.ones(2, 4), [slice(0, 2), slice(0, 4)], "CPU:0", 0)
backend.save_shards({"w": _CpuShards([part], torch.Size([8, 4]))}, sys.argv[1])
w = torch.zeros(8, 4).to(backend.accelerator.device)
xs.mark_sharding(w, xs.Mesh(np.arange(4), (4,), ("fsdp",)), ("fsdp", None))
try:
    backend.load_shards({"w": w}, sys.argv[1])
except UserError as e:
    print(e)
"""


def test_shards_that_miss_part_of_a_hosts_tensor_are_refused(tmp_path):
    """Shards written by other hosts or devices may not cover what this host holds: a local shard
    that no saved chunk overlaps gets no read from torch.distributed.checkpoint, silently. Here the
    saved shards hold rows 0-1 of an 8-row tensor split over 4 devices: the load stops."""


    proc = run_python(["-c", COVERAGE, tmp_path / "shards"],
                      {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (f"{tmp_path / 'shards'} does not hold all of this host's shards (w, 1 tensor(s) "
                                   "in all): resume on the hosts and devices that wrote it")


POD_HOSTS = """
import sys
import torch
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
import torch.distributed.checkpoint as dcp

from xla_train.run.checkpoint import split_moments
from xla_train.io.checkpoint_io import trained_state
from xla_train.core.roles import optimizer_params
from xla_train.core.select import select_roles

X = torch_xla._XLAC
indices, shards, load = X._get_local_shard_replica_and_indices, X._get_local_shards, X._load_local_shards


def as_host(devices):
    # torch_xla reports only these devices' shards as local, as on the pod's host that has them;
    # the shards loaded go to these devices, and the others (another host's) keep their data
    X._get_local_shard_replica_and_indices = lambda ts: [[r[d] for d in devices] for r in indices(ts)]
    X._get_local_shards = lambda ts: [[r[d] for d in devices] for r in shards(ts)]

    def load_these(t, data, names):
        given, everyone = dict(zip(names, data)), shards([t])[0]
        load(t, [given.get(name, old) for old, name in everyone], [name for _, name in everyone])
    X._load_local_shards = load_these


strategy = select_roles("xla", strategy="fsdp").strategy
folder, per_host = sys.argv[1], int(sys.argv[2])
hosts = [list(range(h, h + per_host)) for h in range(0, 8, per_host)]


def trained(seed):
    # FSDPv2 splits the biases of 5 and 2 (and a weight's 5 rows) over 8 devices: some hold none of them
    torch.manual_seed(seed)
    model = strategy.wrap_model(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5),
                                                    torch.nn.Linear(5, 2)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 3).to(strategy.accelerator.device)).sum().backward()
    optimizer.step()
    torch_xla.sync()
    return model, optimizer


model, optimizer = trained(0)
saved = {"model": trained_state(strategy.unwrap_model(model)), "optimizer": split_moments(optimizer)[1]}
for h, devices in enumerate(hosts):
    as_host(devices)
    strategy.save_shards(saved, f"{folder}/host-{h}")
print("model.2.bias" in dcp.FileSystemReader(f"{folder}/host-1").read_metadata().state_dict_metadata)

model, optimizer = trained(1)
params = optimizer_params(optimizer)
resumed = {"model": trained_state(strategy.unwrap_model(model), live=True),
           "optimizer": {k: strategy.zeros_like_param(params[int(k.split(".")[0])]) for k in saved["optimizer"]}}
for h, devices in enumerate(hosts):
    as_host(devices)
    strategy.load_shards(resumed, f"{folder}/host-{h}")
as_host(range(8))
pairs = [(a, b) for part in saved for a, b in zip(strategy.read(saved[part].values()),
                                                  strategy.read(resumed[part].values()))]
print(len(pairs), all(torch.equal(a, b) for a, b in pairs))
"""


@pytest.mark.parametrize("per_host", [4, 1])
def test_pod_hosts_holding_none_of_a_tensor_resume_it(per_host, tmp_path):
    """8 XLA:CPU devices as 2 hosts of 4 (a v4-16) or 8 hosts of 1: each host writes and reads
    its own shards (torch_xla told that only its devices' shards are local), and the resumed
    weights and AdamW moments equal the saved ones. FSDPv2 splits a bias of 2 over every
    device: host 1 of 2 x 4 holds none of it, and torch_xla's SPMDSavePlanner leaves it out of
    that host's metadata (its empty shards share one offset, and its dedup drops them all); a
    host of 1 holding none of it writes a chunk of 0 elements. Both failed to resume: a KeyError
    taken for a corrupt checkpoint, and the refusal of test_shards_that_miss_part_of_a_hosts_tensor."""


    proc = run_python(["-c", POD_HOSTS, tmp_path, per_host],
                      {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 6 trained tensors and their 12 moments
    assert proc.stdout.split() == [str(per_host == 1), "18", "True"]


POD_COPIES = EVALUATION_SETUP.format(engine=', strategy="fsdp"', batch=2) + """
import torch_xla.runtime as xr
from xla_train.io.checkpoint_io import trained_state

weights = list(trained_state(engine.unwrap_model(model)).values())
one_host = engine.to_host(weights)  # from the shards
xr.process_count = lambda: 2  # the pod's paths: another host holds shards, and has a process to agree with


def grew(work):
    def counts():
        return [met.counter_value("ReplicateShardedData") or 0, (met.metric_data("CompileTime") or (0,))[0]]
    before = counts()
    work()
    return [a - b for a, b in zip(counts(), before)]


out = {"batches": len(loader), "weights": len(weights), "shapes": len({(w.shape, w.dtype) for w in weights})}
objective = task.objective
metric = objective.load_metric()
out["evaluations"] = [grew(lambda: evaluate_model(engine, model, loader, objective, metric)) for _ in range(3)]
out["agreements"] = [grew(lambda: engine.on_every(lambda: None, "agree")) for _ in range(3)]
copies = []
out["copies"] = [grew(lambda: copies.append(engine.to_host(weights))) for _ in range(2)]
out["equal"] = all(torch.equal(a, b) for c in copies for a, b in zip(c, one_host))
print(json.dumps(out))
"""


def test_pod_copies_to_the_host_compile_no_program_each(mrpc_slice, tiny_model):
    """On a pod a host cannot read the others' shards: the copy of a split tensor to the host
    compiles and runs an identity program that replicates it, at every copy (torch_xla's
    ReplicateShardedData, uncached). Here 4 XLA:CPU devices take the pod's paths (two
    processes counted): what is copied is made whole inside a graph that is compiled once,
    so evaluation batches, agreements between the hosts and copies of the weights compile
    nothing after the first (before: 6 per evaluation, 1 per agreement, 41 per copy of the
    weights). torch_xla's counter ReplicateShardedData counts every copy still: a replicated
    tensor is read from its first device, with no program. The weights equal the shards'."""
    import json


    proc = run_python(["-c", POD_COPIES, tiny_model, mrpc_slice],
                      {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batches"] == 6 and out["equal"]
    # [copies of sharded data, compilations]: the evaluation graph once, one copy per batch
    assert out["evaluations"] == [[6, 1], [6, 0], [6, 0]], out
    assert out["agreements"] == [[1, 1], [1, 0], [1, 0]], out
    # one graph for each shape of the tiny BERT's 41 weights, then none
    assert out["copies"] == [[41, out["shapes"]], [41, 0]] and out["shapes"] < 41, out


@pytest.mark.parametrize("damage", ["no metadata", "damaged metadata", "truncated shards", "other hosts",
                                    "other strategy"])
def test_a_damaged_or_mismatched_shard_checkpoint_stops_in_one_line(damage, xla_fsdp_run, mrpc_slice, tiny_model,
                                                                    tmp_path):
    """Resuming from a checkpoint whose host shards are missing or damaged, or under a strategy
    that keeps no shards, ends with one line (exit 2) before any step."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(xla_fsdp_run[2], out)
    folder = out / "checkpoints" / "step-00000012"
    shards = folder / "shards" / "host-0"
    args = [*FSDP, "--model", tiny_model, "--data-dir", mrpc_slice, "--output-dir", out, "--resume-from", folder]
    expected = f"xla-train: error: checkpoint {folder} is corrupt: shards/host-0"
    if damage == "no metadata":
        (shards / ".metadata").unlink()
        expected += "/.metadata missing"
    elif damage == "damaged metadata":
        (shards / ".metadata").write_bytes((shards / ".metadata").read_bytes()[:100])
        expected += ": "
    elif damage == "truncated shards":
        with open(shards / "__0_0.distcp", "r+b") as f:
            f.truncate(1000)
        expected += ": PytorchStreamReader failed reading zip archive"
    elif damage == "other hosts":
        state = json.loads((folder / "state.json").read_text())
        (folder / "state.json").write_text(json.dumps({**state, "hosts": 2}))
        expected = (f"xla-train: error: checkpoint {folder} was made on 2 host(s); this run has 1: resume on as "
                    "many hosts (each reads the shards it wrote)")
    else:
        args[args.index("fsdp")] = "spmd"
        expected = (f"xla-train: error: checkpoint {folder} holds its hosts' shards (written by --backend xla "
                    "--strategy fsdp): resume with --backend xla --strategy fsdp")
    proc, _ = run_cli(args, tmp_path, env=FOUR)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(expected), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "step 13" not in proc.stderr


def test_lora_under_fsdp_resumes_exactly_and_saves_its_adapter(mrpc_slice, tiny_dropout_model, tmp_path):
    """--lora on FSDPv2: the peft model wrapped block by block, its frozen base sharded too; a
    resume from its step-4 checkpoint equals the run without it, with dropout in the model and the adapters
    (XLA's generator moves on at every graph cut, and the cuts differ after a resume: it is seeded
    from each micro-batch's position, Engine.seed_micro_batch); the output folder holds
    the adapter's tensors under peft's names, which `xla-train predict` reads and scores as the run
    did."""
    from safetensors.torch import load_file

    # 8 steps (the last --max-steps given counts): checkpoints 4 and 8, the stop after step 4's
    args = [*FSDP, "--max-steps", 8, "--lora", "--lr", 1e-3, "--model", tiny_dropout_model, "--data-dir", mrpc_slice]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path, env=FOUR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0 < whole["trainable_params"] <= 0.05 * whole["total_params"]
    memory = whole["memory"]
    assert memory["param_bytes_per_device"] == -(-memory["param_bytes_total"] // 4)
    assert memory["optimizer_bytes_per_device"] == -(-8 * whole["trainable_params"] // 4)
    adapter = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    assert sum("lora_A" in k for k in adapter) == sum("lora_B" in k for k in adapter) == 4  # query, value x 2 layers
    assert not any("_orig_module" in k for k in adapter)
    assert whole["xla"]["aten_fallbacks"] == 0 and whole["xla"]["compiles_after_first_epoch"] == 0

    resumed = resume_midway(args, tmp_path / "whole", tmp_path / "run", tmp_path, env=FOUR)
    assert [h[0] for h in whole["train_loss"]] == list(range(1, 9))
    torch.testing.assert_close(resumed["train_loss"], whole["train_loss"], atol=1e-6, rtol=0)
    assert_same_weights(tmp_path / "run", tmp_path / "whole", atol=1e-6, file="adapter_model.safetensors")
    assert resumed["eval"] == whole["eval"]

    accuracy, rows = _dev_accuracy(tmp_path / "whole", mrpc_slice, tmp_path)
    assert rows == 48 and accuracy == pytest.approx(whole["eval"]["accuracy"])


def test_shards_are_put_together_without_their_padding():
    """10 rows over 4 devices: shards of 3, 3, 3 and 1 rows, the last padded to 3 (how XLA splits
    unevenly); the host tensor is the whole, without the padding."""
    from xla_train.parallel.xla_strategies import _from_shards

    whole = torch.arange(30.0).view(10, 3)
    pieces, indices = [], []
    for d in range(4):
        rows = slice(3 * d, min(3 * d + 3, 10))
        piece = torch.full((3, 3), -1.0)
        piece[: rows.stop - rows.start] = whole[rows]
        pieces.append(piece)
        indices.append([rows, slice(0, 3)])
    assert torch.equal(_from_shards(whole.shape, pieces, indices), whole)
    assert _from_shards(whole.shape, [whole, whole], [Ellipsis, Ellipsis]) is whole  # replicated
