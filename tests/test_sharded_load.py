"""`--backend xla --strategy fsdp` loads the checkpoint's weights straight into their shards
(xla_train/parallel/sharded_load.py): the model is built on the meta device, each parameter made on
the 4 XLA:CPU devices already sharded from the slices of the safetensors its devices hold.

Run on 4 XLA:CPU devices in processes of their own: the same parameters, ties, buffers, new head
and first steps as the whole load then FSDPv2's wrap, bit for bit; the process's peak resident
memory over the load, against the whole load's; what each of 2 emulated hosts reads (the emulation
cannot give a host devices of its own: torch_xla's runtime still sees one process with 4 devices,
so the hosts' reading and selection of slices is run, their upload is not); and a CLI run."""

import json
import os
import subprocess
import sys

import pytest
import tiny_decoders as td
from conftest import ROOT

FOUR = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "TOKENIZERS_PARALLELISM": "false"}


def _run(script, *args, env=FOUR, timeout=600):
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


# Both scripts below: two AdamW steps of a prepared model on fixed rows, and the comparison of a
# skeleton's run with the whole load's, read back from the devices.
TWO_STEPS = r"""
import torch, torch_xla


def two_steps(engine, model, optimizer, ids, kind):
    state = engine.unwrap_model(model).state_dict(keep_vars=True)
    out = {"specs": {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in state.items()}}
    labels = ids if kind == "causal-lm" else torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    batch = {"input_ids": ids.to(engine.device), "labels": labels.to(engine.device)}
    losses = []
    for step in range(2):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        # a graph a step, as the training loop cuts it: the two steps as one graph compiled in
        # 46 s (XLA:CPU, 4 devices, tiny Llama), three graphs of one step each in 3.5 s
        torch_xla.sync()
    values = engine.strategy.read([*losses, *state.values()])
    return {**out, "losses": [v.item() for v in values[:2]], "state": dict(zip(state, values[2:]))}


def compared(new, whole):
    return {"same_keys": list(new["state"]) == list(whole["state"]),
            "differing": [k for k in new["state"] if not torch.equal(new["state"][k], whole["state"][k])],
            "losses": [new["losses"], whole["losses"]], "specs_same": new["specs"] == whole["specs"]}
"""

SAME = TWO_STEPS + r"""
import functools, json, sys
import torch, torch_xla
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine
from xla_train.tasks.causal_lm import DecoderModel
from xla_train.tasks.sequence import SequenceModel

engine = Engine("xla", strategy="fsdp")
results = {}
for case in sys.argv[1:]:
    folder, kind = case.split("|")
    part = DecoderModel() if kind == "causal-lm" else SequenceModel(num_labels=3)
    load = functools.partial(part.load, folder, 7, 0)
    skeleton = sharded_load.skeleton(load, folder)
    out = {"meta": sum(p.is_meta for p in skeleton.parameters()),
           "on_host": sorted(n for n, p in skeleton.named_parameters() if not p.is_meta)}
    ids = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(0))
    for name, model in (("new", skeleton), ("whole", load())):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = engine.prepare(model, optimizer)
        plain = engine.unwrap_model(model)
        out[name] = two_steps(engine, model, optimizer, ids, kind)
        if kind == "causal-lm":
            out[name]["tied"] = plain.lm_head.weight is plain.model.embed_tokens.weight
    new, whole = out.pop("new"), out.pop("whole")
    out.update(compared(new, whole))
    out["tied"] = [new.get("tied"), whole.get("tied")]
    results[case] = out
print(json.dumps(results))
"""
CASES = [("llama", "causal-lm"), ("qwen2", "causal-lm"), ("llama", "classification")]


@pytest.fixture(scope="module")
def same_as_whole(tmp_path_factory):
    """The script above on a tiny Llama and Qwen2 (td.save) and the Llama as a classifier, in one
    process of 4 XLA:CPU devices."""
    folder = tmp_path_factory.mktemp("same")
    cases = {(family, kind): f"{td.save(family, folder / family)}|{kind}" for family, kind in CASES}
    _, out = _run(SAME, *cases.values())
    return {key: out[case] for key, case in cases.items()}


# one process runs the module fixture for the three cases (conftest groups fixtures that call run_cli or
# subprocess.run, not _run): two would each run it
@pytest.mark.xdist_group("run-same_as_whole")
@pytest.mark.parametrize("family,kind", CASES)
def test_sharded_load_gives_the_whole_loads_parameters_and_steps_bit_for_bit(family, kind, same_as_whole):
    """A tiny Llama (tied embeddings) and a Qwen2 (biases, tied), and a Llama classifier (a new head
    of 3, seeded): loaded into their shards, then two AdamW steps, the same parameters (and
    buffers: the rotary inv_freq recomputed), layouts, ties and losses as the whole load, bit for
    bit. Only the new head is made on the host."""
    out = same_as_whole[family, kind]
    assert out["meta"] > 0
    assert out["on_host"] == ([] if kind == "causal-lm" else ["score.weight"])
    assert out["same_keys"] and out["differing"] == [], out["differing"]
    assert out["specs_same"]
    assert out["losses"][0] == out["losses"][1]
    if kind == "causal-lm":
        assert out["tied"] == [True, True]


LORA_SAME = TWO_STEPS + r"""
import functools, json, sys
import torch, torch_xla
from xla_train import Mesh
from xla_train.core.engine import Engine
from xla_train.kernels.quant import Quant
from xla_train.models import add_adapters, hold_frozen_in_bf16, load_base, quantize_skeleton
from xla_train.options import TrainOptions
from xla_train.parallel import sharded_load
from xla_train.tasks.causal_lm import DecoderModel
from xla_train.tasks.sequence import SequenceModel

QUANTS = {"none": None, "int8": Quant(8, "int8"), "nf4": Quant(4, "nf4"), "nf4-nested": Quant(4, "nf4", nested=True)}
section = TrainOptions(lora=True, lora_dropout=0.0).section("model")
# a classifier's head a target too: peft trains a copy of it instead (modules_to_save)
head_too = TrainOptions(lora=True, lora_dropout=0.0, lora_targets="q_proj,v_proj,score").section("model")
results = {}
for case in sys.argv[1:]:
    folder, kind, tensor, precision, task = case.split("|")
    quant = QUANTS[kind]
    engine = Engine("xla", strategy="fsdp", mesh=Mesh(tensor=int(tensor)))
    part = DecoderModel() if task == "causal-lm" else SequenceModel(num_labels=3)
    load = functools.partial(part.load, folder, 7, 0)
    skeleton = sharded_load.skeleton(load, folder)  # as job.pretrained builds it
    skeleton = quantize_skeleton(skeleton, quant) if quant else skeleton
    out = {"meta_buffers": sum(b.is_meta for b in skeleton.buffers())}
    ids = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(0))
    for name, model in (("new", skeleton), ("whole", load_base(load, quant, "xla", precision, folder))):
        torch.manual_seed(3)  # the adapters' initial values
        model = add_adapters(model, section if task == "causal-lm" else head_too, part.peft_task_type)
        if precision == "bf16":
            hold_frozen_in_bf16(model)
        if name == "new":
            out["adapters_on_host"] = all(not p.is_meta for n, p in model.named_parameters() if "lora_" in n)
            out["frozen"] = sorted({n.rsplit(".", 1)[1] for n, p in model.named_parameters() if p.is_meta
                                    and not p.requires_grad})
            out["trained"] = sorted({n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad})
            out["head_on_meta"] = all(p.is_meta for n, p in model.named_parameters() if "score" in n)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = engine.prepare(model, optimizer)
        out[name] = two_steps(engine, model, optimizer, ids, task)
    new, whole = out.pop("new"), out.pop("whole")
    out.update(compared(new, whole))
    out["buffers"] = sorted({k.rsplit(".", 1)[1] for k in new["state"] if "up_proj." in k and "lora" not in k})
    out["up_proj"] = {k.rsplit(".", 1)[1]: v for k, v in new["specs"].items() if "layers.0.mlp.up_proj." in k
                      and "lora" not in k}
    results[case] = out
print(json.dumps(results))
"""
# (family, quantization, tensor-parallel size, precision, task): int8 over fsdp=4; nested NF4 over fsdp=2
# x tensor=2 with the frozen base in bf16; NF4 on Qwen2 (biases, an MLP 345 wide: rows split unevenly, 87
# a device and 84); the plain LoRA base in bf16; a classifier whose checkpoint holds its head (peft
# trains a copy of it: modules_to_save; the head named among the targets too), over NF4
LORA_CASES = [("llama", "int8", 1, "fp32", "causal-lm"), ("llama", "nf4-nested", 2, "bf16", "causal-lm"),
              ("qwen2", "nf4", 1, "fp32", "causal-lm"), ("qwen2", "none", 1, "bf16", "causal-lm"),
              ("llama-classifier", "nf4", 1, "fp32", "classification")]


@pytest.fixture(scope="module")
def lora_same_as_whole(tmp_path_factory):
    from xla_train.tasks.sequence import SequenceModel

    folder = tmp_path_factory.mktemp("lora-same")
    paths = {family: td.save(family, folder / family) for family in ("llama", "qwen2")}
    classifier = SequenceModel(num_labels=3).load(paths["llama"], 7, 0)  # its new head, saved with it
    classifier.save_pretrained(folder / "llama-classifier")
    paths["llama-classifier"] = folder / "llama-classifier"
    cases = {case: "|".join(map(str, (paths[case[0]], *case[1:]))) for case in LORA_CASES}
    _, out = _run(LORA_SAME, *cases.values())
    return {key: out[case] for key, case in cases.items()}


@pytest.mark.xdist_group("run-lora_same_as_whole")
@pytest.mark.parametrize("case", LORA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_lora_base_quantized_or_not_loads_into_its_shards_as_the_whole_load(case, lora_same_as_whole):
    """LoRA's base built without its weights (job.pretrained: the skeleton, its projections made
    QuantLinear on the meta device), peft's adapters added on the host (models._host_stand_ins),
    then read into its shards as FSDPv2 wraps it, each quantized projection's buffers from its
    devices' rows: every parameter and buffer, its layout and two AdamW steps' losses are the whole
    load's (load_base: quantized as it is read, then split by rows), bit for bit."""
    family, kind, tensor, precision, task = case
    out = lora_same_as_whole[case]
    assert out["adapters_on_host"]
    # a classifier's head and its trained copy: read from the checkpoint as the wrap makes them
    assert out["trained"] == ["lora_A", "lora_B"] + ["modules_to_save"] * (task == "classification")
    assert out["head_on_meta"]
    if kind == "none":
        assert out["meta_buffers"] == 0 and out["buffers"] == ["weight"]
    else:
        row_buffers = {"int8": ["qweight", "scales"], "nf4": ["code", "qweight", "scales"],
                       "nf4-nested": ["code", "qweight", "scale_mean", "scale_scales", "scales"]}[kind]
        assert out["buffers"] == row_buffers
        # 2 layers of 7 projections; Qwen2's down_proj (345 inputs, odd: two 4-bit codes a byte) stays as it is
        projections = 2 * (7 if family.startswith("llama") else 6)
        assert out["meta_buffers"] == projections * len([b for b in row_buffers if b != "code"])
        devices = "{devices=[4]0,1,2,3}", "{devices=[4,1]0,1,2,3}"  # split with the rows over every device
        assert all(out["up_proj"][b] == devices[b not in ("scale_mean",) and not (kind == "int8" and b == "scales")]
                   for b in row_buffers if b != "code"), out["up_proj"]
    assert "weight" in out["frozen"]  # the base's own tensors: still on the meta device, frozen, until the wrap
    assert out["same_keys"] and out["differing"] == [], out["differing"]
    assert out["specs_same"]
    assert out["losses"][0] == out["losses"][1]
    assert out["losses"][0][1] < out["losses"][0][0]


PEAK = r"""
import functools, json, sys
import torch, torch_xla
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine
from xla_train.tasks.causal_lm import DecoderModel

folder, way = sys.argv[1], sys.argv[2]
engine = Engine("xla", strategy="fsdp")
(torch.ones(4, device=engine.device) + 1).cpu()  # the runtime started


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


# the peak so far (VmHWM) set back to what is resident now (Linux's clear_refs "5"): a higher peak
# of the start-up (imports, the runtime's) would hide the load's
peak_before = status("VmHWM")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
load = functools.partial(DecoderModel().load, folder, 0, None)
model = sharded_load.skeleton(load, folder) if way == "new" else load()
model = engine.prepare(model)
engine.accelerator.synchronize()
peak = status("VmHWM")
print(json.dumps({"base": base, "peak_before": peak_before, "peak": peak, "after": status("VmRSS")}))
"""


def _big_llama(path):
    """A Llama-shaped model of about 300 MB in fp32 (6 blocks 1,024 wide, GQA, 16,000 words, tied),
    random weights, saved by save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    block = 4 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816)  # attention (GQA) and MLP, fp32
    return sum(p.numel() * 4 for p in model.parameters()), block, 16000 * 1024 * 4  # the embedding


@pytest.mark.slow
def test_the_peak_memory_of_a_sharded_load_is_the_model_once_plus_a_block(tmp_path):
    """A 321 MiB fp32 Llama on 4 XLA:CPU devices (whose memory is the host's): over the load, the
    process's peak resident memory grows by the weights once (their shards) plus at most a block
    or the largest tensor (the embedding, 62.5 MiB, read while the others are on the devices)
    and 32 MiB, where the whole load then FSDPv2's wrap grew by about three times the model."""
    weights, block, largest = _big_llama(tmp_path / "big")
    peaks = {way: _run(PEAK, tmp_path / "big", way)[1] for way in ("new", "whole")}
    grown = {way: p["peak"] - p["base"] for way, p in peaks.items()}
    print(f"model {weights / 2**20:.0f} MiB, a block {block / 2**20:.0f} MiB, the embedding "
          f"{largest / 2**20:.1f} MiB; peak RSS over the load: sharded {grown['new'] / 2**20:.0f} MiB, whole "
          f"{grown['whole'] / 2**20:.0f} MiB")
    assert grown["new"] <= weights + max(block, largest) + 32 * 2**20, grown
    assert grown["whole"] >= 1.7 * weights, grown


HOSTS = r"""
import functools, json, sys
import torch
import torch_xla.runtime as xr
from xla_train.parallel import sharded_load
from xla_train.core.engine import Engine
from xla_train.parallel.xla_strategies import _param_spec
from xla_train.tasks.causal_lm import DecoderModel

folder = sys.argv[1]
engine = Engine("xla", strategy="fsdp")
mesh = engine.strategy.mesh()


def io():
    with open("/proc/self/io") as f:
        return dict(line.split(": ") for line in f.read().splitlines())


out = {}
for host, hosts in ((0, 2), (1, 2), (0, 1)):
    # this host's devices, as torch_xla gives a host of `hosts` its consecutive global ordinals
    devices = list(range(host * 4 // hosts, (host + 1) * 4 // hosts))
    model = sharded_load.skeleton(functools.partial(DecoderModel().load, folder, 0, None), folder)
    checkpoint = getattr(model, sharded_load.SOURCE)
    before = int(io()["rchar"])
    pieces = {}
    for holders, p, spec, places, shards in checkpoint.host_shards(model, mesh, _param_spec, devices):
        pieces[holders[0][1] + str(tuple(p.shape))] = [[(s.start, s.stop) for s in index] for index in places]
    checkpoint.close()
    out[f"{host}/{hosts}"] = {"read": checkpoint.bytes_read, "rchar": int(io()["rchar"]) - before,
                             "total": sum(checkpoint.bytes.values()), "largest": max(checkpoint.bytes.values()),
                             "files": sum(f.stat().st_size for f in checkpoint.files)}
print(json.dumps(out))
"""


def _sharded_llama(path, vocab, layers, shard_size):
    """A random Llama (256 wide, grouped keys and values, untied) saved as a sharded checkpoint (an
    index and several files of `shard_size`), as transformers writes a large model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size=shard_size)
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.mark.slow
def test_each_emulated_host_reads_its_devices_shards_only(tmp_path):
    """2 hosts of 2 devices emulated by the devices each reads for (its global ordinals): each
    reads at most the weights / 2 plus one tensor, together all of them once, counted by the
    loader and by the kernel's read counter of the process (/proc/self/io rchar: safetensors'
    pread reads). One host of 4 reads all of it. The file is a sharded checkpoint (an index and
    several files), as transformers writes a large model."""
    _, out = _run(HOSTS, _sharded_llama(tmp_path / "m", 4000, 4, "2MB"))
    one, hosts = out["0/1"], [out["0/2"], out["1/2"]]
    total = one["total"]
    assert one["read"] == total <= one["files"]
    for host in hosts:
        print(f"host reads {host['read'] / 2**20:.2f} MiB of {total / 2**20:.2f} MiB (rchar {host['rchar']})")
        assert host["read"] <= total / 2 + host["largest"]
        # the process's reads: the slices' bytes, plus what else it read meanwhile (headers, lazy imports: 0.2 MiB)
        assert host["read"] <= host["rchar"] <= host["read"] + 2**20
    assert sum(h["read"] for h in hosts) == total


QUANT_HOSTS = r"""
import functools, json, sys
import torch
from safetensors.torch import load_file
from xla_train.core.engine import Engine
from xla_train.kernels.quant import Quant
from xla_train.kernels.quant_xla import quantize
from xla_train.models import add_adapters, quantize_skeleton
from xla_train.options import TrainOptions
from xla_train.parallel import sharded_load
from xla_train.tasks.causal_lm import DecoderModel

folder = sys.argv[1]
engine = Engine("xla", strategy="fsdp")
mesh, row_spec = engine.strategy.mesh(), engine.strategy.row_spec
weights = {}
for f in sharded_load.safetensors_files(folder):
    weights.update(load_file(f))
model = quantize_skeleton(sharded_load.skeleton(functools.partial(DecoderModel().load, folder, 0, None), folder),
                          Quant(4, "nf4", nested=True))
model = add_adapters(model, TrainOptions(lora=True).section("model"), "CAUSAL_LM")  # peft's names, as a run has them
checkpoint = sharded_load.take(model)
out = {}
for host, hosts in ((0, 2), (1, 2), (0, 1)):
    devices = list(range(host * 4 // hosts, (host + 1) * 4 // hosts))  # this host's global ordinals
    before, wrong, layers = checkpoint.bytes_read, [], 0
    for module, buffers in checkpoint.host_rows(model, mesh, row_spec, devices):
        layers += 1
        key = checkpoint.checkpoint_key(next(n for n, m in model.named_modules() if m is module) + ".weight")
        whole = quantize(weights[key], module.kind, module.block, module.nested)  # the whole weight's
        for b, buffer, spec, places, shards in buffers:
            for index, shard in zip(places, shards):
                rows = index[0].stop - index[0].start
                if not torch.equal(shard[:rows], whole[b][index[0]]):
                    wrong.append(f"{key} {b} {index[0]}")
    out[f"{host}/{hosts}"] = {"read": checkpoint.bytes_read - before, "wrong": wrong, "layers": layers,
                             "devices": len(devices)}
projections = [k for k in checkpoint.shapes if k.endswith("proj.weight")]
out["total"] = sum(checkpoint.bytes[k] for k in projections)
out["largest"] = max(checkpoint.bytes[k] for k in projections)
checkpoint.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_each_emulated_host_quantizes_its_devices_rows_only(tmp_path):
    """A LoRA base in nested NF4 from a sharded checkpoint, 2 hosts of 2 devices emulated by the
    devices each reads for: each reads at most half the projections' bytes plus one projection,
    together each byte once, and quantizes the rows it read into what quantizing each whole weight
    gives those rows (the nested scales' groups and means are each row's own); one host of 4 reads
    them all."""
    _, out = _run(QUANT_HOSTS, _sharded_llama(tmp_path / "m", 1000, 2, "1MB"))
    one, hosts = out["0/1"], [out["0/2"], out["1/2"]]
    assert one["read"] == out["total"] and one["layers"] == 2 * 7 and one["wrong"] == []
    for host in hosts:
        print(f"host reads {host['read'] / 2**20:.2f} MiB of the projections' {out['total'] / 2**20:.2f} MiB")
        assert host["layers"] == 2 * 7 and host["wrong"] == [], host["wrong"][:5]
        assert host["read"] <= out["total"] / 2 + out["largest"]
    assert sum(h["read"] for h in hosts) == out["total"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--lora", "--load-in-4bit", "--use-bnb-nested-quant", "--precision", "bf16"],
                                   ["--lora", "--backend", "cpu", "--num-processes", 2]],
                         ids=["full", "qlora-bf16", "fsdp2-lora"])
def test_a_cli_fsdp_run_loads_sharded_and_trains_as_the_whole_load(tmp_path, extra):
    """`xla-train train --backend xla --strategy fsdp --problem causal-lm` on a tiny Llama for 4
    steps on 4 XLA:CPU devices, fully and with LoRA over a nested-NF4 base in bf16, and LoRA under
    FSDP2 on 2 gloo workers (`--backend cpu`): the console says what the host (a worker) read, and
    the losses are those of the same run loading the model whole (skeleton switched off in that
    process: the base quantized as transformers reads it)."""
    folder = td.save("llama", tmp_path / "llama", chat=True, letters=True)
    train = td.write_jsonl(tmp_path / "train.jsonl", td.reverse_rows(200, 1))
    valid = td.write_jsonl(tmp_path / "valid.jsonl", td.reverse_rows(16, 2))
    args = ["train", "--backend", "xla", "--strategy", "fsdp", "--problem", "causal-lm", "--model", folder,
            "--train-file", train, "--validation-file", valid, "--max-length", 64, "--batch-size", 2,
            "--max-steps", 4, "--log-every", 1, "--lr", 3e-3, *extra]
    runs = {}
    for way in ("new", "whole"):
        metrics = tmp_path / f"{way}.json"
        script = ("import sys; from xla_train.parallel import sharded_load\n"
                  + ("sharded_load.skeleton = lambda load, name: None\n" if way == "whole" else "")
                  + "from xla_train.commands.cli import main; sys.exit(main(sys.argv[1:]))")
        proc = subprocess.run([sys.executable, "-c", script, *map(str, args), "--metrics-out", str(metrics),
                               "--output-dir", str(tmp_path / way)], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env=FOUR)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[way] = (proc, json.loads(metrics.read_text()))
    new, whole = runs["new"], runs["whole"]
    reader = "worker 0" if "cpu" in extra else "this host"
    assert f"loaded {folder}: {reader} read " in new[0].stdout
    assert "loaded " not in whole[0].stdout
    if "--load-in-4bit" in extra:
        assert all("--load-in-4bit: 14 linear projections of the base held in nf4" in p.stdout for p, _ in (new, whole))
    losses = [[loss for _, loss, _ in m["train_loss"]] for _, m in (new, whole)]
    assert len(losses[0]) == 4
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-6, losses


def test_a_slice_read_is_the_tensors_slice_and_only_its_bytes(tmp_path):
    """Checkpoint.read: a slice of the first dimension, of a later one (FSDPv2 splits a
    parameter's largest dimension), of two, a whole tensor and a scalar, in fp32 and bf16, are
    safetensors' own tensor sliced; the bytes counted are the slice's."""
    import torch
    from safetensors.torch import load_file, save_file

    from xla_train.parallel.sharded_load import Checkpoint

    torch.manual_seed(0)
    tensors = {"a": torch.randn(10, 7), "b": torch.randn(3, 12, 5).to(torch.bfloat16), "s": torch.tensor(2.5)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    checkpoint = Checkpoint([tmp_path / "model.safetensors"], "m")
    expected = load_file(tmp_path / "model.safetensors")
    for key, index in (("a", (slice(3, 6), slice(0, 7))), ("a", (slice(0, 10), slice(2, 7))),
                       ("b", (slice(0, 3), slice(4, 8), slice(0, 5))), ("b", (slice(1, 2), slice(3, 12), slice(1, 4))),
                       ("b", (slice(0, 3), slice(0, 12), slice(0, 5))), ("s", ())):
        before = checkpoint.bytes_read
        piece = checkpoint.read(key, index)
        assert torch.equal(piece, expected[key][index]), (key, index)
        assert piece.dtype == expected[key].dtype
        if key != "b" or index[0] != slice(1, 2):  # two dimensions cut: the first's rows are read
            assert checkpoint.bytes_read - before == piece.numel() * piece.element_size()
    checkpoint.close()


@pytest.mark.parametrize("family", ["llama", "qwen3moe", "mixtral"])
def test_converts_is_where_a_skeleton_loads_whole(tmp_path, family):
    """sharded_load.converts, job.pretrained's reason to load a quantized base whole (quantized as
    it is read, not whole in full precision first), says yes exactly where `skeleton` loads the
    model whole: the mixtures, whose experts transformers stacks as it loads them."""
    import functools

    from xla_train.parallel import sharded_load
    from xla_train.tasks.causal_lm import DecoderModel

    folder = td.save(family, tmp_path / family)
    model = sharded_load.skeleton(functools.partial(DecoderModel().load, folder, 0, None), folder)
    loaded_whole = not any(p.is_meta for p in model.parameters())
    assert loaded_whole == (family != "llama")
    assert sharded_load.converts(model.config.model_type) == loaded_whole
