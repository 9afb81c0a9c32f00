"""Mixture-of-experts layers with static shapes (xla_train/core/experts.py, issue 51).

The tiny Qwen3-MoE, Mixtral and gpt-oss decoders of the zoo (tiny_decoders.EXPERTS: 4 experts, 2
per token) with `static_experts`' dense experts compute what transformers' eager experts compute,
within 1e-5 in fp32: the logits and the gradient of every parameter (on the CPU, in pytest's own
process). On XLA:CPU (in pytest's own process too, its runtime started after collection:
conftest.start_xla_in_process) three training steps of one shape with different tokens, hence
different routings, compile one graph, none after the first step, fall back to aten for nothing and
copy nothing to the host; the first step's logits and gradients equal eager's on the CPU within 1e-5.
(transformers' own implementations on XLA, measured: eager 19 graphs in the first step, 6 more in each
later one, 42 to 58 host transfers a step; grouped_mm fails, "histogram_cpu" not implemented for 'Int'.)
"""

import copy

import pytest
import tiny_decoders as td
import torch

from xla_train.core.experts import XLA_EXPERTS, has_experts, static_experts

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
