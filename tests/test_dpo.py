"""Preference tuning (`--problem dpo`, xla_train/tasks/dpo.py): the pair rows, the two reference
paths against a frozen copy, the bad inputs, a synthetic pair task a tiny model learns, resume,
and the graphs on XLA:CPU.

The synthetic task (tiny_decoders' reversal): the prompt `reverse c a b =`, chosen the letters
reversed (` b a c`), rejected another order of them."""

import copy
import json
import math
import random

import pytest
import tiny_decoders as td
import torch
from conftest import assert_same_weights, run_cli, stop_and_resume

from xla_train.commands.cli import main
from xla_train.tasks.documents import IGNORE


def pairs(n, seed, conversational=False):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letters = rng.sample(td.LETTERS, rng.randint(3, 5))
        good = list(reversed(letters))
        bad = good[:]
        while bad == good:
            rng.shuffle(bad)
        prompt = "reverse " + " ".join(letters) + " ="
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": " ".join(good)}],
                         "rejected": [{"role": "assistant", "content": " ".join(bad)}]})
        else:
            rows.append({"prompt": prompt, "chosen": " " + " ".join(good), "rejected": " " + " ".join(bad)})
    return rows


@pytest.fixture(scope="module")
def pair_task(tmp_path_factory):
    """A 2-layer, 64-wide random Llama over the task's words (with and without a chat template),
    2,000 training pairs, 64 validation pairs, 32 conversational pairs."""
    folder = tmp_path_factory.mktemp("pairs")
    return {"model": td.save("llama", folder / "llama", chat=True, letters=True),
            "plain_model": td.save("llama", folder / "plain", letters=True),
            "train": td.write_jsonl(folder / "train.jsonl", pairs(2000, 1)),
            "validation": td.write_jsonl(folder / "validation.jsonl", pairs(64, 2)),
            "conversational": td.write_jsonl(folder / "conversational.jsonl", pairs(32, 3, conversational=True))}


def dpo_args(task, *extra):
    return ["--problem", "dpo", "--model", task["model"], "--train-file", task["train"], "--validation-file",
            task["validation"], "--max-length", 32, "--buckets", 32, "--batch-size", 16, "--lr", 3e-3, *extra]


# ---------------------------------------------------------------------------------------------
# Rows


def _load(path, model, max_length=32, **settings):
    from transformers import AutoTokenizer

    from xla_train.tasks.dpo import load_pairs

    task, splits = load_pairs(str(path), str(path), max_length=max_length, settings=settings)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data, truncated = task.rows.tokenize(splits, tokenizer, max_length)
    return task, tokenizer, data, truncated


@pytest.mark.parametrize("form", ["strings", "conversational"])
def test_a_pair_is_one_row_of_two_sequences(form, pair_task, tmp_path):
    """Prompt + chosen (segment 1) then prompt + rejected (segment 2), positions from 0 in each,
    labels the completions' tokens only (shifted: a token's label is the next one)."""
    path = pair_task["conversational"] if form == "conversational" else \
        td.write_jsonl(tmp_path / "p.jsonl", pairs(8, 4))
    task, tokenizer, data, truncated = _load(path, pair_task["model"], max_length=64)
    assert task.form == form and truncated == {"train": 0, "validation": 0}
    row = data["train"][0]
    segments, positions, labels, ids = row["segments"], row["position_ids"], row["labels"], row["input_ids"]
    first = segments.index(2)
    assert set(segments) == {1, 2} and segments == sorted(segments)
    assert positions[:first] == list(range(first)) and positions[first:] == list(range(len(ids) - first))
    for lo, hi in ((0, first), (first, len(ids))):
        trained = [i for i in range(lo, hi) if labels[i] != IGNORE]
        assert trained and labels[hi - 1] == IGNORE  # nothing crosses into the next sequence
        assert all(labels[i] == ids[i + 1] for i in trained)
        text = tokenizer.decode([ids[i + 1] for i in trained])
        assert "reverse" not in text and "user" not in text  # the completions only


def test_max_length_keeps_the_prompts_and_cuts_the_completions(pair_task, tmp_path, capsys):
    path = td.write_jsonl(tmp_path / "p.jsonl", [{"prompt": "reverse a b c d e =", "chosen": " e d c b a",
                                                  "rejected": " a b c d e"}] * 2)
    _, _, data, truncated = _load(path, pair_task["model"], max_length=20)
    row = data["train"][0]
    assert row["length"] == 20 and truncated == {"train": 2, "validation": 2}
    # each sequence: its prompt whole ([CLS] reverse a b c d e =) and 2 of its answer's 6 tokens (5 letters, [SEP])
    assert row["segments"].count(1) == row["segments"].count(2) == 10
    assert sum(label != IGNORE for label in row["labels"]) == 4
    with pytest.raises(Exception, match="no pair fits --max-length 12"):
        _load(path, pair_task["model"], max_length=12)


@pytest.mark.parametrize("form", ["strings", "conversational"])
def test_eval_samples_and_test_files_generate_from_the_pairs_prompts(form, pair_task, tmp_path):
    """--eval-samples: the first validation pairs' prompts (a conversation's turns), the chosen
    completion the reference (a conversation's first assistant turn), as many new tokens as the
    longest of them takes in training; --test-file and predict read the same file's prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.completion import read_prompts
    from xla_train.tasks.documents import encode, prompt_ids
    from xla_train.tasks.dpo import load_pairs

    rows = pairs(8, 4, conversational=form == "conversational")
    if form == "conversational":  # the first pair's chosen completion goes on after its first answer
        rows[0]["chosen"] = [*rows[0]["chosen"], {"role": "user", "content": "again"},
                             {"role": "assistant", "content": "a b"}]
    path = td.write_jsonl(tmp_path / "p.jsonl", rows)
    task, splits = load_pairs(str(path), str(path), max_length=64)
    samples = task.sample_rows(splits, 3)
    tokenizer = AutoTokenizer.from_pretrained(pair_task["model"])
    kind = "prompt" if form == "strings" else "messages"  # prompt_ids' form of the prompts
    for (prompt, prompt_form, reference, full), row in zip(samples, splits["validation"].select(range(3))):
        assert prompt_form == kind
        if form == "strings":
            assert (prompt, reference, full) == ({"prompt": row["prompt"]}, row["chosen"],
                                                 {"prompt": row["prompt"], "completion": row["chosen"]})
        else:
            assert (prompt, reference) == ({"messages": row["prompt"]}, row["chosen"][0]["content"])
            assert full == {"messages": row["prompt"] + row["chosen"][:1]}
    made = task.samples(samples, tokenizer, AutoModelForCausalLM.from_pretrained(pair_task["model"]), batch_size=2)
    encoded = [encode(full, "prompt/completion" if form == "strings" else "messages", tokenizer, "")[0]
               for _, _, _, full in samples]
    starts = [prompt_ids(prompt, prompt_form, tokenizer, "") for prompt, prompt_form, _, _ in samples]
    assert made.sampling.max_new_tokens == max(len(e) - len(p) for e, p in zip(encoded, starts))
    assert [s["reference"] for s in made.shown] == [r[2] for r in samples] and len(made.data) == 3
    # the file as --test-file: every row's prompt, as training renders it
    prompts = read_prompts(path, tokenizer, 64)
    assert prompts.data["input_ids"] == [prompt_ids({kind: r["prompt"]}, kind, tokenizer, "") for r in rows]


# ---------------------------------------------------------------------------------------------
# The reference, against a frozen copy


def _batch(data, collator, n=4):
    from xla_train.core.batching import PlannedRows

    rows = PlannedRows(data)
    return collator([(rows[(i, 32, 1)][0], 32, 1) for i in range(n)])


def _logps(objective, model, batch):
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "valid")}
    out = objective.forward(model, inputs)
    chosen, rejected, _, _ = objective.logps(out.policy, batch["labels"], out.segments)
    return out, torch.stack([chosen, rejected], 1)


def test_the_lora_reference_is_the_base_model(pair_task, tmp_path):
    """With adapters, the reference is the same model with them disabled: within 1e-5 of a frozen
    copy of the base (fp32), while the policy (adapters on, not zero) differs from it."""
    from transformers import AutoModelForCausalLM

    from xla_train.models import add_adapters
    from xla_train.options import TrainOptions

    path = td.write_jsonl(tmp_path / "p.jsonl", pairs(8, 5))
    task, tokenizer, data, _ = _load(path, pair_task["model"])
    base = AutoModelForCausalLM.from_pretrained(pair_task["model"], dtype=torch.float32).eval()
    frozen = copy.deepcopy(base)
    policy = add_adapters(base, TrainOptions(lora=True).section("model"), "CAUSAL_LM").eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the outputs
    batch = _batch(data["train"], task.rows.collator(tokenizer))
    with torch.no_grad():
        out, policy_logps = _logps(task.objective, policy, batch)
        reference = torch.stack(task.objective.reference_logps(out, batch["labels"]), 1)
        _, expected = _logps(task.objective, frozen, batch)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)
    assert (policy_logps - expected).abs().max() > 1e-2


def test_the_precomputed_reference_is_the_initial_model(pair_task, tmp_path):
    """Without adapters, the reference pass before training gives every row of every split its
    frozen copy's log-probabilities (within 1e-5, fp32), in input order."""
    from transformers import AutoModelForCausalLM

    from xla_train.core.batching import make_loader
    from xla_train.core.engine import Engine
    from xla_train.core.shapes import padding_for

    path = td.write_jsonl(tmp_path / "p.jsonl", pairs(11, 6))
    task, tokenizer, data, _ = _load(path, pair_task["model"])
    model = AutoModelForCausalLM.from_pretrained(pair_task["model"], dtype=torch.float32)
    frozen = copy.deepcopy(model).eval()
    engine = Engine(backend="cpu")
    prepared = engine.prepare(model)
    padding = padding_for("buckets", "16,32", 32, [d["length"] for d in data.values()])

    def loader(ds, split):
        return engine.prepare(make_loader(ds, tokenizer, 4, padding, shuffle=False, seed=0, fill="mask",
                                          collate=task.rows.collator(tokenizer)))

    out = task.objective.before_training(engine, prepared, data, loader, lambda: prepared)
    for split in ("train", "validation"):
        got = torch.tensor([out[split]["ref_chosen"], out[split]["ref_rejected"]]).T
        ds = out[split].remove_columns(["ref_chosen", "ref_rejected"])
        expected = torch.cat([_logps(task.objective, frozen, _batch(ds.select([i]), task.rows.collator(tokenizer),
                                                                    1))[1] for i in range(len(ds))])
        assert got.shape == (11, 2)
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=0)


def test_the_losses_are_trls():
    """DPO's sigmoid loss, IPO's on per-token means, RPO's NLL term; TRL's reward metrics."""
    from types import SimpleNamespace

    from xla_train.tasks.dpo import PreferenceObjective

    chosen, rejected = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    ref = (torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0]))
    tokens = (torch.tensor([2.0, 4.0]), torch.tensor([1.0, 2.0]))
    out = SimpleNamespace(policy=None, segments=None, reference=ref, reference_head=None, rows=None)
    for loss_type, alpha in (("sigmoid", None), ("ipo", None), ("sigmoid", 0.5)):
        objective = PreferenceObjective(beta=0.2, loss_type=loss_type, rpo_alpha=alpha)
        objective_logps = lambda *a: (chosen, rejected, *tokens)  # noqa: E731
        object.__setattr__(objective, "logps", objective_logps)
        loss = objective.loss(out, None)
        cr, rr = chosen - ref[0], rejected - ref[1]
        if loss_type == "ipo":
            expected = ((cr / tokens[0] - rr / tokens[1] - 1 / (2 * 0.2)) ** 2).mean()
        else:
            expected = -torch.nn.functional.logsigmoid(0.2 * (cr - rr)).mean()
        if alpha:
            expected = expected + alpha * (-chosen.sum() / tokens[0].sum())
        torch.testing.assert_close(loss, expected)
        metrics = objective.step_metrics(out, None)
        assert metrics["rewards/accuracies"] == 0.5
        torch.testing.assert_close(metrics["rewards/margins"], (0.2 * (cr - rr)).mean())


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line each


def _bad(rows, tmp_path, capsys, model, name="bad.jsonl", *extra):
    path = td.write_jsonl(tmp_path / name, rows) if rows is not None else None
    args = ["train", "--backend", "cpu", "--problem", "dpo", "--model", model, "--max-steps", 1,
            *(["--train-file", path] if path else []), *extra]
    code = main(list(map(str, args)))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_are_one_line_naming_the_file_and_row(pair_task, tiny_model, tmp_path, capsys):
    ok = pairs(4, 7)
    model = str(pair_task["model"])
    err = _bad([{"prompt": "a", "chosen": "b"}] * 3, tmp_path, capsys, model)
    assert "bad.jsonl" in err and "'rejected'" in err
    err = _bad(ok[:2] + [{**ok[2], "chosen": "  "}] + ok[3:], tmp_path, capsys, model)
    assert "bad.jsonl: row 3: empty chosen completion" in err
    err = _bad(ok[:1] + [{**ok[1], "rejected": ok[1]["chosen"]}] + ok[2:], tmp_path, capsys, model)
    assert "bad.jsonl: row 2: chosen and rejected are the same completion" in err
    conv = pairs(4, 8, conversational=True)
    err = _bad(conv[:3] + [{**conv[3], "chosen": "a b c"}], tmp_path, capsys, model)
    assert "bad.jsonl: row 4: 'chosen' must be a list of turns" in err
    err = _bad(conv, tmp_path, capsys, str(pair_task["plain_model"]))
    assert "bad.jsonl: conversational pairs need a chat template" in err
    err = _bad(ok, tmp_path, capsys, tiny_model)
    assert "is not a decoder" in err and "--problem dpo" in err
    err = _bad(None, tmp_path, capsys, model)
    assert "--problem dpo needs --train-file" in err
    err = _bad(ok, tmp_path, capsys, model, "ok.jsonl", "--packing")
    assert "--packing" in err
    # the preference options belong to this kind
    assert main(["train", "--backend", "cpu", "--beta", "0.5"]) == 2
    assert "--beta applies to --problem dpo" in capsys.readouterr().err
    assert main(["train", "--backend", "cpu", "--problem", "causal-lm", "--dpo-loss", "ipo"]) == 2
    assert "--dpo-loss applies to --problem dpo" in capsys.readouterr().err
    assert main(["train", "--backend", "cpu", "--problem", "dpo", "--dpo-loss", "hinge"]) == 2
    assert "--dpo-loss" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Runs


@pytest.fixture(scope="module")
def learned_pairs(pair_task, tmp_path_factory):
    """300 steps of 16 pairs on the CPU (about 30 s of training), evaluated and saved every 100
    steps. Returns (metrics, output folder)."""
    out = tmp_path_factory.mktemp("learned-pairs")
    proc, m = run_cli(["--backend", "cpu", *dpo_args(pair_task, "--max-steps", 300, "--eval-every", 100,
                                                     "--log-every", 50, "--save-every", 100),
                       "--output-dir", out / "run"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out / "run"


@pytest.mark.slow
def test_a_tiny_model_learns_the_preferences(learned_pairs):
    m, out = learned_pairs
    assert m["problem"] == "dpo" and m["main_metric"] == "rewards/accuracies"
    assert m["eval"]["rewards/accuracies"] >= 0.9 and m["eval"]["rewards/margins"] > 0.5, m["eval"]
    assert m["eval"]["n"] == 64 and set(m["eval"]) >= {"rewards/chosen", "rewards/rejected", "logps/chosen",
                                                       "logps/rejected", "loss"}
    assert m["best"]["metric"] == "rewards/accuracies"
    # training's metrics at every log point, under TRL's names, accuracies rising
    steps = [s for s, _ in m["train_metrics"]]
    assert steps == [50, 100, 150, 200, 250, 300]
    first, last = m["train_metrics"][0][1], m["train_metrics"][-1][1]
    assert set(last) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                         "logps/chosen", "logps/rejected"}
    assert last["rewards/accuracies"] > first["rewards/accuracies"]
    record = json.loads((out / "xla_train_task.json").read_text())
    assert record["problem"] == "dpo" and record["beta"] == 0.1


def twelve_steps(task, *extra):
    return ["--backend", "cpu", *dpo_args(task, "--max-steps", 12, "--log-every", 2, "--save-every", 4, *extra)]


@pytest.fixture(scope="module")
def twelve_step_run(pair_task, tmp_path_factory):
    """12 steps of 16 pairs in one CPU process, uninterrupted: (metrics, output folder)."""
    out = tmp_path_factory.mktemp("twelve-steps")
    proc, m = run_cli([*twelve_steps(pair_task), "--output-dir", out / "run"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return m, out / "run"


@pytest.mark.slow
def test_two_gloo_fsdp_processes_stopped_and_resumed_train_as_one(pair_task, twelve_step_run, tmp_path):
    """Two CPU processes of 8 pairs each, the model sharded by FSDP2 (--strategy fsdp), stopped
    by SIGTERM after a checkpoint and resumed: the weights and evaluation of one uninterrupted
    process of 16 pairs a step. Each process computes the reference columns before the first
    step with the sharded model (no inference tensors left in FSDP2's unsharded parameters:
    Engine.inference_mode), and again from the pretrained model when resumed; the checkpoint holds
    whole tensors gathered from both, and each takes its shards back, AdamW's moments too. (The
    training loss and metrics logged are the main process's share of each batch, as in every
    multi-process run.)"""
    whole, whole_dir = twelve_step_run
    args = twelve_steps(pair_task, "--batch-size", 8, "--num-processes", 2, "--strategy", "fsdp")
    _, stopped_at, resumed = stop_and_resume(args, tmp_path / "run", tmp_path)
    assert resumed["first_step"] == stopped_at < resumed["steps"] == 12
    assert resumed["world_size"] == 2 and resumed["replicas_identical"]
    assert resumed["memory"]["param_bytes_per_device"] == -(-resumed["memory"]["param_bytes_total"] // 2)
    assert_same_weights(tmp_path / "run", whole_dir, atol=1e-5)
    assert resumed["eval"] == pytest.approx(whole["eval"], abs=1e-5)
    assert [s for s, _ in resumed["train_metrics"]] == [s for s, _ in whole["train_metrics"]]


@pytest.mark.slow
def test_lora_in_bf16_merged_samples_and_predicts(pair_task, tmp_path, capsys):
    """--lora --precision bf16 (the frozen base held in bf16, the reference the base with the
    adapters disabled), --eval-samples, --test-file and --merge-lora in one run; `xla-train
    predict` completes prompts with the merged folder."""
    out = tmp_path / "run"
    proc, m = run_cli([*twelve_steps(pair_task, "--batch-size", 8, "--lora", "--precision", "bf16", "--merge-lora",
                                     "--eval-samples", 2, "--test-file", pair_task["validation"]),
                       "--output-dir", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["trainable_params"] < 0.1 * m["total_params"]
    assert m["memory"]["reference_bytes"] == 8 * 32 * 64 * 2  # 8 rows of 32 tokens, 64 wide, in bf16
    assert m["eval"]["n"] == 64 and all(math.isfinite(v) for v in m["eval"].values())
    samples = [json.loads(line) for line in (out / "samples" / "step-12.jsonl").read_text().splitlines()]
    validation = [json.loads(line) for line in open(pair_task["validation"])]
    assert [(s["prompt"], s["reference"]) for s in samples] == [(v["prompt"], v["chosen"]) for v in validation[:2]]
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 64 and all(set(p) == {"prompt", "chosen", "rejected", "completion"}
                                          for p in predictions)
    assert (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    prompts = td.write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": v["prompt"]} for v in validation[:3]])
    assert main(["predict", "--backend", "cpu", "--model", str(out), "--input", str(prompts), "--output",
                 str(tmp_path / "out.jsonl")]) == 0, capsys.readouterr().err[-2000:]
    assert [json.loads(line)["prompt"] for line in open(tmp_path / "out.jsonl")] == [v["prompt"]
                                                                                   for v in validation[:3]]


@pytest.mark.slow
@pytest.mark.parametrize("devices,extra", [
    (1, ["--lora", "--lora-r", 4]),
    (4, ["--strategy", "fsdp", "--precision", "bf16"]),
], ids=["one-device-lora", "fsdp4-bf16"])
def test_xla_compiles_a_bounded_number_of_graphs(devices, extra, pair_task, tmp_path):
    """2 epochs of 120 pairs on XLA:CPU: one device with LoRA (the reference in the step); four
    devices under FSDPv2 in bf16, full fine-tuning, the reference precomputed on the sharded model
    (`--strategy spmd` on four gave fsdp's evaluation to the last digit, by hand:
    benchmarks/dpo_combinations.sh): no graph after the first epoch, no aten fallback, at most 0.1
    host syncs a step, finite losses."""
    train = td.write_jsonl(tmp_path / "train.jsonl", pairs(120, 9))
    batch = 8 // devices  # rows per device: 8 pairs a step in all
    proc, m = run_cli(["--backend", "xla", *dpo_args({**pair_task, "train": train}, "--epochs", 2, "--batch-size",
                                                     batch, "--log-every", 10, *extra)],
                      tmp_path, env={"CPU_NUM_DEVICES": str(devices)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla = m["xla"]
    assert xla["compiles"] <= 6 and xla["compiles_after_first_epoch"] == 0, xla
    assert xla["aten_fallbacks"] == 0 and xla["host_syncs_per_step"] <= 0.1, xla
    assert m["world_size"] == devices and m["steps"] == 30 and m["eval"]["n"] == 64 and len(m["train_metrics"]) == 3
    assert all(math.isfinite(loss) for _, loss, _ in m["train_loss"]) and math.isfinite(m["eval"]["loss"])


@pytest.mark.torch_native
@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 10),
                    reason="make test-torch runs it (the newest torch): torch 2.9's inductor takes 100 s for it here")
def test_compile_trains_as_eager(pair_task, tmp_path):
    """--compile with --lora (the reference pass, adapters disabled, in the compiled step): the
    same losses and evaluation as eager (on the CPU with torch 2.9 too, by hand, 2026-11-26)."""
    runs = []
    for compiled in ([], ["--compile"]):
        proc, m = run_cli(twelve_steps(pair_task, "--batch-size", 8, "--lora", *compiled), tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(m)
    eager, compiled = runs
    assert compiled["torch_compile"]["compiles"] >= 1
    torch.testing.assert_close(compiled["train_loss"], eager["train_loss"], atol=1e-5, rtol=0)
    assert compiled["eval"] == pytest.approx(eager["eval"], abs=1e-5)
