"""`--strategy spmd|fsdp` on a pod of several hosts: each host's process loads its own rows of
every global batch and hands them to torch_xla as its part (`minibatch`), for training,
evaluation and prediction (generation's prompts go through the same `predict_loader`).

Two hosts of two devices are emulated on 4 XLA:CPU devices in one process: torch_xla's process
index and count and the devices a process addresses are patched (its C++ runtime still sees one
process with 4 devices, so each emulated host's rows are uploaded and computed on all 4).
"""

import json
import os

import pytest
from conftest import run_python

HOSTS = """
import json, sys
import torch
import torch_xla
import torch_xla.runtime as xr
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from xla_train.core.batching import make_loader
from xla_train.core.engine import Engine
from xla_train.core.inference import infer, predict_loader
from xla_train.core.shapes import Padding
from xla_train.tasks import Source, load_task
from xla_train.tasks.sequence import tokenize

engine = Engine("xla", strategy=sys.argv[1])
task, splits = load_task(Source(data_dir=sys.argv[3]))
tok = AutoTokenizer.from_pretrained(sys.argv[2])
data, _ = tokenize(splits, tok, 128)
train = data["train"].select(range(157))  # the last global batch of 8 is short: repeats fill it
dev = data["validation"].select(range(45))  # the last global batch of 8 is short: masked filler
dev = dev.add_column("row", list(range(len(dev))))
padding = Padding("buckets", [64, 128], 128)
model = engine.prepare(AutoModelForSequenceClassification.from_pretrained(sys.argv[2]))


def as_host(index, count):
    # what torch_xla tells the process of host `index` of `count`, each host with 4 / count devices
    xr.process_index, xr.process_count = (lambda: index), (lambda: count)
    xr.addressable_runtime_device_count = lambda: 4 // count


def keys(prepared, epoch):
    prepared.set_epoch(epoch)
    return [[[int(k) for k in key] for key in step] for step in prepared.loader.batch_sampler]


out = {}
for host, hosts in ((0, 1), (0, 2), (1, 2)):
    as_host(host, hosts)
    # as train.py and predict.py make them: batches of 2 rows a device
    prepared = {"train": engine.prepare(make_loader(train, tok, 2, padding, shuffle=True, seed=5, fill="repeat")),
                "eval": engine.prepare(make_loader(dev, tok, 2, padding, shuffle=False, seed=5, fill="mask")),
                "predict": predict_loader(engine, tok, dev, 2, padding)}
    spec = engine.strategy.input_sharding()
    cpu_batch = next(iter(prepared["eval"].loader))
    device_batch = next(iter(prepared["eval"]))  # through torch_xla's MpDeviceLoader
    scored = infer(engine, model, prepared["eval"],
                   lambda batch, output: (batch["row"].int(), output.logits.argmax(-1).int(), batch["labels"].int()))
    predicted = infer(engine, model, prepared["predict"],
                      lambda batch, output: (batch["row"].float(), *output.logits.float().T))
    out[f"{host}/{hosts}"] = {
        "steps": {f"{k}{e}": keys(p, e) for k, p in prepared.items() for e in ((0, 1) if k == "train" else (0,))},
        "minibatch": bool(getattr(spec, "minibatch", False)),
        "split": sorted(k for k, t in cpu_batch.items() if spec.xla_spec(t) is not None),
        "device": {k: torch_xla._XLAC._get_xla_sharding_spec(t) for k, t in device_batch.items()},
        "uploaded": all(torch.equal(t.cpu(), cpu_batch[k]) for k, t in device_batch.items()),
        "scored": torch.stack(scored, 1).tolist(),
        "predicted": torch.stack(predicted, 1).tolist(),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=["spmd", "fsdp"])
def pod_hosts(request, mrpc_slice, tiny_model):
    """The script above under `--strategy` spmd and fsdp: one host of 4 devices, then hosts 0
    and 1 of 2 hosts of 2 devices."""
    proc = run_python(["-c", HOSTS, request.param, tiny_model, mrpc_slice],
                      {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["0/1"], [out["0/2"], out["1/2"]]


def test_pod_hosts_rows_together_are_the_one_host_global_batch_at_every_step(pod_hosts):
    """Training (two epochs, the last batch filled with repeats), evaluation and prediction (the
    last batch's filler masked): at every step host 0's rows then host 1's are the one-host run's
    global batch, each host half of it, with the same padded length and filler mask. Before, both
    hosts planned the global batch by (world size 1, process index): host 0 loaded all of it and
    host 1 none."""
    one, hosts = pod_hosts
    assert set(one["steps"]) == {"train0", "train1", "eval0", "predict0"}
    for name, steps in one["steps"].items():
        assert len(steps) == (20 if name.startswith("train") else 6), name
        assert all(len(step) == 8 for step in steps), name
        for host in hosts:
            assert [len(step) for step in host["steps"][name]] == [4] * len(steps), name
        assert [a + b for a, b in zip(*(host["steps"][name] for host in hosts))] == steps, name
    assert one["steps"]["train0"] != one["steps"]["train1"]  # reshuffled each epoch, alike on every host
    assert [valid for _, _, valid in one["steps"]["eval0"][-1]] == [1] * 5 + [0] * 3


def test_pod_hosts_hand_torch_xla_their_rows_as_their_part(pod_hosts):
    """One host keeps its input sharding (2-D inputs split by rows, no `minibatch`); on several
    hosts every tensor of a batch, the 1-D labels, filler mask and row numbers too, is split by
    rows with `minibatch` (a tensor left whole would be replicated from each host's own rows).
    torch_xla's loader uploads each host's rows as they are, split over the devices."""
    one, hosts = pod_hosts
    assert not one["minibatch"] and one["split"] == ["attention_mask", "input_ids", "token_type_ids"]
    assert one["device"]["labels"] == "{replicated}"
    for host in hosts:
        assert host["minibatch"]
        assert host["split"] == ["attention_mask", "input_ids", "labels", "row", "token_type_ids", "valid"]
        assert host["device"] == {"input_ids": "{devices=[4,1]0,1,2,3}", "token_type_ids": "{devices=[4,1]0,1,2,3}",
                                  "attention_mask": "{devices=[4,1]0,1,2,3}", "row": "{devices=[4]0,1,2,3}",
                                  "labels": "{devices=[4]0,1,2,3}"}
        assert host["uploaded"]


def test_pod_hosts_evaluate_and_predict_every_row_once(pod_hosts):
    """Run on XLA:CPU for real, each emulated host's evaluation and prediction score its own
    rows, the filler dropped: together every row once, with the one-host run's labels,
    predicted classes and logits."""
    import torch

    one, hosts = pod_hosts
    assert sorted(row for row, _, _ in one["scored"]) == list(range(45))
    assert sorted(map(tuple, hosts[0]["scored"] + hosts[1]["scored"])) == sorted(map(tuple, one["scored"]))
    assert len(hosts[0]["scored"]) == 24 and len(hosts[1]["scored"]) == 21
    together = torch.tensor(sorted(hosts[0]["predicted"] + hosts[1]["predicted"]))
    expected = torch.tensor(sorted(one["predicted"]))
    assert together[:, 0].tolist() == list(range(45))
    torch.testing.assert_close(together, expected, rtol=0, atol=1e-5)
