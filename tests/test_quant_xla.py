"""LoRA over a base kept in 8 or 4 bits on XLA and the plain CPU (xla_train.kernels.quant_xla): every
adapter's gradient against a reference whose base is the dequantized weights in plain nn.Linear, on
the CPU here and on XLA:CPU in one subprocess (which also counts a few training steps' graphs,
fallbacks and host transfers against plain LoRA's); the adapter saved as peft saves it; the
quantized buffers' split under --strategy fsdp with and without --tensor-parallel (4 devices, one
subprocess); a DPO run whose reference is the quantized base without the adapter."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_python

from xla_train.core.errors import UserError
from xla_train.kernels.quant import Quant, projection_bytes

HERE = Path(__file__).resolve().parent
QUANTS = {"int8": Quant(8, "int8"), "nf4": Quant(4, "nf4"), "nf4-nested": Quant(4, "nf4", nested=True)}
DECODER_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # every projection: every adapter checked
# Llama (GQA) 64 wide: blocks of 64; Qwen2 (attention biases) 80 wide, MLP 432: a row 64 does not divide is one block
SIZES = {"llama": 64, "qwen2": 80}


def _base(family):
    """`family`'s tiny decoder (tests/tiny_decoders.py, the published flags) or the tiny BERT classifier."""
    import tiny_decoders as td
    from transformers import AutoModelForCausalLM, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if family == "bert":
        return BertForSequenceClassification(BertConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=128))
    return AutoModelForCausalLM.from_config(td.config(family, 40, size=SIZES[family], bos=1, eos=2)).float()


def _with_lora(model, family):
    from xla_train.models import add_adapters
    from xla_train.options import TrainOptions

    targets = None if family == "bert" else DECODER_TARGETS
    options = TrainOptions(lora=True, lora_targets=targets, lora_dropout=0.0).section("model")
    return add_adapters(model, options, "SEQ_CLS" if family == "bert" else "CAUSAL_LM")


def pair(family, quant):
    """(LoRA over the quantized base, LoRA over plain nn.Linear holding its dequantized weights, how
    many layers were quantized), with the same adapters: lora_B drawn at random so that every
    adapter's gradient is non-zero."""
    from xla_train.kernels.quant_xla import QuantLinear, quantize_base

    base = _base(family)
    reference = copy.deepcopy(base)
    n = quantize_base(base, quant)
    for name, module in base.named_modules():
        if isinstance(module, QuantLinear):
            reference.get_submodule(name).weight.data = module.dequantize()
    model, reference = _with_lora(base, family), _with_lora(reference, family)
    torch.manual_seed(1)
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k or "score" in k or "classifier" in k}
    for k, v in trained.items():
        if "lora_B" in k:
            v.normal_(0, 0.1)
    assert not reference.load_state_dict(trained, strict=False).unexpected_keys  # the same names as plain LoRA's
    return model.eval(), reference.eval(), n


def batch(family):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 40, (2, 12), generator=g)
    labels = torch.tensor([0, 1]) if family == "bert" else ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def gradients(model, inputs):
    """{name: gradient} of `model`'s trainable parameters after one backward of its loss on `inputs`."""
    model.zero_grad()
    model(**inputs).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _adapter_keys(model, folder):
    from safetensors import safe_open

    model.save_pretrained(folder)
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    return keys, json.loads((folder / "adapter_config.json").read_text())


@pytest.mark.parametrize("family", ["llama", "qwen2", "bert"])
@pytest.mark.parametrize("kind", sorted(QUANTS))
def test_every_adapter_gets_the_dequantized_reference_gradient_on_the_cpu(family, kind):
    model, reference, n = pair(family, QUANTS[kind])
    assert n == {"llama": 14, "qwen2": 14, "bert": 12}[family]  # every attention and MLP projection of 2 blocks
    inputs = batch(family)
    got, want = gradients(model, inputs), gradients(reference, inputs)
    adapters = n if family != "bert" else 4  # BERT: peft's default targets, query and value
    assert got.keys() == want.keys() and sum("lora_A" in k for k in got) == adapters
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-5, msg=name)
        assert g.abs().sum() > 0, name  # layer 0's adapters too: the input's gradient goes through the base


def test_quantized_layer_layouts_and_bytes():
    from xla_train.kernels.quant_xla import QuantLinear, base_bytes

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 256)
    bf16 = 512 * 256 * 2
    sizes = {}
    for kind, quant in QUANTS.items():
        layer = QuantLinear(linear, quant.kind, nested=quant.nested)
        assert [n for n, p in layer.named_parameters() if not p.requires_grad] == ["bias"]  # buffers, a frozen bias
        sizes[kind] = base_bytes(torch.nn.Sequential(layer)) / bf16
        # what the memory plan counts (projection_bytes), but for the per-tensor constant it leaves out:
        # the 16-entry code book (64 bytes)
        extra = base_bytes(torch.nn.Sequential(layer)) - projection_bytes(quant, 256, 512)
        assert extra == (0 if quant.bits == 8 else 64), extra
        w = layer.dequantize()
        assert w.shape == (256, 512) and layer.dequantize(torch.bfloat16).dtype == torch.bfloat16
        # int8: at most half a step of its row's scale; 4-bit: NF4's widest gap (0.30 of the block's absmax) / 2
        step = linear.weight.abs().amax() * (1 / 127 if kind == "int8" else 0.31) / 2
        assert (w - linear.weight).abs().max() <= step * 1.01, kind
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (256, 256)  # two codes a byte
    assert sizes["int8"] == pytest.approx(0.5039, abs=0.0001)  # 1 byte + a float32 scale a row
    assert sizes["nf4"] == pytest.approx(0.2815, abs=0.0001)  # 0.5 byte + a float32 scale per 64
    # the scales in int8 (QLoRA's 0.26x), with a row's mean and group scale in fp32: 8 bytes a row of 512
    assert sizes["nf4-nested"] == pytest.approx(0.2659, abs=0.0001)


def test_bf16_rounds_the_dequantized_weight_once():
    """Under bf16 the weight a quantized layer computes with, forward and backward, is its float32
    dequantized weight rounded to bf16 once: no scale or code value rounded to bf16 before their product."""
    from xla_train.kernels.quant_xla import QuantLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 32, bias=False)
    x = torch.randn(4, 128)
    for kind, quant in QUANTS.items():
        layer = QuantLinear(linear, quant.kind, nested=quant.nested)
        w = layer.dequantize().to(torch.bfloat16)
        assert torch.equal(layer.dequantize(torch.bfloat16), w), kind
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(inputs)
        y.backward(torch.ones_like(y))
        assert torch.equal(y, torch.nn.functional.linear(x.bfloat16(), w)), kind
        assert torch.equal(inputs.grad, (torch.ones_like(y) @ w).float()), kind


def test_saved_adapter_is_plain_lora_and_merge_is_refused(tmp_path):
    model, reference, _ = pair("llama", QUANTS["nf4"])
    assert _adapter_keys(model, tmp_path / "quant") == _adapter_keys(reference, tmp_path / "plain")
    with pytest.raises(UserError, match="merge it onto the full-precision base"):
        model.merge_and_unload()


def test_bf16_base_leaves_the_quantized_buffers():
    from xla_train.models import hold_frozen_in_bf16

    model, _, _ = pair("qwen2", QUANTS["int8"])
    before = {n: b.dtype for n, b in model.named_buffers() if "qweight" in n or "scales" in n}
    hold_frozen_in_bf16(model)
    assert before and {n: b.dtype for n, b in model.named_buffers() if n in before} == before
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("base_layer.bias")} == {torch.bfloat16}


def test_nothing_to_quantize_and_fp4_are_one_line():
    from xla_train.kernels.quant_xla import quantize_base

    with pytest.raises(UserError, match=r"^`load_in_8bit`: gpt2 has no linear projections"):
        quantize_base(_gpt2(), QUANTS["int8"])  # GPT-2's projections are Conv1D
    with pytest.raises(UserError, match="fp4 runs on the cuda and cpu backends"):
        quantize_base(_base("llama"), Quant(4, "fp4"))


def _gpt2():
    import tiny_decoders as td
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(td.config("gpt2", 40, bos=1, eos=2))


# On XLA:CPU, in one process of its own (compilation counters start empty): the gradients against
# the reference, both on the device, for a few pairs (each graph costs seconds to compile here);
# then 3 training steps of plain LoRA and of LoRA over each quantized base, each counted alone.
XLA_PAIRS = (("llama", "int8"), ("llama", "nf4"), ("qwen2", "nf4-nested"))
XLA_SCRIPT = """
import json, sys, torch, torch_xla
import torch_xla.debug.metrics as met
sys.path.insert(0, sys.argv[1])
from test_quant_xla import QUANTS, XLA_PAIRS, batch, gradients, pair, _base, _with_lora
dev = torch_xla.device()
out = {"grads": {}, "zero": {}, "steps": {}}
for family, kind in XLA_PAIRS:
    model, reference, _ = pair(family, QUANTS[kind])
    inputs = {k: v.to(dev) for k, v in batch(family).items()}
    got = gradients(model.to(dev), inputs)
    torch_xla.sync()  # every gradient in one graph (a tensor read alone would compile its own)
    want = gradients(reference.to(dev), inputs)
    torch_xla.sync()
    got, want = ({k: g.cpu() for k, g in grads.items()} for grads in (got, want))
    out["grads"][f"{family}-{kind}"] = max((got[k] - want[k]).abs().max().item() for k in got)
    out["zero"][f"{family}-{kind}"] = sum(int(g.abs().sum().item() == 0) for g in got.values())
# one-hot inputs read an int8 layer's dequantized weight back through torch_xla's quantized matmul
# under bf16 autocast: rounded to bf16 once, the scale applied in float32
from xla_train.kernels.quant_xla import QuantLinear
layer = QuantLinear(torch.nn.Linear(64, 32, bias=False), "int8")
want = layer.dequantize().T.to(torch.bfloat16)
with torch.autocast("xla", dtype=torch.bfloat16):
    read = layer.to(dev)(torch.eye(64, device=dev)).cpu()
out["read_back"] = int((read != want).sum())
for kind in ("plain", "int8", "nf4"):
    model = pair("llama", QUANTS[kind])[0] if kind != "plain" else _with_lora(_base("llama"), "llama")
    model = model.to(dev).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = {k: v.to(dev) for k, v in batch("llama").items() if k != "attention_mask"}  # its .all(): a host sync
    torch_xla.sync()
    met.clear_all()
    for _ in range(3):
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    out["steps"][kind] = {"compiles": (met.metric_data("CompileTime") or [0])[0],
                          "transfers": (met.metric_data("TransferFromDeviceTime") or [0])[0],
                          "aten": sorted(c for c in met.counter_names() if c.startswith("aten::"))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def on_xla():
    proc = run_python(["-c", XLA_SCRIPT, HERE], {**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_adapter_gets_the_reference_gradient_on_xla(on_xla):
    assert len(on_xla["grads"]) == len(XLA_PAIRS)
    assert all(v <= 1e-5 for v in on_xla["grads"].values()), on_xla["grads"]
    assert not any(on_xla["zero"].values()), on_xla["zero"]  # no adapter without a gradient
    assert on_xla["read_back"] == 0, on_xla["read_back"]  # the int8 matmul's weight rounded to bf16 once


def test_quantized_steps_on_xla_are_as_clean_as_plain_lora(on_xla):
    steps = on_xla["steps"]
    plain = steps["plain"]
    for kind in ("int8", "nf4"):
        assert steps[kind]["aten"] == [] and plain["aten"] == [], steps
        assert steps[kind]["compiles"] <= plain["compiles"] + 1, steps
        assert steps[kind]["transfers"] <= plain["transfers"], steps


def test_xla_run_over_a_4bit_base_trains_saves_and_predicts_on_a_base_quantized_again(mrpc_slice, tiny_model,
                                                                                       tmp_path):
    """The job's wiring (--backend xla --lora --load-in-4bit --use-bnb-nested-quant) on the tiny BERT:
    its 12 projections quantized, no fallback, no more host syncs than plain LoRA's run of these rows
    (1 in 8 steps, measured); the adapter folder records the quantization as transformers records a
    bitsandbytes base's, and `xla-train predict` on the CPU quantizes the base again from it
    (bitsandbytes' NF4: the same blocks of 64, the same code book) and scores the dev rows as the
    run did."""
    from conftest import run_cli
    from test_lora import _dev_accuracy

    from xla_train.models import holds_quantized_base, load_trained
    from xla_train.tasks.sequence import _classifier

    out = tmp_path / "out"
    proc, m = run_cli(["--backend", "xla", "--lora", "--load-in-4bit", "--use-bnb-nested-quant", "--lr", 1e-2,
                       "--model", tiny_model, "--data-dir", mrpc_slice, "--max-steps", 8, "--buckets", "64,128",
                       "--output-dir", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--load-in-4bit: 12 linear projections of the base held in nf4" in proc.stdout
    assert m["xla"]["aten_fallbacks"] == 0 and m["xla"]["host_syncs_per_step"] <= 1 / 8, m["xla"]
    record = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (record["load_in_4bit"], record["bnb_4bit_quant_type"], record["bnb_4bit_use_double_quant"]) == \
        (True, "nf4", True)
    assert holds_quantized_base(load_trained(_classifier(), out, "cpu"))  # bitsandbytes' layers
    on_xla = load_trained(_classifier(), out, "xla")  # predict --backend xla: QuantLinear under peft's layer
    assert sum(type(m).__name__ == "QuantLoraLinear" for m in on_xla.modules()) == 4  # BERT's query, value x 2
    accuracy, rows = _dev_accuracy(out, mrpc_slice, tmp_path)
    assert rows == 48 and accuracy == pytest.approx(m["eval"]["accuracy"], abs=2 / 48)


# --strategy fsdp (FSDPv2) on 4 XLA:CPU devices, alone (fsdp=4) and with --tensor-parallel 2 (fsdp=2 x
# tensor=2): the quantized buffers split with their rows over every device, three AdamW steps giving
# the CPU reference's losses. Each XLA run before the CPU's (a backward on the CPU first leaves torch's
# autograd engine without a queue for the XLA device: an internal assert).
FSDP_SCRIPT = """
import json, sys, torch, torch_xla
sys.path.insert(0, sys.argv[1])
from xla_train import Mesh
from xla_train.core.engine import Engine
from test_quant_xla import QUANTS, batch, pair

def train(model, engine=None):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    device, specs = "cpu", {}
    if engine:
        model, optimizer = engine.prepare(model, optimizer)
        device = engine.device
        specs = {name.split(".")[-1]: torch_xla._XLAC._get_xla_sharding_spec(b) for name, b in model.named_buffers()
                 if name.endswith((".qweight", ".scales", ".code"))}
    inputs, losses = {k: v.to(device) for k, v in batch("llama").items()}, []
    for _ in range(3):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if engine:
            torch_xla.sync()
        losses.append(loss.item())
    return {"losses": losses, "specs": specs}

out = {f"tensor{n}": train(pair("llama", QUANTS["nf4-nested"])[0].train(), Engine("xla", strategy="fsdp",
                                                                                  mesh=Mesh(tensor=n)))
       for n in (1, 2)}
out["cpu"] = train(pair("llama", QUANTS["nf4-nested"])[1].train())
print(json.dumps(out))
"""


def test_fsdp_and_tensor_parallel_split_the_quantized_buffers_with_their_rows():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = run_python(["-c", FSDP_SCRIPT, HERE], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    every_device = {"qweight": "{devices=[4,1]0,1,2,3}", "scales": "{devices=[4,1]0,1,2,3}", "code": ""}
    assert out["tensor1"]["specs"] == every_device, out  # fsdp=4
    assert out["tensor2"]["specs"] == every_device, out  # fsdp=2 x tensor=2: over tensor too
    for mesh in ("tensor1", "tensor2"):
        torch.testing.assert_close(out[mesh]["losses"], out["cpu"]["losses"], atol=1e-5, rtol=0, msg=mesh)
    assert out["cpu"]["losses"][-1] < out["cpu"]["losses"][0]  # the adapters trained


def test_dpo_over_a_4bit_base_on_xla_takes_the_base_without_the_adapter_as_its_reference(tmp_path):
    """--problem dpo --lora --load-in-4bit on XLA:CPU (QuantLinear under peft's layers): at the first
    step the adapters are zero, so the rewards (policy against reference) are 0 only if the reference
    pass is the same quantized base with the adapter switched off; then they move; no aten fallback,
    only the adapters train, the folder is the adapter (nothing merged)."""
    import tiny_decoders as td
    from conftest import run_cli
    from test_dpo import pairs

    model = td.save("llama", tmp_path / "llama", chat=True, letters=True)
    proc, m = run_cli(["--backend", "xla", "--problem", "dpo", "--model", model, "--lora", "--load-in-4bit",
                       "--lora-dropout", 0, "--train-file", td.write_jsonl(tmp_path / "p.jsonl", pairs(48, 1)),
                       "--validation-file", td.write_jsonl(tmp_path / "d.jsonl", pairs(8, 2)), "--max-length", 32,
                       "--buckets", 32, "--batch-size", 16, "--lr", 3e-3, "--max-steps", 3, "--log-every", 1,
                       "--no-data-cache", "--output-dir", tmp_path / "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--load-in-4bit: 14 linear projections of the base held in nf4" in proc.stdout
    steps = [metrics for _, metrics in m["train_metrics"]]
    assert abs(steps[0]["rewards/chosen"]) < 1e-6 and abs(steps[0]["rewards/rejected"]) < 1e-6, steps[0]
    assert any(abs(s["rewards/chosen"]) > 1e-4 for s in steps[1:]), steps
    assert m["xla"]["aten_fallbacks"] == 0 and m["trainable_params"] < m["total_params"] / 10, m["xla"]
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "out" / "model.safetensors").exists()
