"""Mixture-of-experts layers with static shapes (xla_train/kernels/experts.py, issue 51).

The tiny Qwen3-MoE, Mixtral and gpt-oss decoders of the zoo (tiny_decoders.EXPERTS: 4 experts, 2
per token) with `static_experts`' dense experts compute what transformers' eager experts compute,
within 1e-5 in fp32: the logits and the gradient of every parameter (on the CPU, in pytest's own
process). On XLA:CPU (in pytest's own process too, its runtime started after collection:
conftest.start_xla_in_process) three training steps of one shape with different tokens, hence
different routings, compile one graph, none after the first step, fall back to aten for nothing and
copy nothing to the host; the first step's logits and gradients equal eager's on the CPU within 1e-5.
(transformers' own implementations on XLA, measured: eager 19 graphs in the first step, 6 more in each
later one, 42 to 58 host transfers a step; grouped_mm fails, "histogram_cpu" not implemented for 'Int'.)

The TPU's grouped experts (`xla_grouped`, kernels/megablox.py): jax's megablox kernels run in TPU
interpret mode with the arguments torch_xla's wrappers pass (tests/megablox_interpret.py), each
family's experts and a whole gpt-oss within 1e-4 of eager; the tiling rule against jax's kernels
lowered for a TPU; the sharding around the kernel on 4 XLA:CPU devices (a torch grouped matmul in
the kernel's place, which XLA:CPU cannot run); the active experts in MFU and the memory plan.
"""

import copy

import pytest
import tiny_decoders as td
import torch
from conftest import run_python

from xla_train.kernels.experts import XLA_EXPERTS, has_experts, static_experts

VOCAB, ROWS, LENGTH, STEPS = 40, 2, 16, 3
ATOL = 1e-5


def tiny(family):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(td.config(family, VOCAB, bos=1, eos=2), dtype=torch.float32).train()


def batch(step):
    """Random tokens (so a routing) of step `step`, one shape for every step."""
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


def step(model, inputs):
    """Forward with labels and backward: (logits, {name: gradient})."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same(got, ref):
    logits, grads = got
    torch.testing.assert_close(logits.cpu(), ref[0], atol=ATOL, rtol=0)
    assert grads.keys() == ref[1].keys()
    for name, g in ref[1].items():
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name].cpu(), g, atol=ATOL, rtol=0, msg=name)


def eager_reference(model, inputs):
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return step(ref, inputs)


@pytest.mark.parametrize("family", td.EXPERTS)
def test_dense_experts_equal_eager_on_cpu(family):
    model = tiny(family)
    assert has_experts(model)
    ref = eager_reference(model, batch(0))
    assert static_experts(model)
    assert model.config._experts_implementation == XLA_EXPERTS
    assert XLA_EXPERTS not in model.config.to_json_string()  # a saved model's config.json does not name it
    assert_same(step(model, batch(0)), ref)
    assert not static_experts(model)  # set once


def test_static_experts_leaves_other_models_alone():
    model = tiny("llama")
    assert not has_experts(model) and not static_experts(model)
    assert not static_experts(torch.nn.Linear(2, 2))


@pytest.mark.xla
@pytest.mark.xla_in_process
@pytest.mark.slow
@pytest.mark.parametrize("family", td.EXPERTS)
def test_dense_experts_static_on_xla(family):
    import torch_xla
    import torch_xla.debug.metrics as met

    from xla_train.core.xla import XlaAccelerator

    model = tiny(family)
    ref = eager_reference(model, batch(0))
    assert static_experts(model)
    model = XlaAccelerator().adapt_model(model)  # the XLA attention, as Engine.prepare gives it
    device = torch_xla.device()
    model.to(device)
    met.clear_all()

    def counters():
        data = met.metric_data("CompileTime")
        moved = met.metric_data("TransferFromDeviceTime")
        return (data[0] if data else 0, moved[0] if moved else 0,
                {c: met.counter_value(c) for c in met.counter_names() if c.startswith("aten::")})

    compiles, first = [], None
    for s in range(STEPS):
        before = counters()[0]
        got = step(model, {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch(s).items()})
        torch_xla.sync()
        compiles.append(counters()[0] - before)
        if s == 0:
            first = got
    total, transfers, fallbacks = counters()
    assert total <= 3 and compiles[1:] == [0] * (STEPS - 1), compiles  # measured: [1, 0, 0]
    assert fallbacks == {}, fallbacks
    assert transfers / STEPS <= 0.15, transfers  # measured: 0
    assert_same(first, ref)


@pytest.mark.xla
@pytest.mark.xla_in_process
@pytest.mark.slow
def test_xla_accelerator_sets_static_experts():
    from xla_train.core.xla import XlaAccelerator

    for family in td.EXPERTS:
        model = XlaAccelerator().adapt_model(tiny(family))
        assert model.config._experts_implementation == XLA_EXPERTS, family


# --- the grouped matmul (kernels/megablox.py): torch_xla 2.9's megablox kernels, which only a TPU runs.
# Checked here against jax's own kernels: lowered for a TPU (Mosaic's block rules, jax's row-tile
# check) for the rule, and run in TPU interpret mode (tests/megablox_interpret.py) for the numbers.


def _lowers(m, k, n, groups, dtype):
    """Whether jax 0.7.1's kernels, lowered for a TPU (on this CPU), take the three calls the package
    makes for `m` sorted rows through `groups` experts' (k, n) weights, with its tiles as torch_xla's
    wrappers pass them: gmm forward, gmm on the weights transposed (the rows' gradient), tgmm (the
    weights')."""
    import importlib

    import jax
    import jax.numpy as jnp

    from xla_train.kernels.megablox import gmm_tiling

    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    S, dt = jax.ShapeDtypeStruct, getattr(jnp, dtype)
    (tm, tk, tn), (_, tk2, tn2) = gmm_tiling(m, k, n, groups), gmm_tiling(m, n, k, groups)
    calls = [(lambda a, b, s: mb.gmm(a, b, s, dt, (min(tm, m), tk, tn)), S((m, k), dt), S((groups, k, n), dt)),
             (lambda a, b, s: mb.gmm(a, b, s, dt, (min(tm, m), tk2, tn2), transpose_rhs=True), S((m, n), dt),
              S((groups, k, n), dt)),
             (lambda a, b, s: mb.tgmm(a, b, s, dt, (min(tm, m), min(tk, k), min(tn, n))), S((k, m), dt), S((m, n), dt))]
    for call, lhs, rhs in calls:
        try:
            jax.jit(call).trace(lhs, rhs, S((groups,), jnp.int32)).lower(lowering_platforms=("tpu",))
        except ValueError:  # jax's "must be divisible by x-dimension tile size", Mosaic's block-shape rule
            return False
    return True


def test_the_rows_handed_to_the_grouped_matmul_are_the_rows_it_takes():
    """The package's tiles are torch_xla 2.9's (`_get_tiling_size_for_gmm_kernel`), and its rule
    (`gmm_serves`) agrees with jax's kernels lowered for a TPU, rows served and refused, fp32 and bf16
    (Qwen3-30B-A3B's 128 experts 2,048 wide by 768; gpt-oss-20b's 32, 2,880 by 5,760; the zoo's 4)."""
    pytest.importorskip("jax")
    from torch_xla.experimental.custom_kernel import _get_tiling_size_for_gmm_kernel

    from xla_train.kernels.megablox import gmm_serves, gmm_tiling

    grid = [(m, k, n, g) for m in range(8, 8193, 8) for k, n, g in ((64, 48, 4), (2048, 1536, 128), (2880, 5760, 32))]
    assert all(gmm_tiling(*c) == _get_tiling_size_for_gmm_kernel(*c) for c in grid)
    cases = [(64, 64, 48, 4, "float32"), (200, 64, 48, 4, "float32"), (384, 64, 48, 4, "bfloat16"),
             (4096, 2048, 1536, 128, "bfloat16"), (640, 2880, 5760, 32, "float32"), (1088, 2880, 5760, 32, "float32")]
    assert [gmm_serves(*c[:4]) for c in cases] == [True, False, False, True, True, False]
    assert [_lowers(*c) for c in cases] == [gmm_serves(*c[:4]) for c in cases]


def _experts_of(model):
    return next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed"))


@pytest.mark.parametrize("family", td.EXPERTS)
def test_grouped_experts_equal_eager(family):
    """A family's experts through the grouped matmul (jax's kernels interpreted, with the arguments
    torch_xla's wrappers pass) against transformers' eager experts, with uneven routing and an
    expert no token picks: the output and the gradients of the tokens, the routing weights and every
    expert's weights (and biases: gpt-oss) within 1e-4 in fp32."""
    pytest.importorskip("jax")
    import megablox_interpret as MI

    from xla_train.kernels.experts import grouped_experts_forward

    experts = _experts_of(tiny(family))
    reference = copy.deepcopy(experts)
    reference.config._experts_implementation = "eager"
    tokens = 32  # 64 (token, expert) rows: one row tile
    torch.manual_seed(1)
    hidden = torch.randn(tokens, experts.gate_up_proj.size(1 if experts.is_transposed else 2))
    index = torch.tensor([[0, 1]] * 20 + [[1, 0]] * 8 + [[3, 1]] * 4)  # expert 2 empty; 28, 32, 0, 4 rows
    weights = torch.rand(tokens, 2)
    got, ref = [(h.clone().requires_grad_(), w.clone().requires_grad_()) for h, w in [(hidden, weights)] * 2]
    out = grouped_experts_forward(experts, *got[:1], index, got[1], kernels=MI.KERNELS)
    expected = reference(ref[0], index, ref[1])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(got[0].grad, ref[0].grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1].grad, ref[1].grad, atol=1e-4, rtol=0)
    for (name, p), q in zip(experts.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=0, msg=name)
    assert experts.down_proj.grad[2].abs().max() == 0  # the empty expert's gradient: zeros, written by tgmm


def test_grouped_experts_refused_rows_take_the_dense_path():
    """Rows the kernel refuses (200 tokens x 2 = 400, not a multiple of its 128-row tile) never reach
    it: the layer computes the dense path's numbers."""
    from xla_train.kernels.experts import dense_experts_forward, grouped_experts_forward
    from xla_train.kernels.megablox import Kernels

    def refused(*args, **kwargs):
        raise AssertionError("the kernel was handed rows it refuses")

    experts = _experts_of(tiny("qwen3moe"))
    hidden, index = torch.randn(200, 64), torch.randint(0, 4, (200, 2))
    weights = torch.rand(200, 2)
    torch.testing.assert_close(grouped_experts_forward(experts, hidden, index, weights, Kernels(refused, refused)),
                               dense_experts_forward(experts, hidden, index, weights))


def test_static_experts_grouped_where_asked():
    from xla_train.kernels.experts import XLA_GROUPED, experts_implementation

    model = tiny("gptoss")
    assert experts_implementation(model) == "grouped_mm"  # transformers' default for a model made without a choice
    assert static_experts(model, grouped=True)
    assert model.config._experts_implementation == XLA_GROUPED == experts_implementation(model)
    assert experts_implementation(tiny("llama")) is None


def test_call_jax_imports():
    """The dev extra (as the tpu extra) brings flax, which torch_xla 2.9's bundled torchax imports:
    torch_xla's call_jax, through which its Pallas wrappers run, finds torchax."""
    pytest.importorskip("jax")
    from torch_xla._internal.jax_workarounds import maybe_get_torchax
    from torch_xla.core.xla_builder import call_jax

    assert maybe_get_torchax() is not None and callable(call_jax)
    from xla_train.kernels.megablox import grouped_refusal

    assert "TPU only" in grouped_refusal()  # XLA:CPU here: the dense path stays (static_experts)


def test_mfu_and_the_memory_plan_count_the_active_experts():
    """MFU's FLOPs (core.peaks.flops_per_token) leave out the experts a token does not pass through:
    exactly (experts - top-k) / experts of the tiny families' experts' weights, and Mixtral-8x7B's
    published config comes to its published 12.9B active of 46.7B. The memory plan keeps every
    expert's activations for the dense path, the top-k's for the grouped one."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from xla_train.core.peaks import flops_per_token, inactive_expert_params
    from xla_train.kernels.experts import XLA_GROUPED
    from xla_train.memory import layer_bytes

    for family in td.EXPERTS:
        model = tiny(family)
        experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]
        weights = sum(p.numel() for m in experts for p in m.parameters())
        top_k = model.config.num_experts_per_tok
        assert inactive_expert_params(model.config) == weights * (4 - top_k) // 4, family
        total = sum(p.numel() for p in model.parameters())
        assert flops_per_token(model.config, total, 16) - flops_per_token(model.config, 0, 16) == 6 * (
            total - weights * (4 - top_k) // 4)
    configs = {}
    for family in td.EXPERTS:
        published = dict(td.ZOO[family]["config"])
        published.pop("quantization_config", None)
        configs[family] = config = CONFIG_MAPPING[published["model_type"]](**published)
        dense, grouped = (layer_bytes(config, 1, 2048, "bf16", experts=e) for e in (XLA_EXPERTS, XLA_GROUPED))
        assert dense > 2 * grouped, family  # Qwen3-30B-A3B's block: 128 experts' values a token, or 8's
    config = configs["mixtral"]
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert round(total / 1e9, 1) == 46.7 and round((total - inactive_expert_params(config)) / 1e9, 1) == 12.9


# The grouped matmul with torch ops in the kernel's place: XLA:CPU cannot run the Mosaic call, and
# the sharding around it (megablox.GroupedMatmul under SPMD) is what the script below checks.
SPMD = r"""
import copy, json, sys
import torch, torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
sys.path.insert(0, "tests")
import tiny_decoders as td
from transformers import AutoModelForCausalLM
from xla_train.kernels.experts import grouped_experts_forward
from xla_train.kernels.megablox import Kernels

xr.use_spmd()
seen = []


def group_of_rows(m, group_sizes):
    return (torch.arange(m, device=group_sizes.device)[:, None] >= group_sizes.cumsum(0)[None, :]).sum(1)


def gmm(lhs, rhs, group_sizes, tiling, group_offset=None, transpose_rhs=False):
    seen.append(list(lhs.shape))
    g = group_of_rows(lhs.size(0), group_sizes)
    w = rhs[g.clamp(max=rhs.size(0) - 1)]
    out = torch.einsum("mk,mnk->mn" if transpose_rhs else "mk,mkn->mn", lhs, w)
    return out * (g < rhs.size(0))[:, None]


def tgmm(lhs, rhs, group_sizes, tiling, group_offset=None):
    onehot = (group_of_rows(lhs.size(1), group_sizes)[:, None] == torch.arange(group_sizes.size(0), device=lhs.device))
    return torch.einsum("km,me,mn->ekn", lhs, onehot.to(lhs.dtype), rhs)


report = {}
mesh = xs.Mesh(list(range(4)), (2, 2), ("fsdp", "tensor"))
xs.set_global_mesh(mesh)
device = torch_xla.device()
for family in td.EXPERTS:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(td.config(family, 40, bos=1, eos=2), dtype=torch.float32)
    experts = next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed"))
    reference = copy.deepcopy(experts)
    reference.config._experts_implementation = "eager"
    hidden = torch.randn(32, experts.down_proj.size(1 if not experts.is_transposed else 2))
    index = torch.randint(0, 4, (32, 2), generator=torch.Generator().manual_seed(3))
    index[:, 1] = (index[:, 0] + 1 + index[:, 1] % 3) % 4  # two different experts a token
    weights = torch.rand(32, 2)
    expected = reference(hidden, index, weights)
    expected.square().sum().backward()
    experts.to(device)
    for p in experts.parameters():  # FSDPv2's layout: the experts split over fsdp
        xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
    x = hidden.to(device)
    xs.mark_sharding(x, mesh, ("fsdp", None))  # the tokens split by rows, as the strategy splits them
    seen.clear()
    out = grouped_experts_forward(experts, x, index.to(device), weights.to(device), kernels=Kernels(gmm, tgmm))
    out.square().sum().backward()
    torch_xla.sync()
    report[family] = {"out": (out.cpu() - expected.detach()).abs().max().item(), "seen": seen[:2],
                      "grads": max(((p.grad.cpu() - q.grad).abs().max() / q.grad.abs().max()).item()
                                   for p, q in zip(experts.parameters(), reference.parameters()))}
print(json.dumps(report))
"""


def test_grouped_experts_under_spmd_split_the_tokens_by_device():
    """On 4 XLA:CPU devices (fsdp 2 x tensor 2, the experts' weights split over fsdp, the tokens by
    rows): each device's kernel call gets its own 32 (token, expert) rows of the 32 tokens x top-2
    (torch_xla's manual sharding; 16 tokens a device along fsdp), and the output (within 1e-5) and
    every expert's gradient (within 1e-5 of its largest value) equal transformers' eager experts on
    the CPU, for each MoE family (a torch grouped matmul in the kernel's place)."""
    import json
    import os


    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "TOKENIZERS_PARALLELISM": "false"}
    proc = run_python(["-c", SPMD], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for family in td.EXPERTS:
        assert [rows for rows, _ in report[family]["seen"]] == [32, 32], report[family]  # of 64 in all
        assert report[family]["out"] < 1e-5 and report[family]["grads"] < 1e-5, (family, report[family])


def test_the_plan_names_the_experts_a_tpu_will_run(monkeypatch):
    """What the memory plan names (and counts) before the model is prepared: on a TPU that runs the
    kernel (grouped_refusal None: only a TPU says so, faked here) the grouped matmul, or the dense
    path where the kernel refuses the step's rows; XLA elsewhere dense; CUDA and the CPU
    transformers' own."""
    from xla_train.kernels import experts as X

    model = tiny("gptoss")
    assert X.planned_experts(model, "xla-tpu", 32) == X.XLA_EXPERTS  # XLA:CPU here: no kernel
    assert X.planned_experts(model, "cpu", 32) == X.planned_experts(model, "cuda", 32) == "grouped_mm"
    monkeypatch.setattr(X, "grouped_refusal", lambda: None)
    assert X.planned_experts(model, "xla-tpu", 32) == X.XLA_GROUPED  # 64 rows: one tile
    assert X.planned_experts(model, "xla-tpu", 100) == X.XLA_EXPERTS  # 200 rows: not a multiple of 128
    from xla_train.memory import describe, plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.base import PassInputs

    step = PassInputs("sdpa", rows=2, length=16, experts=X.planned_experts(model, "xla-tpu", 32))
    memory = plan(Mesh(), step, shape_of(model))
    assert memory.step.experts == X.XLA_GROUPED and ", experts xla_grouped," in describe(memory)
    assert X.static_experts(model) and model.config._experts_implementation == X.XLA_GROUPED


def test_a_whole_model_through_the_grouped_experts_equals_eager():
    """gpt-oss (biases, the clamped gate, sinks, a router whose gradient comes through the routing
    weights) whole, its experts through the grouped matmul (jax's kernels interpreted): the logits
    and the gradient of every parameter, the routers' too, within 1e-4 of transformers' eager experts."""
    pytest.importorskip("jax")
    import functools

    import megablox_interpret as MI
    from transformers.integrations.moe import ExpertsInterface

    from xla_train.kernels.experts import grouped_experts_forward

    model = tiny("gptoss")
    ref = eager_reference(model, batch(0))
    from xla_train.kernels.megablox import Kernels

    calls = []

    def counted(kernel):
        return lambda *args, **kwargs: calls.append(kernel.__name__) or kernel(*args, **kwargs)

    kernels = Kernels(counted(MI.gmm), counted(MI.tgmm))
    ExpertsInterface.register("interpreted_grouped", functools.partial(grouped_experts_forward, kernels=kernels))
    model.set_experts_implementation("interpreted_grouped")
    logits, grads = step(model, batch(0))
    assert sorted(calls) == ["gmm"] * 8 + ["tgmm"] * 4  # 2 layers: 2 projections forward, 2 x 2 backward
    torch.testing.assert_close(logits, ref[0], atol=1e-4, rtol=0)
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name], g, atol=1e-4, rtol=0, msg=name)
