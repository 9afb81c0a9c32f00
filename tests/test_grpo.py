"""`--problem grpo`: rollouts inside the step, rewards called as TRL calls them, TRL's losses.

The task is the reversal task's (tiny_decoders): prompts `reverse c a b =` with an `answer` column
(`b a c`), a partial-credit reward (benchmarks/grpo_rewards.py: the share of the letters in place),
a 2-layer Llama first taught part of the task by SFT.
"""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import tiny_decoders as td
import torch
from conftest import ROOT, assert_same_weights, run_cli, stop_and_resume

from xla_train.commands.cli import main

REWARD = f"{ROOT / 'benchmarks' / 'grpo_rewards.py'}:reversed_letters"


def prompts(n, seed, conversational=False):
    """`n` prompts of the reversal task with their `answer` column (the letters reversed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letters = rng.sample(td.LETTERS, rng.randint(3, 5))
        prompt = "reverse " + " ".join(letters) + " ="
        rows.append({"prompt": [{"role": "user", "content": prompt}] if conversational else prompt,
                     "answer": " ".join(reversed(letters))})
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random 2-layer Llama over the task's words, and prompts (400 to train on, 64 held out)."""
    folder = tmp_path_factory.mktemp("grpo")
    return {"model": td.save("llama", folder / "llama", chat=True, letters=True), "folder": folder,
            "train": td.write_jsonl(folder / "train.jsonl", prompts(400, 1)),
            "validation": td.write_jsonl(folder / "validation.jsonl", prompts(64, 2))}


def grpo_args(model, task, *extra):
    return ["--backend", "cpu", "--problem", "grpo", "--model", model, "--train-file", task["train"],
            "--validation-file", task["validation"], "--reward", REWARD, "--num-generations", 8, "--batch-size", 32,
            "--max-completion-length", 8, "--max-length", 16, "--no-data-cache", *extra]


# ---------------------------------------------------------------------------------------------
# The loss, the advantages and the rollout's rows, against TRL


def _engine():
    from xla_train.core.engine import Engine

    return Engine("cpu")


def _rollout_rows(model, tokenizer, settings, prompts_ids, completions):
    """What a rollout makes of left-padded prompts and their completions (Rollouts.batch)."""
    from xla_train.tasks.grpo import GroupObjective, Rollouts

    objective = GroupObjective(settings=settings)
    data = {"train": None}
    source = Rollouts(objective, _engine(), tokenizer, data, model, initial=lambda: model)  # (no reference pass here)
    length = max(len(p) for p in prompts_ids)
    pad = source.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts_ids])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts_ids])
    n = len(prompts_ids)
    scored = (torch.zeros(n), torch.zeros(0), torch.zeros(n), torch.zeros(n, 0))
    return objective, source.batch(ids, mask, completions, scored, training=True), ids, mask


CASES = [("grpo", 0.0, 1.0), ("dr_grpo", 0.0, 1.0), ("dapo", 0.0, 1.0), ("bnpo", 0.0, 1.0), ("dapo", 0.04, 1.0),
         ("grpo", 0.04, 0.7)]  # (--loss-type, --beta, --temperature)

TRL_REFERENCE = """
import sys, torch, datasets
from transformers import AutoModelForCausalLM, AutoTokenizer
import trl
from trl import GRPOConfig, GRPOTrainer
model_dir, inputs_path, out_path, work = sys.argv[1:5]
saved = torch.load(inputs_path)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
results = {"version": trl.__version__}
for loss_type, beta, temperature in saved["cases"]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(output_dir=work, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                        loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, report_to="none", bf16=False,
                        use_cpu=True, temperature=temperature)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                          train_dataset=datasets.Dataset.from_list(saved["rows"]), processing_class=tokenizer)
    inputs = {k: saved[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                                    "old_per_token_logps", "num_items_in_batch")}
    if beta:
        inputs["ref_per_token_logps"] = saved["ref_per_token_logps"]
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # as Trainer.training_step sets it, one micro-batch a step
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    results[(loss_type, beta, temperature)] = {"loss": loss.detach(),
                                               "grads": [p.grad.clone() for p in model.parameters()],
                                               "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()}}
torch.save(results, out_path)
"""


@pytest.fixture(scope="module")
def trl_reference(base, tmp_path_factory):
    """TRL 1.16's GRPOTrainer._compute_loss on a rollout's completions of the tiny model, each
    --loss-type (and beta 0.04, and a sampling temperature of 0.7), in a process of its own
    (accelerate would put the model on XLA in this one): the inputs, and per case the loss,
    gradients and metrics."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("trl-loss")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base["model"])
    eos = tokenizer.eos_token_id
    prompts_ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts(4, 5)]
    completions = torch.randint(5, len(tokenizer), (4, 6))
    completions[0, 2:] = eos  # ends early: the rest is padding
    completions[1, 5] = eos
    length = max(len(p) for p in prompts_ids)
    ids = torch.tensor([[eos] * (length - len(p)) + p for p in prompts_ids])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts_ids])
    ended = (completions == eos).long()
    completion_mask = ((ended.cumsum(1) - ended) == 0).long()
    saved = {"cases": CASES, "rows": prompts(4, 5), "prompt_ids": ids, "prompt_mask": mask,
             "completion_ids": completions, "completion_mask": completion_mask,
             "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
             "old_per_token_logps": torch.randn(4, 6) * 0.3 - 2.0,  # ratios far from 1 on both sides
             "ref_per_token_logps": torch.randn(4, 6) * 0.3 - 2.0, "num_items_in_batch": completion_mask.sum().float()}
    torch.save(saved, work / "inputs.pt")
    script = work / "reference.py"
    script.write_text(TRL_REFERENCE)
    proc = subprocess.run([sys.executable, str(script), str(base["model"]), str(work / "inputs.pt"),
                           str(work / "out.pt"), str(work / "trl")], capture_output=True, text=True,
                          env={**os.environ, "USE_TORCH_XLA": "0", "TOKENIZERS_PARALLELISM": "false"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return saved, torch.load(work / "out.pt", weights_only=False)


@pytest.mark.parametrize("loss_type, beta, temperature", CASES)
def test_the_loss_is_trls(base, trl_reference, loss_type, beta, temperature):
    """The loss of a rollout's completions as TRL 1.16's GRPOTrainer._compute_loss computes it, on
    the same model, tokens, advantages and old log-probabilities (ratios away from 1, some clipped):
    each --loss-type's value and gradients, the clip ratios, the entropy, with beta the KL term and
    with a temperature the log-probabilities of the logits divided by it, as TRL's are. The rows
    are the rollout's own (Rollouts.batch: left-padded prompts, completions, padding after the end)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.grpo import GroupObjective, GRPOOptions

    saved, reference = trl_reference
    theirs = reference[(loss_type, beta, temperature)]
    assert reference["version"].startswith("1.16")
    tokenizer = AutoTokenizer.from_pretrained(base["model"])
    model = AutoModelForCausalLM.from_pretrained(base["model"], dtype=torch.float32).train()
    settings = GRPOOptions(loss_type=loss_type, beta=beta, max_completion_length=6, epsilon=0.2, epsilon_high=0.28,
                           temperature=temperature)
    prompts_ids = [row[mask.bool()].tolist() for row, mask in zip(saved["prompt_ids"], saved["prompt_mask"])]
    objective, batch, ids, _ = _rollout_rows(model, tokenizer, settings, prompts_ids, saved["completion_ids"])
    rollout = batch.pop("labels")
    start = ids.shape[1] - 1  # the row's position that predicts the first completion token
    assert (rollout.labels[:, start:-1] != -100).long().equal(saved["completion_mask"])
    rollout.advantages = saved["advantages"]
    rollout.normalizer = saved["num_items_in_batch"]

    def wide(values):  # per completion token, at the row's positions that predict them
        out = torch.zeros(rollout.labels.shape)
        out[:, start:-1] = values
        return out

    policy = GroupObjective().forward(model, batch)  # the policy's pass alone (the reference's values are given)
    logps = objective.token_logps(policy.head, rollout.labels, temperature)
    mask = (rollout.labels != -100).float()
    entropy = (objective.token_entropy(policy.head, temperature) * mask).sum() / mask.sum()
    loss, metrics = objective.policy_loss(logps, rollout, wide(saved["ref_per_token_logps"]) if beta else None,
                                          old=wide(saved["old_per_token_logps"]))
    loss.backward()
    torch.testing.assert_close(loss.detach(), theirs["loss"], atol=1e-6, rtol=1e-5)
    for mine, trls in zip([p.grad for p in model.parameters()], theirs["grads"]):
        torch.testing.assert_close(mine, trls, atol=1e-6, rtol=1e-4)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", *(["kl"] if beta else [])):
        assert float(metrics[key]) == pytest.approx(theirs["metrics"][key], abs=1e-6), key
    assert float(entropy) == pytest.approx(theirs["metrics"]["entropy"], abs=1e-5)
    assert 0 < float(metrics["clip_ratio/region_mean"]) < 1  # the clipping was exercised


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_trls(scale):
    """Each reward less its group's mean, divided by the group's (or the batch's) standard
    deviation plus 1e-4: TRL 1.16's _generate_and_score_completions, written out."""
    from xla_train.tasks.grpo import GroupObjective, GRPOOptions

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2, 0.0, 1.0, 1.0, 1.0])
    objective = GroupObjective(settings=GRPOOptions(scale_rewards=scale, num_generations=4))
    mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (rewards.view(-1, 4).std(1).repeat_interleave(4) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    torch.testing.assert_close(objective.advantages(rewards, 4), advantages)
    assert objective.advantages(rewards, 4)[4:8].abs().max() == 0  # a group of equal rewards teaches nothing


def test_the_rollouts_rows_are_the_completions_log_probabilities(base):
    """A rollout's row (left-padded prompt, completion, padding after its end) gives each
    completion token the log-probability the model gives it in the sequence alone, unpadded;
    tokens after the first end-of-sequence token are left out of the loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.grpo import GRPOOptions

    tokenizer = AutoTokenizer.from_pretrained(base["model"])
    model = AutoModelForCausalLM.from_pretrained(base["model"], dtype=torch.float32).eval()
    prompts_ids = [tokenizer(p["prompt"])["input_ids"] for p in prompts(3, 7)]
    completions = torch.randint(5, model.config.vocab_size, (3, 5))
    completions[1, 1:] = tokenizer.eos_token_id
    objective, batch, _, _ = _rollout_rows(model, tokenizer, GRPOOptions(max_completion_length=5), prompts_ids,
                                           completions)
    rollout = batch.pop("labels")
    logps = objective.token_logps(objective.forward(model, batch).head, rollout.labels)
    for i in range(3):
        real = batch["segments"][i].bool()
        ids = batch["input_ids"][i][real]
        alone = model(input_ids=ids[None]).logits[0].float().log_softmax(-1)
        labels = rollout.labels[i][real]
        kept = labels != -100
        expected = alone[kept].gather(1, labels[kept][:, None])[:, 0]
        torch.testing.assert_close(logps[i][rollout.labels[i] != -100], expected, atol=1e-5, rtol=1e-5)
    assert (rollout.labels[1] != -100).sum() == 2  # a token and its end-of-sequence token


def test_the_built_in_rewards():
    """xla_train.rewards: an answer matched after its extraction, a number matched as GSM8K writes
    it, TRL's think format (the same verdicts as trl.rewards.think_format_reward)."""
    from xla_train.rewards import exact_match, format_match, match_on, number_match, think_format

    assert exact_match(["<answer> 4</answer>", "5", "4"], answer=["4", "4", "4"]) == [1.0, 0.0, 1.0]
    assert number_match(["so it is 1,234.0", "x", "#### 7"], answer=["#### 1234", "3", "7"]) == [1.0, 0.0, 1.0]
    boxed = match_on(r"\\boxed\{([^}]*)\}", column="solution", name="boxed")
    assert boxed(["a \\boxed{12} b", "none"], solution=["12", "12"]) == [1.0, 0.0] and boxed.__name__ == "boxed"
    assert format_match(r"\d+", name="digits")(["12", "1a"]) == [1.0, 0.0]
    turns = [[{"role": "assistant", "content": c}] for c in ("<think>\nr\n</think>\nA", "<think>r A",
                                                             "x<think>a</think>", "<think>a</think><think>b</think>")]
    assert think_format(turns) == [1.0, 0.0, 0.0, 0.0]
    trl = pytest.importorskip("trl.rewards")
    assert think_format(turns) == trl.think_format_reward(turns)


# ---------------------------------------------------------------------------------------------
# Mistakes: one line each, before the model loads where they can be told then


@pytest.fixture
def bad_rewards(tmp_path):
    path = tmp_path / "bad_rewards.py"
    path.write_text(
        "import math\n"
        "def raises(completions, **kw):\n    raise ValueError('no answer column')\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def nan(completions, **kw):\n    return [math.nan] * len(completions)\n"
        "def words(completions, **kw):\n    return ['good'] * len(completions)\n"
        "def later(completions, trainer_state, **kw):\n"
        "    if trainer_state.global_step >= 3:\n        raise RuntimeError('step 3')\n"
        "    return [0.0] * len(completions)\n"
        "async def later_async(completions, **kw):\n    return [1.0] * len(completions)\n")
    return path


def test_mistakes_are_one_line(base, bad_rewards, tmp_path, capsys):
    model = str(base["model"])
    cases = [
        (["--reward", "nowhere.py:f"], "--reward nowhere.py:f: no such file nowhere.py"),
        (["--reward", f"{bad_rewards}:missing"], "has no function 'missing'"),
        (["--reward", "no_such_module_x:f"], "no_such_module_x cannot be imported (ModuleNotFoundError"),
        (["--reward", REWARD, "--reward-weights", "1,2"], "--reward-weights gives 2 weight(s) for 1 --reward"),
        (["--batch-size", 12], "--batch-size 12 (completions per device, TRL's per_device_train_batch_size) must be "
                               "a multiple of --num-generations 8"),
        (["--num-generations", 1, "--batch-size", 4], "--num-generations must be at least 2"),
        (["--num-iterations", 2, "--save-every", 3], "--save-every 3 must be a multiple of --num-iterations 2"),
        (["--num-iterations", 0], "--num-iterations must be at least 1, not 0"),
        (["--loss-type", "ppo"], "--loss-type must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo, "
                                 "not 'ppo'"),
        (["--temperature", "0"], "--temperature must be above 0"),
        (["--packing"], "--packing: --problem grpo puts a prompt and a completion in each row"),
    ]
    for extra, message in cases:
        args = grpo_args(model, base, *extra)
        if "--reward" in extra[:1]:  # the case's own --reward instead of the default one
            i = args.index("--reward")
            del args[i:i + 2]
        assert main(["train", *map(str, args)]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (extra, err)
    # rows without a prompt, and --num-generations on another kind
    no_prompt = td.write_jsonl(tmp_path / "q.jsonl", [{"question": "x", "answer": "y"}] * 4)
    assert main(["train", *map(str, grpo_args(model, base, "--train-file", no_prompt))]) == 2
    assert "q.jsonl: GRPO's rows need a 'prompt' column" in capsys.readouterr().err
    assert main(["train", "--backend", "cpu", "--num-generations", "4"]) == 2
    assert "--num-generations applies to --problem grpo" in capsys.readouterr().err


@pytest.mark.parametrize("function, message", [
    ("raises", "--reward {path}:raises raised ValueError: no answer column (scoring {train}: row"),
    ("short", "--reward {path}:short returned 1 rewards for 32 completions"),
    ("nan", "--reward {path}:nan returned nan for {train}: row"),
    ("words", "--reward {path}:words returned 'good' for {train}: row"),
])
def test_a_bad_reward_stops_the_run_with_one_line(base, bad_rewards, function, message, capsys):
    args = grpo_args(str(base["model"]), base, "--max-steps", 2)
    args[args.index(REWARD)] = f"{bad_rewards}:{function}"
    assert main(["train", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message.format(path=bad_rewards, train=base["train"]) in err[-1], err[-1]


def test_a_reward_failing_later_keeps_the_last_checkpoint(base, bad_rewards, tmp_path, capsys):
    """A function that raises at step 3 stops the run with one line; the checkpoint of step 2
    stays, and an async function (awaited) is summed with it by its weight until then."""
    out = tmp_path / "run"
    args = grpo_args(str(base["model"]), base, "--max-steps", 6, "--save-every", 2, "--output-dir", out,
                     "--reward", f"{bad_rewards}:later_async", "--reward-weights", "1,2")
    args[args.index(REWARD)] = f"{bad_rewards}:later"
    assert main(["train", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"--reward {bad_rewards}:later raised RuntimeError: step 3" in err[-1]
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").exists()


# ---------------------------------------------------------------------------------------------
# Runs


@pytest.fixture(scope="module")
def sft_model(base, tmp_path_factory):
    """The model taught part of the task: 120 steps of SFT on 2,000 reversal rows."""
    out = tmp_path_factory.mktemp("sft")
    rows = td.write_jsonl(out / "sft.jsonl", td.reverse_rows(2000, 3))
    proc, _ = run_cli(["--backend", "cpu", "--problem", "causal-lm", "--model", base["model"], "--train-file", rows,
                       "--max-steps", 120, "--batch-size", 16, "--lr", 3e-3, "--max-length", 64, "--output-dir",
                       out / "sft", "--no-data-cache"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "sft"


def greedy_reward(folder, validation):
    """The mean reward of transformers' greedy completions of the validation prompts."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("grpo_rewards", REWARD.rpartition(":")[0])
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    rows = [json.loads(line) for line in open(validation)]
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, top_k=None, top_p=None,
                             pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(rewards.reversed_letters(texts, [r["answer"] for r in rows])) / len(rows)


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_model_taught_part_of_the_task(base, sft_model, tmp_path):
    """300 steps of 4 prompts x 8 completions sampled at temperature 0.7 raise the greedy reward
    of the held-out prompts (a share of the letters in place) clearly; the run's own evaluation is
    transformers' greedy generation scored by the same function; TRL's metric names are logged."""
    before = greedy_reward(sft_model, base["validation"])
    out = tmp_path / "run"
    proc, m = run_cli(grpo_args(sft_model, base, "--lr", 2e-4, "--temperature", 0.7, "--max-steps", 300,
                                "--eval-every", 150, "--log-every", 50, "--eval-samples", 2, "--output-dir", out),
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = m["eval"]["reward"]
    assert after == pytest.approx(greedy_reward(out, base["validation"]), abs=1e-6)
    assert after > before + 0.04, (before, after)
    logged = dict(m["train_metrics"][-1][1]) if isinstance(m["train_metrics"][-1][1], list) else \
        m["train_metrics"][-1][1]
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                "rewards/reversed_letters/mean", "clip_ratio/region_mean"):
        assert key in logged and math.isfinite(logged[key]), key
    assert m["eval"]["n"] == 64 and 1 <= m["eval"]["completions/mean_length"] <= 8
    assert m["goodput"]["seconds"]["rollout"] > 0  # the rollouts' time, apart from the update's
    samples = [json.loads(line) for line in (out / "samples" / "step-300.jsonl").read_text().splitlines()]
    validation = [json.loads(line) for line in open(base["validation"])][:2]
    assert [(s["prompt"], s["answer"]) for s in samples] == [(v["prompt"], v["answer"]) for v in validation]
    assert all(s["reward"] == s["rewards/reversed_letters"] == pytest.approx(
        sum(a == b for a, b in zip(s["completion"].split(), s["answer"].split())) / len(s["answer"].split()))
        for s in samples)


@pytest.fixture
def slow_reward(tmp_path):
    """The task's reward, 0.2 s a call: steps slow enough to stop between checkpoints."""
    path = tmp_path / "slow_rewards.py"
    path.write_text(f"import time, importlib.util\nspec = importlib.util.spec_from_file_location('r', "
                    f"{REWARD.rpartition(':')[0]!r})\nr = importlib.util.module_from_spec(spec)\n"
                    "spec.loader.exec_module(r)\n"
                    "def reversed_letters(completions, **kw):\n    time.sleep(0.2)\n"
                    "    return r.reversed_letters(completions, **kw)\n")
    return f"{path}:reversed_letters"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--num-iterations", 2, "--grad-accum", 2, "--batch-size", 16]],
                         ids=["one-update", "two-updates-accumulated"])
def test_stopped_and_resumed_draws_the_same_completions(base, sft_model, slow_reward, extra, tmp_path):
    """SIGTERM after a checkpoint, then --resume: the sampling generator's state comes back with
    the checkpoint, so the resumed run draws the completions of an uninterrupted one and ends
    with its weights, metrics and evaluation. With --num-iterations 2 (and two micro-batches a
    step) each rollout trains two steps in a row: the second update sees the first's rollout (the
    same rewards) and ratios away from 1, and a signal stops the run between rollouts only."""
    args = grpo_args(sft_model, base, "--max-steps", 10, "--save-every", 4, "--log-every", 1, "--lr", 1e-3, *extra)
    args[args.index(REWARD)] = slow_reward
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, stopped_at, resumed = stop_and_resume(args, tmp_path / "run", tmp_path)
    assert 4 <= stopped_at < 10 and resumed["steps"] == 10
    assert_same_weights(tmp_path / "run", tmp_path / "whole", atol=0)
    assert resumed["eval"] == whole["eval"]
    assert resumed["train_metrics"][-1] == whole["train_metrics"][-1]  # the metrics' sums come back too
    logged = [dict(metrics) for _, metrics in whole["train_metrics"]]
    assert len(logged) == 10
    if extra:
        assert stopped_at % 2 == 0  # between rollouts
        firsts, seconds = logged[::2], logged[1::2]
        assert all(a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
                   for a, b in zip(firsts, seconds))  # the same rollout, trained on again
        assert all(a["clip_ratio/region_mean"] == 0 for a in firsts)  # sampled by these weights: ratio 1
        assert any(b["clip_ratio/region_mean"] > 0 for b in seconds)  # one update later, some ratios clipped
        assert sum(b["reward"] != a["reward"] for b, a in zip(seconds, firsts[1:])) >= 3  # then a new rollout


def test_each_steps_batches_come_as_often_as_it_trains_on_them():
    """--num-iterations K: the loader hands each optimizer step's micro-batches K times in a row
    (Shapes.repeats); an epoch's last micro-batches that cannot fill a step are left out, and
    the epoch has K times the steps."""
    from xla_train.core.batching import BatchPlan
    from xla_train.core.shapes import Shapes

    def batches(**kw):
        plan = BatchPlan([4] * 10, 2, padding="max_length", max_length=8, **kw)
        return [tuple(r for r, _, _ in b) for b in plan], len(plan)

    plain, n = batches()
    assert n == 5 and len(set(plain)) == 5
    repeated, n = batches(repeats=3, grad_accum=2)
    assert n == len(repeated) == 12
    assert repeated == [*plain[0:2] * 3, *plain[2:4] * 3]
    assert Shapes(2, 1, 2, repeats=3).steps_per_epoch(10) == 6 == Shapes(2, 1, 2).steps_per_epoch(10) * 3


@pytest.mark.slow
@pytest.mark.parametrize("devices,extra", [
    # no dropout: the sampler's network; the top-entropy mask's quantile in static shapes
    (1, ["--lora", "--lora-r", 4, "--lora-dropout", 0, "--beta", 0.04, "--top-entropy-quantile", 0.5]),
    (4, ["--strategy", "fsdp", "--precision", "bf16", "--beta", 0.04]),
], ids=["one-device-lora-beta", "fsdp4-bf16-beta"])
def test_xla_compiles_a_bounded_number_of_graphs(devices, extra, base, sft_model, tmp_path):
    """2 epochs of 32 prompts on XLA:CPU, 4 prompts x 4 completions a step: one device with LoRA
    and the KL to the reference (the adapters disabled), the loss on the high-entropy half of the
    tokens; four devices under FSDPv2 in bf16 with the
    KL to a frozen copy (read into its shards as the policy is). A prefill and a decode graph per
    shape (training's and evaluation's), the step's graph: none after the first epoch, no aten
    fallback, one host transfer a step (the rollout's tokens) besides the log points'."""
    train = td.write_jsonl(tmp_path / "train.jsonl", prompts(32, 9))
    args = grpo_args(sft_model, {**base, "train": train}, "--num-generations", 4, "--batch-size", 16 // devices,
                     "--epochs", 2, "--log-every", 4, *extra)
    args[args.index("cpu")] = "xla"
    proc, m = run_cli(args, tmp_path, env={"CPU_NUM_DEVICES": str(devices)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla = m["xla"]
    assert xla["compiles"] <= 10 and xla["compiles_after_first_epoch"] == 0, xla
    assert xla["aten_fallbacks"] == 0 and xla["host_syncs_per_step"] <= 1.3, xla
    assert m["world_size"] == devices and m["steps"] == 16 and m["eval"]["n"] == 64
    assert all(math.isfinite(loss) for _, loss, _ in m["train_loss"]) and math.isfinite(m["eval"]["reward"])
    if "--beta" in extra:
        assert all(math.isfinite(metrics["kl"]) for _, metrics in m["train_metrics"])
    # the sampler is the trainer: the decode graph's log-probabilities are the update's, to 1e-5 in
    # fp32 (each logged value the mean of its steps' maxima), within bf16's rounding in bf16 (dropout,
    # LoRA's default 0.05, would make the update's pass another network: left out above)
    bound = 0.1 if "bf16" in extra else 1e-5
    differences = [metrics["sampling/sampling_logp_difference/max"] for _, metrics in m["train_metrics"]]
    print("sampling/sampling_logp_difference/max", differences)
    assert all(0 <= d <= bound for d in differences), differences
    if devices > 1:  # the policy's and the reference's weights, each read into its shards
        assert proc.stdout.count("this host read") == 2, proc.stdout[-2000:]


@pytest.mark.slow
def test_the_kl_to_a_frozen_copy_without_adapters_on_two_fsdp_processes(base, sft_model, tmp_path):
    """beta > 0 without --lora, full fine-tuning under FSDP2 on two gloo processes: the reference is
    a frozen copy of the model as it began, sharded like it and counted by the memory plan. The KL
    is 0 at the first step (the policy is the reference) and grows once the policy moves; with
    --num-iterations 2, each rollout's second update has ratios away from 1."""
    proc, m = run_cli(grpo_args(sft_model, base, "--batch-size", 16, "--max-steps", 6, "--num-processes", 2,
                                "--strategy", "fsdp", "--beta", 0.04, "--lr", 1e-3, "--num-iterations", 2,
                                "--log-every", 1), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reference weights" in proc.stdout + proc.stderr
    kl = [metrics["kl"] for _, metrics in m["train_metrics"]]
    assert kl[0] == 0 and all(k > 0 for k in kl[2:]), kl
    assert m["trainable_params"] == m["total_params"] and math.isfinite(m["eval"]["reward"])


@pytest.mark.slow
def test_lora_in_bf16_merged_and_predicted_on_two_gloo_processes(base, sft_model, tmp_path):
    """Two CPU processes (gloo DDP), each rolling out its own prompts (a group never straddles
    them), LoRA in bf16 with beta > 0, --merge-lora and --test-file; `xla-train predict` completes
    prompts with the merged folder."""
    from conftest import cli

    out = tmp_path / "run"
    proc, m = run_cli(grpo_args(sft_model, base, "--batch-size", 16, "--max-steps", 6, "--num-processes", 2, "--lora",
                                "--precision", "bf16", "--beta", 0.04, "--merge-lora", "--test-file",
                                base["validation"], "--output-dir", out, "--log-every", 2), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["world_size"] == 2 and m["steps"] == 6 and m["trainable_params"] < 0.5 * m["total_params"]
    assert math.isfinite(m["eval"]["reward"]) and m["eval"]["n"] == 64
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 64 and all(set(p) == {"prompt", "answer", "completion"} for p in predictions)
    predicted = cli("predict", ["--model", out, "--input", base["validation"], "--output", tmp_path / "p.jsonl",
                                "--backend", "cpu", "--max-new-tokens", 8])
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert [json.loads(line)["completion"] for line in open(tmp_path / "p.jsonl")][:8] == \
        [p["completion"] for p in predictions[:8]]


def test_the_memory_plan_holds_the_rollouts_cache(base):
    """The plan of a GRPO step: rows of a prompt bucket plus a completion, and the rollout's
    key/value cache, which is what kernels/generate.py's generator allocates for that many tokens
    (a sliding layer only a ring of its window and a chunk less one: Gemma 3's window of 8 here),
    in fp32 and under the update's bf16 autocast (bf16 values, fp32 keys: RoPE's fp32 cos and sin)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from xla_train.kernels.generate import TURN_CHUNK, Sampling, Turns, cache_slots
    from xla_train.memory import plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.grpo import GroupObjective, GRPOOptions

    windowed = td.config("gemma3", 40, bos=1, eos=2)
    windowed.sliding_window = 8
    assert cache_slots(windowed, 40) == [8 + TURN_CHUNK - 1] * 5 + [40]
    for model in (AutoModelForCausalLM.from_config(windowed, dtype=torch.float32),  # the Llama last: read below
                  AutoModelForCausalLM.from_pretrained(base["model"], dtype=torch.float32)):
        for tools in ("", "t.py:f"):  # a rollout with tools or without: one generator, one cache
            path = GroupObjective(settings=GRPOOptions(max_completion_length=8, tools=tools or None)).memory_inputs(
                model, "cpu", 16)
            assert path.length == 24 and path.cache_tokens == 24 and path.reference is None
            for precision in ("fp32", "bf16"):
                memory = plan(Mesh(), replace(path, rows=32, precision=precision), shape_of(model))
                ids = torch.ones(32, 16, dtype=torch.long)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    turns = Turns(model, ids, torch.ones_like(ids), Sampling(8, (2,), 0), lambda: None)
                allocated = sum(t.numel() * t.element_size() for layer in turns.cache.layers
                                for t in (layer.keys, layer.values))
                assert memory.cache == allocated, (model.config.model_type, tools, precision)
    assert memory.total >= memory.weights + memory.cache
    # beta > 0 without adapters: a frozen copy of the weights beside the trained ones; with them, none
    assert not path.reference_copy
    path = GroupObjective(settings=GRPOOptions(max_completion_length=8, beta=0.04)).memory_inputs(model, "cpu", 16)
    assert path.reference_copy
    with_copy = plan(Mesh(fsdp=2), replace(path, rows=32), shape_of(model))
    half = plan(Mesh(fsdp=2), replace(path, rows=32, reference_copy=False), shape_of(model))
    assert with_copy.reference_weights == half.weights > 0
    assert with_copy.total == half.total + half.weights
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not GroupObjective(settings=GRPOOptions(beta=0.04)).memory_inputs(lora, "cpu", 16).reference_copy


def test_a_reward_model_folder_is_a_reward(base, tmp_path):
    """--reward FOLDER: a sequence classifier scores each prompt and completion by its first
    logit, as TRL's GRPOTrainer scores with a reward model; a folder that is not a classifier is
    one line."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from xla_train.core.errors import UserError
    from xla_train.models import bundled_model_path
    from xla_train.tasks.rewards import TrainerState, rewards_of, score

    folder = tmp_path / "reward-model"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(bundled_model_path(), num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(bundled_model_path()).save_pretrained(folder)
    rewards = rewards_of(f"{folder},{REWARD}", "0.5,1")
    assert [r.name for r in rewards] == ["reward-model", "reversed_letters"]
    prompts, completions = ["reverse a b =", "reverse c d e ="], [" b a", " e c d"]
    values, _ = score(rewards, prompts, completions, [[1], [2]], {"answer": ["b a", "e d c"]}, TrainerState(),
                      ["r1", "r2"])
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True,
                       add_special_tokens=False)
    with torch.no_grad():
        expected = model(**inputs).logits[:, 0].tolist()
    assert [v[0] for v in values] == pytest.approx(expected, abs=1e-6)
    assert [v[1] for v in values] == [1.0, 1 / 3]
    with pytest.raises(UserError, match="not a reward model"):
        rewards_of(str(base["model"]), None)


def test_rollouts_run_past_a_sliding_window(base, tmp_path, capsys):
    """A step of a tiny Gemma 3 whose sliding window (8 tokens) is shorter than its rollouts
    (prompts of 6 to 8 tokens plus up to 12 new ones), its evaluation's greedy completions and its
    --eval-samples: the static loop's sliding layers keep the window past its 8 tokens (it once
    stopped at the first rollout: transformers' StaticCache kept 8 slots for a mask of the whole row;
    rows this short fit the ring of the window and 15 slots, whose wrapping test_generate's tests).
    The step's loss is VESPO's at the sequence level: TRL's warning once, its metrics logged, and the
    sampler's log-probabilities the update's (fp32)."""
    folder = td.save("gemma3", tmp_path / "gemma3", letters=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 8}))
    validation = td.write_jsonl(tmp_path / "validation.jsonl", prompts(4, 2))
    metrics = tmp_path / "metrics.json"
    args = grpo_args(folder, base, "--max-steps", 1, "--max-completion-length", 12, "--validation-file", validation,
                     "--eval-samples", 2, "--output-dir", tmp_path / "run", "--metrics-out", metrics,
                     "--loss-type", "vespo", "--importance-sampling-level", "sequence")
    assert main(["train", *map(str, args)]) == 0
    err = capsys.readouterr().err
    assert err.count("xla-train: warning: --loss-type vespo computes the sequence's importance weight") == 1, err
    m = json.loads(metrics.read_text())
    logged = m["train_metrics"][-1][1]
    assert logged["vespo/phi_seq_mean"] > 0 and "clip_ratio/region_mean" not in logged, logged
    assert logged["sampling/sampling_logp_difference/max"] <= 1e-5, logged
    assert m["train_metrics"][-1][1]["completions/max_length"] > 8, m["train_metrics"]
    assert m["eval"]["n"] == 4 and m["eval"]["completions/mean_length"] > 8, m["eval"]
    samples = (tmp_path / "run" / "samples" / "step-1.jsonl").read_text().splitlines()
    assert len(samples) == 2 and all("completion" in json.loads(line) for line in samples)
