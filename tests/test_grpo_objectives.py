"""GRPO's newer objectives against TRL 1.16's own code, in this process, and the sampler shown
equal to the trainer.

The losses: `GroupObjective.policy_loss` beside TRL's `GRPOTrainer._compute_loss` itself, called
on a trainer made with `object.__new__` and given only the attributes that method reads (its
log-probabilities and entropies handed in where it would run the model): each new --loss-type,
both importance-sampling levels, the top-entropy mask, with and without beta; the value, the
gradient with respect to the log-probabilities (the rest of the chain, to the weights, is the
token log-probabilities' own, checked against TRL's model pass in test_grpo.py) and every metric
TRL logs. The sampler: a rollout's log-probabilities as the decode graph drew them against the
update's full forward pass, in fp32 on the CPU.
"""

import json
import math
import random
from types import SimpleNamespace

import pytest
import tiny_decoders as td
import torch
from conftest import ROOT

from xla_train.core.errors import UserError

REWARD = f"{ROOT / 'benchmarks' / 'grpo_rewards.py'}:reversed_letters"
NEW = {"sapo_temperature_neg": 1.05, "sapo_temperature_pos": 1.0, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
       "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "importance_sampling_level": "token",
       "top_entropy_quantile": 1.0, "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None}


def test_the_new_options_are_trls_with_its_defaults():
    """Each option under TRL's GRPOConfig name, with its default."""
    grpo_config = pytest.importorskip("trl.trainer.grpo_config")
    from dataclasses import fields

    from xla_train.tasks.grpo import LEVELS, LOSS_TYPES, GRPOOptions

    theirs = {f.name: f.default for f in fields(grpo_config.GRPOConfig)}
    ours = {f.name: f.default for f in fields(GRPOOptions)}
    for name, default in NEW.items():
        assert ours[name] == theirs[name] == default, name
    assert set(LOSS_TYPES) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    assert LEVELS == ("token", "sequence")


# (--loss-type, --importance-sampling-level, --top-entropy-quantile, --beta, --epsilon-high)
CASES = [("cispo", "token", 1.0, 0.0, 1.1), ("cispo", "sequence", 1.0, 0.04, 1.05),
         ("sapo", "token", 1.0, 0.0, None), ("sapo", "sequence", 0.5, 0.04, None),
         ("luspo", "sequence", 1.0, 0.0, None), ("luspo", "token", 1.0, 0.04, None),
         ("vespo", "token", 1.0, 0.0, None), ("vespo", "token", 0.3, 0.04, None),
         ("grpo", "sequence", 1.0, 0.0, 0.28), ("dapo", "token", 0.2, 0.0, 0.28), ("dapo", "token", 0.0, 0.04, None),
         ("bnpo", "sequence", 0.6, 0.0, None), ("dr_grpo", "token", 0.5, 0.04, None)]


def trl_loss(settings, logps, old, reference, entropies, mask, advantages):
    """TRL 1.16's GRPOTrainer._compute_loss on these numbers: the trainer made without __init__,
    with the attributes the method reads; one process (its accelerator's gather and reduce are
    the identity there), one micro-batch a step, no vLLM, no entropy bonus."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    args = SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=1,
                           **{k: getattr(settings, k) for k in NEW if k.startswith(("sapo", "vespo"))})
    one_process = SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t,
                                  pad_across_processes=lambda t, dim, pad_index: t)
    trainer.__dict__.update(
        args=args, accelerator=one_process, model=SimpleNamespace(training=True), loss_type=settings.loss_type,
        importance_sampling_level=settings.importance_sampling_level, beta=settings.beta,
        epsilon_low=settings.epsilon, epsilon_high=settings.upper, top_entropy_quantile=settings.top_entropy_quantile,
        off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        max_completion_length=mask.shape[1], current_gradient_accumulation_steps=1,
        _metrics={"train": __import__("collections").defaultdict(list)},
        # where the method runs the model: the given log-probabilities and entropies
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None))
    inputs = {"prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 1),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if settings.beta:
        inputs["ref_per_token_logps"] = reference
    loss = trainer._compute_loss(None, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type, level, quantile, beta, epsilon_high", CASES)
def test_each_loss_is_trls_on_the_same_numbers(loss_type, level, quantile, beta, epsilon_high):
    """The loss, its gradient and TRL's metrics (the clip ratios, cispo's, vespo's weight, kl):
    ratios well away from 1 on both sides, completions of different lengths and one without a
    token, advantages of both signs."""
    pytest.importorskip("trl")
    from xla_train.tasks.documents import IGNORE
    from xla_train.tasks.grpo import GroupObjective, GRPOOptions, Rollout

    settings = GRPOOptions(loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=quantile,
                           beta=beta, epsilon_high=epsilon_high, max_completion_length=7)
    generator = torch.Generator().manual_seed(len(loss_type) * 7 + int(quantile * 10) + (level == "sequence"))
    rows, length = 6, 7
    mask = torch.ones(rows, length)
    for row, end in enumerate([7, 3, 5, 1, 0, 6]):  # row 4: no completion token (all padding)
        mask[row, end:] = 0
    start = torch.randn(rows, length, generator=generator) * 0.2 - 1.5
    old = start + torch.randn(rows, length, generator=generator) * 0.3
    reference = start + torch.randn(rows, length, generator=generator) * 0.3
    entropies = torch.rand(rows, length, generator=generator) * 3
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, -0.1])
    logps = {side: start.clone().requires_grad_() for side in ("ours", "trls")}

    theirs, their_metrics = trl_loss(settings, logps["trls"], old, reference, entropies, mask, advantages)
    labels = torch.where(mask.bool(), 5, IGNORE)
    rollout = Rollout(labels, advantages, mask.sum(), None, None, None)
    ours, metrics = GroupObjective(settings=settings).policy_loss(logps["ours"], rollout, reference, old, entropies)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logps["ours"].grad, logps["trls"].grad, atol=1e-6, rtol=1e-5)
    assert logps["ours"].grad.abs().sum() > 0
    their_metrics.pop("entropy")  # GroupObjective.loss's, over the same tokens (test_grpo.py)
    assert set(metrics) == set(their_metrics)
    for key, value in their_metrics.items():
        assert float(metrics[key].detach()) == pytest.approx(value, abs=1e-6), key
    if quantile < 1:  # the mask left tokens out: the loss differs from the whole one
        whole = GRPOOptions(**{**settings.__dict__, "top_entropy_quantile": 1.0})
        assert not torch.isclose(GroupObjective(settings=whole).policy_loss(start, rollout, reference, old)[0], ours)


def test_the_high_entropy_mask_is_trls():
    """The static-shape quantile (no boolean indexing) picks TRL's tokens, at every quantile,
    and none where no token counts."""
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    from xla_train.tasks.grpo import high_entropy_mask

    trainer = object.__new__(GRPOTrainer)
    trainer.accelerator = SimpleNamespace(gather=lambda t: t, pad_across_processes=lambda t, dim, pad_index: t)
    entropies = torch.rand(5, 9, generator=torch.Generator().manual_seed(3)) * 4
    mask = (torch.rand(5, 9, generator=torch.Generator().manual_seed(4)) > 0.3).float()
    for threshold in (0.0, 0.1, 0.25, 0.5, 0.8, 0.95, 1.0):
        assert high_entropy_mask(entropies, mask, threshold).equal(
            trainer.get_high_entropy_mask(entropies, mask, threshold)), threshold
    assert not high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()


def test_odd_pairings_warn_and_unknown_choices_are_one_line(capsys):
    """TRL's three warnings, one line each, once per run; an unknown loss type or level: one line."""
    from xla_train.commands.cli import main
    from xla_train.tasks.grpo import GRPOOptions

    assert GRPOOptions().odd_pairings() == []
    assert "LUSPO paper takes --importance-sampling-level sequence" in GRPOOptions(loss_type="luspo").odd_pairings()[0]
    assert "keep --importance-sampling-level token" in GRPOOptions(
        loss_type="vespo", importance_sampling_level="sequence").odd_pairings()[0]
    for loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
        lines = GRPOOptions(loss_type=loss, importance_sampling_level="sequence").odd_pairings()
        assert len(lines) == 1 and f"--loss-type {loss} sums per-token terms" in lines[0]
    assert GRPOOptions(loss_type="grpo", importance_sampling_level="sequence").odd_pairings() == []
    for flag, value, message in [
        ("--loss-type", "gspo", "--loss-type must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo, "
                                "not 'gspo'"),
        ("--importance-sampling-level", "batch", "--importance-sampling-level must be one of token, sequence, "
                                                 "not 'batch'"),
        ("--top-entropy-quantile", "1.5", "--top-entropy-quantile must be in [0, 1], not 1.5"),
        ("--sapo-temperature-neg", "0", "--sapo-temperature-neg must be a positive number, not 0.0"),
    ]:
        assert main(["train", "--backend", "cpu", "--problem", "grpo", "--reward", REWARD, flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    with pytest.raises(UserError, match="--vespo-k-neg must be a number >= 0"):
        GRPOOptions(vespo_k_neg=-1.0).check()


# ---------------------------------------------------------------------------------------------
# The sampler is the trainer


def rollout_of(model, tokenizer, prompts, settings, precision="fp32", seed=0):
    """A training rollout of `prompts` (text, with an `answer` column) through Rollouts.rollout,
    and the update's inputs and rollout."""
    import datasets

    from xla_train.core.engine import Engine
    from xla_train.tasks.grpo import EXTRA, GroupObjective
    from xla_train.tasks.rewards import rewards_of

    objective = GroupObjective(settings=settings, rewards=rewards_of(REWARD, None))
    extra = [json.dumps({**row, "_where": f"row {i}"}) for i, row in enumerate(prompts)]
    data = {"train": datasets.Dataset.from_dict({EXTRA: extra})}
    source = objective.batch_source(Engine("cpu", precision), tokenizer, data, model, 1)
    ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = source.tokenizer.pad_token_id
    batch = {"input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
             "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]),
             "row": torch.arange(len(ids))}
    torch.manual_seed(seed)
    inputs = source(model, batch)
    return objective, inputs, inputs.pop("labels")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_samplers_log_probabilities_are_the_trainers(precision, tmp_path):
    """fp32 on the CPU: each completion token's log-probability as the decode graph drew it
    (the static loop's cached one-token steps) equals the update's full forward pass's to 1e-5,
    and the loss logs the comparison under TRL's names. (test_grpo.py's sliding-window run asserts
    it of a Gemma 3 whose rollouts run past its window's ring, and its XLA:CPU run on one device.)
    bf16 autocast: the two passes round differently, within the bounds measured (mean 0.0043, max
    0.017; 0.010 and 0.050 with the rollout in fp32, as it once ran: docs/grpo.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.grpo import GRPOOptions

    folder = td.save("llama", tmp_path / "llama", letters=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    rng = random.Random(0)
    prompts = [{"prompt": "reverse " + " ".join(letters) + " =", "answer": " ".join(reversed(letters))}
               for letters in (rng.sample(td.LETTERS, rng.randint(3, 5)) for _ in range(8))]
    settings = GRPOOptions(num_generations=4, max_completion_length=16, temperature=0.7)
    objective, inputs, rollout = rollout_of(model, tokenizer, prompts, settings, precision)
    mask = rollout.labels != -100
    assert mask.sum(1).min() > 0 and (mask.sum(1) < 16).any()  # some ended: their padding is left out
    assert rollout.sampled[~mask].abs().max() == 0 and (rollout.sampled[mask] < 0).all()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):  # as the trainer's step
        output = objective.forward(model, inputs)
        trained = objective.token_logps(output.head, rollout.labels, settings.temperature)
        objective.loss(output, rollout)
    difference = (trained.detach() - rollout.sampled)[mask].abs()
    logged = {k: float(v.detach()) for k, v in output.metrics.items() if k.startswith("sampling/")}
    print(precision, logged)
    assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(float(difference.max()), abs=1e-7)
    assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(float(difference.mean()), abs=1e-7)
    if precision == "fp32":
        assert difference.max() <= 1e-5, float(difference.max())
        for key in ("min", "mean", "max"):
            assert math.isclose(logged[f"sampling/importance_sampling_ratio/{key}"], 1.0, abs_tol=1e-4), logged
    else:
        assert 0 < difference.mean() <= 0.007 and difference.max() <= 0.03, logged
