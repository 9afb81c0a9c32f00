"""`xla-train predict` on a causal LM's folder: the tiny Llama that learned to reverse lists
(conftest's `learned_run`) completes held-out prompts on the CPU (transformers' generate) and on
XLA:CPU (the static-shape loop) alike; XLA compiles a bounded number of graphs whatever the
number of prompts; chat rows, an adapter folder and each bad input as one line."""

import json

import pytest
import tiny_decoders as td
from conftest import cli, reverse_args, run_cli

from xla_train.commands.cli import main

# Prompts are 6 to 8 tokens ([CLS] reverse, 3 to 5 letters, =); an answer is at most 5 letters and
# [SEP]. Two buckets, batches of 4: 24 prompts make 2 batches of 6 tokens and 4 of 8.
GENERATE = ["--max-new-tokens", 8, "--buckets", "6,8", "--batch-size", 4]


def run_predict(args, tmp_path, name, env=None):
    """`python -m xla_train predict ARGS` in a fresh process (fresh compilation counters), into
    tmp_path/NAME.jsonl, with `env` added; returns (the output's rows, the metrics)."""
    out, metrics = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-metrics.json"
    proc = cli("predict", [*args, "--output", out, "--metrics-out", metrics], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], json.loads(metrics.read_text())


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def cpu_greedy(learned_run, reverse_task, tmp_path_factory):
    _, model = learned_run
    return run_predict(["--backend", "cpu", "--model", model, "--input", reverse_task["held_out"], *GENERATE],
                       tmp_path_factory.mktemp("generate_cpu"), "held_out")


@pytest.fixture(scope="module")
def xla_greedy(learned_run, reverse_task, tmp_path_factory):
    """The 24 held-out prompts on XLA:CPU, 8 of them (4 of each bucket: every graph of the 24
    again), and the 24 under --strategy spmd on 4 XLA:CPU devices, each run in a fresh process."""
    _, model = learned_run
    tmp = tmp_path_factory.mktemp("generate_xla")
    rows = rows_of(reverse_task["held_out"])
    short = [r for r in rows if len(r["prompt"].split()) == 5][:4]  # reverse, 3 letters, =
    long = [r for r in rows if len(r["prompt"].split()) > 5][:4]
    eight = td.write_jsonl(tmp / "eight.jsonl", short + long)
    runs = {n: run_predict(["--backend", "xla", "--model", model, "--input", source, *GENERATE], tmp, n)
            for n, source in (("all", reverse_task["held_out"]), ("eight", eight))}
    runs["spmd"] = run_predict(["--backend", "xla", "--strategy", "spmd", "--model", model, "--input",
                                reverse_task["held_out"], *GENERATE], tmp, "spmd", {"CPU_NUM_DEVICES": "4"})
    return runs


def test_a_runs_test_file_is_completed_as_predict_completes_it(learned_run, cpu_greedy):
    """--test-file on a causal LM: the final model's completions of the held-out prompts in
    OUTPUT_DIR/predictions.jsonl, the rows predict writes from the same folder (the same entry,
    generation.complete; the run's buckets are its own, the tokens the same)."""
    m, out = learned_run
    assert m["predictions"] == f"{out}/predictions.jsonl"
    assert rows_of(out / "predictions.jsonl") == cpu_greedy[0]


def test_cpu_completions_reverse_the_held_out_lists(cpu_greedy, reverse_task):
    """Each row's completion is its list reversed. Not every one: the tiny model (3 epochs, eval
    loss about 0.03) still swaps two letters of a few five-letter lists (2 of these 24 on the
    CPU, always the same: greedy and seeded training)."""
    rows, m = cpu_greedy
    expected = rows_of(reverse_task["held_out"])
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in expected]  # input order, input columns
    right = sum(r["completion"].strip() == e["completion"].strip() for r, e in zip(rows, expected))
    assert right >= 21, [(r["prompt"], r["completion"]) for r in rows]
    assert m["rows"] == 24 and m["backend"] == "cpu" and "xla" not in m
    # each answer is 3 to 5 letters and the end-of-sequence token, which ends the row
    assert 24 * 4 <= m["tokens_generated"] <= 24 * 6 and m["tokens_per_s"] > 0


def test_xla_greedy_completions_equal_the_cpus(cpu_greedy, xla_greedy):
    assert xla_greedy["all"][0] == cpu_greedy[0]
    assert xla_greedy["all"][1]["tokens_generated"] == cpu_greedy[1]["tokens_generated"]


def test_spmd_over_four_devices_writes_the_single_devices_completions(xla_greedy):
    """--strategy spmd on 4 XLA:CPU devices: the run's data-parallel size is 4 and its completions
    and graph bound are the single device's. (The rows are split by the engine's input sharding,
    as a training run's and a classifier's predictions are; this test does not look inside the
    compiled graph to see the split.)"""
    rows, m = xla_greedy["spmd"]
    assert rows == xla_greedy["all"][0] and m["world_size"] == 4 and xla_greedy["all"][1]["world_size"] == 1
    assert m["xla"]["compiles"] <= 2 * 2 + 1 and m["xla"]["aten_fallbacks"] == 0, m["xla"]


def test_xla_compiles_two_graphs_per_bucket_whatever_the_prompts(xla_greedy):
    """Per bucket the prompt's pass and the one-token step, plus the one that gathers a batch's
    tokens (the same for every bucket): 5 graphs for 24 prompts (6 batches, 48 token steps) and
    for 8, the tokens copied to the host once."""
    xla = {n: m["xla"] for n, (_, m) in xla_greedy.items() if n != "spmd"}
    assert xla["all"]["compiles"] == xla["eight"]["compiles"] <= 2 * 2 + 1, xla
    assert xla["all"]["executions"] == 6 * 8 + 6  # a graph per token, one gather per batch
    assert xla["all"]["transfers"] == 1 and xla["all"]["aten_fallbacks"] == 0


def test_chat_rows_are_rendered_with_the_template(learned_run, reverse_task, tmp_path):
    """The model learned prompt/completion rows, not chat: only that every row gets a completion,
    in order, and the input's other columns stay."""
    _, model = learned_run
    prompts = [r["prompt"] for r in rows_of(reverse_task["held_out"])[:5]]
    chat = td.write_jsonl(tmp_path / "chat.jsonl", [{"id": i, "messages": [{"role": "user", "content": p}]}
                                                    for i, p in enumerate(prompts)])
    rows, m = run_predict(["--backend", "cpu", "--model", model, "--input", chat, "--max-new-tokens", 4], tmp_path,
                          "chat")
    assert [r["id"] for r in rows] == list(range(5)) and all(isinstance(r["completion"], str) for r in rows)
    assert rows[0]["messages"] == [{"role": "user", "content": prompts[0]}] and m["rows"] == 5


def test_an_adapter_folder_generates(reverse_task, tmp_path):
    proc, _ = run_cli(["--backend", "cpu", *reverse_args(reverse_task, "--lora", "--max-steps", 6),
                       "--output-dir", tmp_path / "lora"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    rows, m = run_predict(["--backend", "cpu", "--model", tmp_path / "lora", "--input", reverse_task["held_out"],
                           "--max-new-tokens", 3], tmp_path, "lora")
    assert len(rows) == 24 and m["rows"] == 24 and 24 <= m["tokens_generated"] <= 24 * 3


def _decoder(tmp, chat=True):
    return td.save("llama", tmp / "decoder", chat=chat, letters=True)


def _windowed(tmp, window=8):
    """A tiny Mistral whose sliding attention window is `window` tokens."""
    path = td.save("mistral", tmp / "mistral", letters=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
    return path


def _rows(tmp, rows):
    return td.write_jsonl(tmp / "in.jsonl", rows)


BAD = {  # name: (arguments after predict's --model/--input, message)
    "--max-new-tokens 0": (lambda tmp, c: [_decoder(tmp), _rows(tmp, [{"prompt": "a"}]), "--max-new-tokens", 0],
                           "--max-new-tokens must be at least 1"),
    "neither column": (lambda tmp, c: [_decoder(tmp), _rows(tmp, [{"text": "a b"}])],
                       "rows need a 'prompt' column, or a 'messages' column of chat turns"),
    "messages without a chat template": (
        lambda tmp, c: [_decoder(tmp, chat=False), _rows(tmp, [{"messages": [{"role": "user", "content": "a"}]}])],
        "messages need a chat template, and the model's tokenizer has none"),
    "--top-p without --temperature": (lambda tmp, c: [_decoder(tmp), _rows(tmp, [{"prompt": "a"}]), "--top-p", 0.9],
                                      "--top-p applies to sampling"),
    "past the model's positions": (
        lambda tmp, c: [_decoder(tmp), _rows(tmp, [{"prompt": "a b"}]), "--max-new-tokens", 600],
        "prompts of up to 3 tokens plus --max-new-tokens 600 pass the model's 512 positions"),
    "--text-columns for a causal LM": (
        lambda tmp, c: [_decoder(tmp), _rows(tmp, [{"prompt": "a"}]), "--text-columns", "prompt"],
        "--text-columns applies to classifiers"),
    "a cache longer than the sliding window on XLA": (
        lambda tmp, c: [_windowed(tmp), _rows(tmp, [{"prompt": "a"}]), "--backend", "xla", "--max-new-tokens", 8],
        "pass the model's sliding attention window (8)"),
    "--temperature for a classifier": (
        lambda tmp, c: [c, _rows(tmp, [{"sentence1": "a", "sentence2": "b"}]), "--temperature", 1],
        "--temperature applies to a causal LM's folder"),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xla) if "on XLA" in c else c for c in BAD])
def test_bad_generation_input(case, tiny_model, tmp_path, capsys):
    make, message = BAD[case]
    model, source, *extra = make(tmp_path, tiny_model)
    capsys.readouterr()  # the save's progress bar
    backend = [] if "--backend" in extra else ["--backend", "cpu"]
    code = main(["predict", *backend, "--model", model, "--input", source, "--output", tmp_path / "o.jsonl", *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("xla-train: error: "), err
    assert message in err


def test_eager_generation_leaves_the_models_generation_config(tmp_path):
    """transformers' `generate` runs with the package's settings only, and the model keeps its own
    generation config (a chat model's end-of-turn token), which the run saves with it at its end:
    --eval-samples on the CPU once wrote an empty one."""
    import torch
    from transformers import AutoModelForCausalLM

    from xla_train.core.generate import Sampling, eager_generate

    model = AutoModelForCausalLM.from_pretrained(td.save("llama", tmp_path / "llama", chat=True, letters=True))
    model.generation_config.eos_token_id = [2, 3]
    model.generation_config.top_k = 7
    before = model.generation_config.to_dict()
    tokens = eager_generate(model.eval(), torch.tensor([[1, 5, 6]]), torch.ones(1, 3, dtype=torch.long),
                            Sampling(4, (2,), 0))
    assert tokens.shape == (1, 4) and model.generation_config.to_dict() == before
