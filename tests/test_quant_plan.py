"""The memory plan of LoRA over a quantized base (--load-in-8bit, --load-in-4bit): each projection's
bytes are bitsandbytes' own, counted the same before quantization and after; the base falls to
about 0.5x (int8) and 0.26-0.28x (4-bit) of bf16's; and the commands of benchmarks/plan_quant.py
(Llama 3.1 8B on a Colab v5e-1 and a 24 GB GPU, 70B on a v5e-8 and a v6e-8) fit by the plan,
where the same runs over a bf16 base do not fit a v5e-1 (8B) or a v5e-8 (70B). In-process."""

import json
import sys

import pytest
import torch
from conftest import ROOT

from xla_train.kernels.quant import Quant, projection_bytes
from xla_train.memory import GIB, describe, shape_of

sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_quant  # noqa: E402  (benchmarks/ is no package)

INT8, NF4, NF4_NESTED = Quant(8, "int8"), Quant(4, "nf4"), Quant(4, "nf4", nested=True)


def _bnb_bytes(module):
    """The bytes bitsandbytes keeps for a quantized linear: its packed weight and its scales
    (Int8Params.SCB; Params4bit.quant_state.absmax, and the nested absmax's own fp32 absmax)."""
    w = module.weight
    if hasattr(w, "SCB"):
        scales = w.SCB.numel() * w.SCB.element_size()
    else:
        state = w.quant_state
        scales = state.absmax.numel() * state.absmax.element_size()
        scales += state.state2.absmax.numel() * state.state2.absmax.element_size() if state.nested else 0
    return w.numel() * w.element_size() + scales


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny Llama (Llama 3's proportions, 128 wide, an untied head) saved as a checkpoint."""
    from tiny_decoders import config
    from transformers import AutoModelForCausalLM

    cfg = config("llama", 1000, size=128, layers=2)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("quant", [INT8, NF4, NF4_NESTED], ids=["int8", "nf4", "nf4-nested"])
def test_the_plan_counts_what_bitsandbytes_keeps(tiny_llama, quant):
    """transformers loads the tiny Llama through BitsAndBytesConfig on the CPU (bitsandbytes' CPU
    backend), peft adds its LoRA layers: every quantized projection's bytes (weight and scales) are
    projection_bytes (nested: at most 8 bytes a row fewer, the XLA path's row-wise nesting being what
    the plan counts), and the plan counts the same base whether it reads the full-precision model
    or the quantized one (Linear8bitLt, Linear4bit, under peft's layers; the XLA path's QuantLinear,
    whose buffers are the plan's bytes but for its code books)."""
    from bitsandbytes.nn import Linear4bit, Linear8bitLt
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from xla_train.models import add_adapters
    from xla_train.options import TrainOptions

    bnb = (BitsAndBytesConfig(load_in_8bit=True) if quant.bits == 8 else
           BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant.kind,
                              bnb_4bit_use_double_quant=quant.nested))
    section = TrainOptions(lora=True).section("model")
    full = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_llama), section, "CAUSAL_LM")
    quantized = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=bnb, device_map="cpu")
    layers = [m for m in quantized.modules() if isinstance(m, (Linear8bitLt, Linear4bit))]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers; the head kept
    rows = 8 * quant.nested  # the XLA path's nested scales: an fp32 mean and group scale a row
    for m in layers:
        planned = projection_bytes(quant, m.out_features, m.in_features)
        assert _bnb_bytes(m) <= planned <= _bnb_bytes(m) + rows * m.out_features
        assert planned == _bnb_bytes(m) or quant.nested
    quantized = add_adapters(quantized, section, "CAUSAL_LM")
    before, after = shape_of(full, quant).weights, shape_of(quantized, quant).weights
    assert after.quantized == before.quantized == sum(projection_bytes(quant, m.out_features, m.in_features)
                                                      for m in layers)
    assert (after.quantized_params, after.tile, after.params) == (before.quantized_params, before.tile, before.params)
    assert before.tile == 512 * 128 and before.quantized_params == 2 * 128 * (128 + 32 + 32 + 128 + 3 * 512)
    # the XLA path's QuantLinear (kernels.quant_xla, the same layouts): the plan counts the same base
    from xla_train.kernels.quant_xla import base_bytes, quantize_base

    xla = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert quantize_base(xla, quant) == len(layers)
    assert base_bytes(xla) == before.quantized + 64 * len(layers) * (quant.bits == 4)  # + the 16-entry code books
    xla = shape_of(add_adapters(xla, section, "CAUSAL_LM"), quant).weights
    assert (xla.quantized, xla.quantized_params, xla.tile, xla.params, xla.total) == \
        (before.quantized, before.quantized_params, before.tile, before.params, before.total)


def test_the_base_falls_to_a_half_and_a_quarter_of_bf16():
    """Llama 3.1 8B's projections with their scales: int8 0.5x of bf16's (a scale a row of 4,096
    or 14,336 weights), 4-bit 0.281x (an fp32 scale a block of 64: 0.5625 bytes a weight), NF4
    with double quantization 0.259x (0.138 bits of scales a weight; bitsandbytes' 0.127)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plan_quant.published_config(plan_quant.L8))
    model.requires_grad_(False)  # the base LoRA freezes: only frozen projections are held quantized
    plain = shape_of(model).weights
    ratios = {}
    for quant in (INT8, NF4, NF4_NESTED):
        w = shape_of(model, quant).weights
        assert 6.9e9 < w.quantized_params < 7.0e9 and w.params == plain.params  # the 8B's 6.98B in projections
        assert w.total == plain.total - 4 * w.quantized_params + w.quantized  # the rest stays as it was: fp32
        ratios[quant] = w.quantized / (2 * w.quantized_params)
    assert ratios[INT8] == pytest.approx(0.5, abs=5e-4)  # 0.5004: 4 bytes a row of 4,096 or 14,336
    assert ratios[NF4] == pytest.approx(0.28125, abs=1e-6)
    # bitsandbytes' (0.5 + 1 / 64 + 4 / 64 / 256) / 2 = 0.2579, and the XLA path's row-wise nesting:
    # an fp32 mean and group scale a row of 4,096 or 14,336 weights, 0.0106 bits a weight more
    assert ratios[NF4_NESTED] == pytest.approx(0.2586, abs=1e-4)
    assert 8 * (2 * ratios[NF4_NESTED] - 0.5) == pytest.approx(0.138, abs=1e-3)  # bits of scales a weight


@pytest.fixture(scope="module")
def planned():
    """benchmarks/plan_quant.py's rows: each case and its plan."""
    return {(case[0], case[1]): (case, plan_quant.plan_case(case)) for case in plan_quant.CASES}


def test_every_command_fits_by_the_plan(planned):
    """Each command of benchmarks/plan_quant.py (docs/lora.md's QLoRA section) fits its devices,
    its base quantized as its flags say; the plan's line says so."""
    for (name, where), (case, memory) in planned.items():
        hbm = plan_quant.device_bytes(case[3])
        assert memory.total <= hbm, f"{name} on {where}: {memory.total / GIB:.2f} GiB"
        assert memory.quant is not None and memory.quantized > 0
        assert memory.dequantized == 2 * (28672 * 8192 if "70B" in name else 14336 * 4096)  # the MLP's, bf16
    memory = planned[("8B int8", "Colab v5e-1")][1]
    assert memory.params > 8e9 and memory.mesh.param_shards == 1 and memory.step.rows == 4
    assert "(of 8678.8 MiB; its int8 base 6661.2 MiB with the scales, one projection dequantized 112.0 MiB)" in \
        describe(memory)
    gpu = planned[("8B nf4 double-quantized", "24 GB GPU")][1]
    # FlexAttention, as a CUDA run's --attention auto takes it (gpu_fallback declares it, whichever
    # test imported gpu_fallback first)
    assert gpu.quant == NF4_NESTED and gpu.step.attention == "flex_attention"
    for key in (("70B 4-bit", "v5e-8"), ("70B int8", "v5e-8"), ("70B 4-bit", "v6e-8"), ("70B int8", "v6e-8")):
        assert planned[key][1].mesh.param_shards == 8  # --strategy fsdp over the 8 chips


def test_without_the_quantized_base_the_8b_and_the_70b_do_not_fit_a_v5e(planned):
    """The issue's point: over a bf16 base (--lora --precision bf16) Llama 3.1 8B fits no v5e chip
    even at one row of 1,024 tokens (its base alone is 14.96 GiB of the 16), nor the 70B a v5e-8
    (16.4 GiB of parameters a chip); quantized, both fit."""
    import dataclasses

    from xla_train.memory import plan_on_paper

    for key in (("8B int8", "Colab v5e-1"), ("70B 4-bit", "v5e-8"), ("70B int8", "v5e-8")):
        case, memory = planned[key]
        plain = plan_quant.plan_case(case, quantized=False)
        assert plain.quant is None and memory.total <= plan_quant.device_bytes(case[3]) < plain.total, key
        assert plain.weights > (16 * GIB if "70B" in key[0] else 14.9 * GIB)
    case = planned[("8B int8", "Colab v5e-1")][0]
    smallest = dataclasses.replace(plan_quant.unquantized(plan_quant.options(case[5])), batch_size=1, max_length=1024)
    assert plan_on_paper(smallest, plan_quant.published_config(plan_quant.L8), 1, 16 * GIB).total > 16 * GIB


def test_the_colab_notebook_runs_the_command_the_plan_checked():
    """notebooks/colab_tpu_llama8b_int8.ipynb trains with the 8B int8 case's command exactly."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "colab_tpu_llama8b_int8.ipynb", as_version=4)
    nbformat.validate(nb)
    (cell,) = [c for c in nb.cells if "train" in c.metadata.get("tags", [])]
    case = next(c for c in plan_quant.CASES if c[:2] == ("8B int8", "Colab v5e-1"))
    assert f"COMMAND = {case[5]!r}" in cell.source
    assert json.loads((ROOT / "notebooks" / "colab_tpu_llama8b_int8.ipynb").read_text())["metadata"]["accelerator"] == \
        "TPU"


def test_bench_quant_builds_commands_the_cli_takes():
    """benchmarks/bench_quant.py's arguments, and each variant's command line as the CLI's own
    parser and TrainOptions read it (the runs themselves: `python benchmarks/bench_quant.py`)."""
    import bench_quant

    from xla_train.commands.cli import build_parser, train_options

    args = bench_quant.parse(["--seeds", "0,1", "--variants", "bf16,int8,nf4-nested", "--backends", "xla"])
    assert (args.seeds, args.variants, args.backends) == ([0, 1], ["bf16", "int8", "nf4-nested"], ["xla"])
    with pytest.raises(SystemExit):
        bench_quant.parse(["--variants", "int3"])
    task = {"model": "llama", "train": "train.jsonl", "validation": "validation.jsonl"}
    for variant, quant in (("bf16", None), ("int8", INT8), ("nf4", NF4), ("nf4-nested", NF4_NESTED)):
        cmd = bench_quant.command(task, "xla", variant, 1, 5, "out", "m.json")
        assert cmd[1:3] == ["-m", "xla_train"]
        cfg = train_options(build_parser().parse_args(cmd[3:]))
        assert (cfg.quantization(), cfg.lora, cfg.precision, cfg.seed, cfg.max_steps) == (quant, True, "bf16", 1, 5)
