"""The routers' load-balancing loss of a mixture of experts (xla_train/kernels/router_loss.py, issue 61).

The tiny Qwen3-MoE, Mixtral and gpt-oss of the zoo (tiny_decoders.EXPERTS), saved with
`output_router_logits=True` as fine-tuning recipes save them. transformers' own loss takes a 2-D
padding mask and fails on the package's 4-D document mask; the package turns it off at load and
computes it itself: transformers' `load_balancing_loss_func` over the real tokens of packed
documents (SFT), padded pairs (DPO) and rollouts (GRPO), weighted by the config's
`router_aux_loss_coef` (TRL 1.16's default; --router-aux-loss-coef another) and reported as
`aux_loss`. The reference is computed by hand: every document run alone through transformers with
`output_router_logits=True`, its routers' logits joined, the function given no mask. All in
pytest's own process, on the CPU; one family on XLA:CPU too.
"""

import pytest
import tiny_decoders as td
import torch

from xla_train.core.errors import UserError
from xla_train.kernels.router_loss import coefficient, loss_function
from xla_train.tasks.causal_lm import DecoderModel, NextToken
from xla_train.tasks.documents import IGNORE

VOCAB = 40
# two rows of 16 tokens: two documents each, the first row ending in padding (segment 0)
SEGMENTS = torch.tensor([[1] * 5 + [2] * 7 + [0] * 4, [1] * 9 + [2] * 7])
POSITIONS = torch.tensor([list(range(5)) + list(range(7)) + [0] * 4, list(range(9)) + list(range(7))])
IDS = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=td.EXPERTS)
def saved(request, tmp_path_factory):
    """(family, folder) of a tiny mixture of experts saved with output_router_logits=True."""
    from transformers import AutoModelForCausalLM

    config = td.config(request.param, VOCAB, bos=1, eos=2)
    config.output_router_logits = True
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return request.param, folder


def loaded(folder):
    return DecoderModel().load(str(folder), seed=0).train()


def inputs(segments=SEGMENTS):
    return {"input_ids": IDS, "position_ids": POSITIONS, "segments": segments}


def by_hand(model, segments=SEGMENTS):
    """transformers' load-balancing loss over the real tokens: each document (a segment of a row)
    run alone with output_router_logits=True, every layer's router logits joined, no mask."""
    logits = []
    with torch.no_grad():
        for row, ids in zip(segments, IDS):
            for doc in row.unique().tolist():
                if doc:
                    logits.append(model(input_ids=ids[row == doc][None], output_router_logits=True).router_logits)
    layers = tuple(torch.cat([doc[i] for doc in logits]) for i in range(len(logits[0])))
    config = model.config
    return loss_function(model)(layers, config.num_experts, config.num_experts_per_tok, None)


def router_grad(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if ".gate." in n or "router" in n])


def test_sft_adds_the_routers_loss_over_the_documents_real_tokens(saved):
    family, folder = saved
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(folder).train()  # transformers' own loss, on
    with pytest.raises(RuntimeError, match="must match the size"):  # it takes the 4-D mask for a padding mask
        NextToken(attention="mask").forward(own, inputs())
    model = loaded(folder)
    assert model.config.output_router_logits is False  # off at load: the package computes it
    labels = torch.where(SEGMENTS > 0, IDS, IGNORE)
    weight = {"qwen3moe": 0.001, "mixtral": 0.02, "gptoss": 0.9}[family]  # the published configs' own
    assert coefficient(model.config) == model.config.router_aux_loss_coef == weight

    objective = NextToken(attention="mask")
    output = objective.forward(model, inputs())
    expected = by_hand(model)
    assert output.router.weight == weight
    torch.testing.assert_close(output.router.value, expected, atol=1e-6, rtol=0)
    metrics = objective.step_metrics(output, labels)
    assert list(metrics) == ["aux_loss"] and not metrics["aux_loss"].requires_grad
    total, tokens = objective.token_losses(output, labels)
    lm = total.sum() / tokens.sum()  # the language model's loss alone
    loss = objective.loss(output, labels)
    torch.testing.assert_close(loss, lm + weight * expected, atol=1e-6, rtol=0)
    with_routers = router_grad(model, loss)

    off = NextToken(attention="mask", router_aux_loss_coef=0.0)  # --router-aux-loss-coef 0
    output = off.forward(model, inputs())
    assert getattr(output, "router", None) is None and off.step_metrics(output, labels) is None
    torch.testing.assert_close(off.loss(output, labels), lm, atol=1e-6, rtol=0)
    assert not torch.allclose(router_grad(model, off.loss(output, labels)), with_routers)  # the routers learn from it

    model.eval()  # evaluation: the language model's loss alone
    assert getattr(objective.forward(model, inputs()), "router", None) is None


def test_dpo_and_grpo_report_aux_loss_over_pairs_and_rollouts(saved):
    """DPO's pair (chosen segment 1, rejected 2, padding 0) and a GRPO rollout (segment 1 for the
    prompt and completion, 0 for left padding and after the end): `aux_loss` over their real tokens,
    added to each kind's loss with the weight asked for."""
    _, folder = saved
    from xla_train.tasks.dpo import PreferenceObjective
    from xla_train.tasks.grpo import GroupObjective, Rollout

    model = loaded(folder)
    labels = torch.where(SEGMENTS > 0, IDS, IGNORE)
    pair = {**inputs(), "ref_chosen": torch.tensor([-30.0, -40.0]), "ref_rejected": torch.tensor([-35.0, -38.0])}
    dpo = PreferenceObjective(attention="mask", router_aux_loss_coef=0.5)
    output = dpo.forward(model, dict(pair))
    loss = dpo.loss(output, labels)
    expected = by_hand(model)
    torch.testing.assert_close(dpo.step_metrics(output, labels)["aux_loss"], expected, atol=1e-6, rtol=0)
    plain = PreferenceObjective(attention="mask", router_aux_loss_coef=0.0)
    torch.testing.assert_close(loss, plain.loss(plain.forward(model, dict(pair)), labels) + 0.5 * expected,
                               atol=1e-5, rtol=0)

    rollout = torch.tensor([[0] * 3 + [1] * 10 + [0] * 3, [1] * 16])  # left-padded prompt; a completion that ended
    positions = (rollout.cumsum(1) - 1).clamp(min=0)
    completion = torch.where((rollout > 0) & (torch.arange(16) >= 8), IDS, IGNORE)
    batch = Rollout(completion, torch.tensor([0.5, -0.5]), (completion != IGNORE).sum().float(), None, None, None)
    grpo = GroupObjective(attention="mask", router_aux_loss_coef=0.25)
    output = grpo.forward(model, {"input_ids": IDS, "position_ids": positions, "segments": rollout})
    loss = grpo.loss(output, batch)
    expected = by_hand(model, rollout)
    torch.testing.assert_close(output.metrics["aux_loss"], expected, atol=1e-6, rtol=0)
    plain = GroupObjective(attention="mask", router_aux_loss_coef=0.0)
    unweighted = plain.loss(plain.forward(model, {"input_ids": IDS, "position_ids": positions, "segments": rollout}),
                            batch)
    torch.testing.assert_close(loss, unweighted + 0.25 * expected, atol=1e-6, rtol=0)


def test_a_saved_model_keeps_the_flag_it_was_loaded_with(saved, tmp_path):
    """The model's own loss is off while the package trains it, but the folder a run writes says
    output_router_logits as the model came (TRL's saved models keep it on where the loss was on):
    through Engine.save_pretrained, whole and as an adapter's base config."""
    import json
    import types

    from xla_train.core.engine import Engine
    from xla_train.models import add_adapters

    _, folder = saved
    tokenizer = td.tokenizer()
    engine = Engine("cpu")
    model = loaded(folder)
    engine.save_pretrained(model, tokenizer, tmp_path / "whole")
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["output_router_logits"] is True
    assert model.config.output_router_logits is False  # and off again for the package's forwards
    options = types.SimpleNamespace(lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_targets=None)
    adapted = add_adapters(loaded(folder), options, "CAUSAL_LM")
    engine.save_pretrained(adapted, tokenizer, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "config.json").read_text())["output_router_logits"] is True


def test_the_option_and_trls_rule():
    """TRL 1.16's rule: on for a config with output_router_logits (whatever its value), the
    config's weight unless another is asked for, 0 turning it off; a weight for a model without
    routers, a negative one, or one for a classifier are refused in one line."""
    from xla_train.options import TrainOptions

    moe, llama = td.config("mixtral", VOCAB), td.config("llama", VOCAB)
    assert moe.output_router_logits is False and coefficient(moe) == moe.router_aux_loss_coef > 0
    assert coefficient(moe, 0.3) == 0.3 and coefficient(moe, 0.0) == 0.0
    assert coefficient(llama) == coefficient(llama, 0.3) == 0.0
    DecoderModel(router_aux_loss_coef=0.0).check(llama, "tiny-llama")  # 0 asks for nothing
    with pytest.raises(UserError, match="is not a mixture of experts with router logits"):
        DecoderModel(router_aux_loss_coef=0.1).check(llama, "tiny-llama")
    with pytest.raises(UserError, match="--router-aux-loss-coef must be a number >= 0, not -1"):
        TrainOptions(router_aux_loss_coef=-1.0).validate()
    with pytest.raises(UserError, match="applies to --problem causal-lm, dpo or grpo"):
        TrainOptions(router_aux_loss_coef=0.1).validate()  # the default task: MRPC's classification


@pytest.mark.xla
@pytest.mark.xla_in_process
@pytest.mark.slow
def test_the_routers_loss_on_xla_adds_no_graph_break_nor_transfer(tmp_path):
    """On XLA:CPU (the experts static, as the XLA accelerator runs them): the same loss and
    `aux_loss` as on the CPU, nothing run on the host, nothing copied back before the read."""
    import torch_xla
    import torch_xla.debug.metrics as met
    from transformers import AutoModelForCausalLM

    from xla_train.core.xla import XlaAccelerator

    config = td.config("qwen3moe", VOCAB, bos=1, eos=2)
    config.output_router_logits = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    model = loaded(tmp_path)
    labels = torch.where(SEGMENTS > 0, IDS, IGNORE)
    objective = NextToken(attention="mask")
    output = objective.forward(model, inputs())
    cpu = (objective.loss(output, labels).detach(), output.router.value.detach())
    model = XlaAccelerator().adapt_model(model)
    device = torch_xla.device()
    model.to(device)
    met.clear_all()
    output = objective.forward(model, {k: v.to(device) for k, v in inputs().items()})
    loss = objective.loss(output, labels.to(device))
    loss.backward()
    aux = objective.step_metrics(output, labels)["aux_loss"]
    torch_xla.sync()
    assert met.metric_data("TransferFromDeviceTime") is None  # no host sync in the step
    assert not [c for c in met.counter_names() if c.startswith("aten::")]
    torch.testing.assert_close((loss.detach().cpu(), aux.cpu()), cpu, atol=1e-5, rtol=0)
