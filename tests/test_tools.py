"""`--tools`: GRPO's rollouts with tool calls (tasks/tools.py) in one preallocated cache
(kernels/generate.py Turns), on tests/tool_task.py's task.

The model is tool_machine's: a real tiny Qwen2 whose weights make it follow a script (a call of
`multiply(12, 13)`, a call of a tool that raises, a malformed call), so the loop's mechanics are
tested on the calls a model makes, not on calls handed to it."""

import json
import math
import sys

import pytest
import tool_machine as tm
import torch
from conftest import ROOT, assert_same_weights, resume_midway, run_cli

from xla_train.commands.cli import main

MULTIPLY = f"{ROOT / 'tests' / 'tool_task.py'}:multiply"
END = "<|im_end|>"
QUESTION = [{"role": "user", "content": "What is 12 times 13?"}]


@pytest.fixture(scope="module")
def tok():
    return tm.tokenizer()


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    """A file of tools: one that raises, one that cannot be described (no docstring)."""
    path = tmp_path_factory.mktemp("tools") / "more_tools.py"
    path.write_text('def divide(a: int, b: int) -> float:\n    """Divides.\n\n    Args:\n        a: The dividend.\n'
                    '        b: The divisor.\n    """\n    return a / b\n\n\ndef nodoc(a: int) -> int:\n    return a\n'
                    '\n\n'
                    'class NoReset:\n    def look(self) -> str:\n        """Looks."""\n        return ""\n\n\n'
                    'class NoTools:\n    def reset(self, **row):\n        return None\n\n\n'
                    'class Broken(NoReset):\n    def reset(self, **row):\n        raise KeyError("seed")\n\n\n'
                    'class Quiet(NoTools):\n    def look(self) -> str:\n        """Looks around."""\n'
                    '        return "nothing"\n')
    return path


def _loop(tok, script, budget, specs=(MULTIPLY,), iterations=None, prompts=(QUESTION, QUESTION[:1] * 2),
          stop_when_done=False):
    """The tool loop on left-padded chat prompts, greedy, on the CPU: what the host reads at its end."""
    from xla_train.kernels.generate import Sampling, Turns
    from xla_train.tasks.tools import Toolbox, ToolLoop

    toolbox = Toolbox(tuple(specs))
    toolbox.check(tok)
    ids = [tok.apply_chat_template(p, tools=toolbox.schemas, add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    longest = max(map(len, ids))
    padded = torch.tensor([[tok.pad_token_id] * (longest - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (longest - len(x)) + [1] * len(x) for x in ids])
    model = tm.model(tok, script)
    with torch.no_grad():
        turns = Turns(model, padded, mask, Sampling(budget, (tok.eos_token_id,), tok.pad_token_id), lambda: None,
                      chunk=8, stop_when_done=stop_when_done)
        return ToolLoop(tok, toolbox, iterations)(turns, padded, mask, lambda ts: [t.clone() for t in ts],
                                                  torch.arange(len(ids)))


def _suffix(tok, name="multiply", content="156"):
    from xla_train.tasks.tools import suffix_ids

    return suffix_ids(tok, [{"role": "tool", "name": name, "content": content}])


def test_parsing_is_trls(tok):
    """A call is parsed into TRL's message, its arguments typed by the tool's schema; a plain turn
    is its text; a malformed call stays text (TRL's parse_response), as does a call without a name."""
    import tool_task

    from xla_train.options import from_sections
    from xla_train.tasks.tools import parse, specs_of

    schemas = [tool_task.schema()]
    prefix = tok.apply_chat_template(QUESTION, tools=schemas, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)

    def parsed(text):
        return parse(tok, tok(text, add_special_tokens=False)["input_ids"], prefix, schemas)

    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 13}}}
    assert parsed(tm.CALL + END) == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert parsed(tm.CALL.replace("12", '"12"') + END)["tool_calls"] == [call]  # typed by the schema
    assert parsed("The product is 156." + END) == {"role": "assistant", "content": "The product is 156."}
    assert parsed(tm.MALFORMED + END) == {"role": "assistant", "content": tm.MALFORMED}
    nameless = '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'
    assert parsed(nameless + END) == {"role": "assistant", "content": nameless}
    assert specs_of(f" {MULTIPLY},x.py:f ") == (MULTIPLY, "x.py:f")
    recipe = {"data": {"problem": "grpo"}, "grpo": {"tools": [MULTIPLY, "x.py:f"]}}  # a YAML list
    assert specs_of(from_sections(recipe).kind_options().tools) == (MULTIPLY, "x.py:f")


def test_a_known_familys_response_template_comes_from_trl():
    """A tokenizer without a response template whose chat template TRL knows (Qwen 2.5's, as TRL
    ships it) gets TRL's (add_response_schema) and parses calls; an unknown one is one line."""
    import importlib.util
    from pathlib import Path

    from xla_train.core.errors import UserError
    from xla_train.tasks.tools import Toolbox, parse

    pytest.importorskip("trl", reason="the agents extra (make test's environment has it; .venv-torch does not)")
    tok = tm.tokenizer()
    tok.response_template = None
    trl = Path(importlib.util.find_spec("trl").submodule_search_locations[0])
    tok.chat_template = (trl / "chat_templates" / "qwen2_5.jinja").read_text()
    toolbox = Toolbox((MULTIPLY,))
    toolbox.check(tok)
    assert tok.response_template is not None
    prefix = tok.apply_chat_template(QUESTION, tools=toolbox.schemas, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    call = parse(tok, tok(tm.CALL + END, add_special_tokens=False)["input_ids"], prefix, toolbox.schemas)
    assert call["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 12, "b": 13}}
    tok = tm.tokenizer()
    tok.response_template = None
    with pytest.raises(UserError, match="add_response_schema does not know its chat template"):
        Toolbox((MULTIPLY,)).check(tok)


def test_a_tool_turn_is_appended_and_out_of_the_loss(tok):
    """The model calls multiply; the result is rendered as the template's tool turn after the call's
    end of turn, generation resumes after it in the same cache, and a second call is parsed but not
    run (--max-tool-calling-iterations 1). The result's tokens are the row's, not the model's; the
    completion is TRL's list of turns; one call per completion, none failed. Stopping each turn
    once every row has ended (eager devices) leaves the same rollout."""
    suffix = _suffix(tok)
    script = {"Ċ": {tm.CALL: 30.0}, tm.CALL: {END: 30.0}}
    played = _loop(tok, script, 60, iterations=1)
    stopped = _loop(tok, script, 60, iterations=1, stop_when_done=True)
    assert torch.equal(stopped.tokens, played.tokens) and torch.equal(stopped.made, played.made)
    assert (stopped.lengths, stopped.completions) == (played.lengths, played.completions)
    call_ids = tok.convert_tokens_to_ids([tm.CALL, END])
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 13}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    for r in range(2):
        n = played.lengths[r]
        assert n == 4 + len(suffix)
        assert played.tokens[r, :n].tolist() == call_ids + suffix + call_ids
        assert played.made[r].tolist() == [True] * 2 + [False] * len(suffix) + [True] * 2 + [False] * (60 - n)
        assert played.completions[r] == [turn, {"role": "tool", "name": "multiply", "content": "156"}, turn]
    assert (played.calls.made, played.calls.failed) == (2, 0)
    assert played.calls.frequencies(2) == [1.0, 0.0]
    assert played.extra.tolist() == [0, 1]


def test_raising_tools_unknown_tools_and_malformed_calls_are_failures_or_text(tok, tools_file):
    """A tool that raises: its error is the result and a failure, and the loop goes on; a call of no
    known tool fails too; a malformed call is the turn's text and nothing runs."""
    script = {"Ċ": {tm.FAILING: 30.0}, tm.FAILING: {END: 30.0}}
    room = 2 * len(_suffix(tok, "divide", "{'error': 'division by zero'}")) + 6  # two calls and results, a call
    played = _loop(tok, script, room, specs=(MULTIPLY, f"{tools_file}:divide"), iterations=2)
    results = [t for t in played.completions[0] if t["role"] == "tool"]
    assert len(results) == 2 and results[0]["content"] == "{'error': 'division by zero'}", results
    assert (played.calls.made, played.calls.failed) == (4, 4)
    assert played.calls.frequencies(2) == [2.0, 1.0]
    played = _loop(tok, script, room, iterations=1)  # divide is not among the tools
    assert played.completions[0][1]["content"] == "{'error': 'Tool divide not found.'}"
    assert (played.calls.made, played.calls.failed) == (2, 2)
    played = _loop(tok, {"Ċ": {tm.MALFORMED: 30.0}, tm.MALFORMED: {END: 30.0}}, 20)
    assert played.completions == [[{"role": "assistant", "content": tm.MALFORMED}]] * 2
    assert played.lengths == [2, 2] and played.calls.made == 0 and played.made[:, :2].all()


def test_the_shipped_calculator_is_described_evaluates_and_refuses_code():
    """xla_train.tools:calculator, the GSM8K recipes' tool: described from its docstring as the SFT
    recipe's traces describe it, GSM8K's annotations evaluated (its thousands' commas too), and
    anything but numbers and + - * / refused by raising (a failed call in the loop)."""
    from xla_train.tasks.tools import Toolbox
    from xla_train.tools import calculator

    schema = Toolbox(("xla_train.tools:calculator",)).schemas[0]["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    assert [calculator(e) for e in ("48/2", "2*(3+4.5)", "1,000-1", "-5+2", "7/3")] == [
        "24", "15", "999", "-3", "2.333333333"]
    for code in ("__import__('os')", "2**10", "x+1", "[1]"):
        with pytest.raises(ValueError, match="only numbers"):
            calculator(code)


def test_the_budget_counts_the_tools_results(tok):
    """--max-completion-length counts every token after the prompt, as TRL 1.16's: a result that
    would not fit is dropped and the row ends with its call (TRL's rollback; the call still
    counts); one that fits exactly ends the row with no room for another turn."""
    suffix = _suffix(tok)
    script = {"Ċ": {tm.CALL: 30.0}, tm.CALL: {END: 30.0}}
    played = _loop(tok, script, 2 + len(suffix) - 1)
    assert played.lengths == [2, 2] and [len(c) for c in played.completions] == [1, 1]
    assert played.calls.made == 2
    played = _loop(tok, script, 2 + len(suffix))
    assert played.lengths == [2 + len(suffix)] * 2 and [len(c) for c in played.completions] == [2, 2]
    assert not played.made[:, 2:].any()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_resumed_generation_is_generation_from_the_whole_row(family):
    """Turns: generation that stops, takes appended tokens (in chunks of 4 here) and resumes in the
    same cache writes the tokens transformers' `generate` writes from the whole row (prompt, the
    completion so far, the appended tokens), row by row, past a sliding window of 8 (Gemma 3's
    sliding layers: a ring of the window and a chunk less one); without appending, static_generate's
    tokens (the same generator with chunks of 16: a ring of another size)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_generate import _left_padded_prompts, _loop_model

    from xla_train.kernels.generate import Sampling, Turns, eager_generate, static_generate

    model = _loop_model(family)
    ids, mask = _left_padded_prompts()
    sampling = Sampling(30, (2,), 0)
    with torch.no_grad():
        turns = Turns(model, ids, mask, sampling, lambda: None, chunk=4)
        turns.decode(29)
        assert torch.equal(turns.tokens, static_generate(model, ids, mask, sampling, lambda: None))
        # sampled, the same draws and each drawn token's log-probability (GRPO's sampling/* metrics)
        sampled = Sampling(30, (2,), 0, temperature=0.7)
        torch.manual_seed(0)
        turns = Turns(model, ids, mask, sampled, lambda: None, chunk=4, logps=True)
        turns.decode(29)
        torch.manual_seed(0)
        tokens, drawn = static_generate(model, ids, mask, sampled, lambda: None, logps=True)
        assert torch.equal(turns.tokens, tokens) and (drawn < 0).any()
        torch.testing.assert_close(turns.drawn, drawn, rtol=0, atol=1e-5)  # rings of other sizes: sums in another order
        turns = Turns(model, ids, mask, sampling, lambda: None, chunk=4)
        turns.decode(5)
        tokens, made, cur, done = (t.clone() for t in turns.state())
        appended, feeds, rows = {0: [7, 8, 9, 10, 11, 12], 2: [13, 14]}, [], {}
        for r in range(3):
            if r not in appended or done[r]:
                feeds.append([])
                done[r] = 1
                continue
            c, extra = int(cur[r]), appended[r]
            rows[r] = tokens[r, :c].tolist() + extra
            feeds.append([int(tokens[r, c - 1]), *extra])
            tokens[r, c:c + len(extra)], made[r, c:c + len(extra)], cur[r] = torch.tensor(extra), 0, c + len(extra)
        assert len(rows) == 2
        turns.resume(tokens, made, cur, done, feeds)
        turns.decode(20)
        for r, row in rows.items():
            prompt = ids[r, mask[r].bool()].tolist()
            n = int(turns.cur[r]) - len(row)
            whole = torch.tensor([prompt + row])
            expected = eager_generate(model, whole, torch.ones_like(whole), Sampling(n, (2,), 0))[0, :n]
            assert turns.tokens[r, len(row):len(row) + n].tolist() == expected.tolist()
            kinds = [True] * (len(row) - len(appended[r])) + [False] * len(appended[r]) + [True] * n
            assert turns.made[r].tolist() == kinds + [False] * (30 - len(kinds))
        assert turns.tokens[1].tolist() == tokens[1].tolist()  # a row that does not resume is left as it was


def test_the_tools_results_carry_no_gradient(tok):
    """The update's rows hold the tools' results (the model reads them) but their tokens are out of
    the loss: the gradient at the positions that predict them is exactly zero, and not elsewhere."""
    from xla_train.core.engine import Engine
    from xla_train.tasks.documents import IGNORE
    from xla_train.tasks.grpo import GroupObjective, GRPOOptions, Rollouts

    script = {"Ċ": {tm.CALL: 30.0}, tm.CALL: {END: 30.0}}
    played = _loop(tok, script, 60, iterations=1)
    settings = GRPOOptions(max_completion_length=60, tools=MULTIPLY, num_generations=2)
    objective = GroupObjective(settings=settings)
    model = tm.model(tok, script)
    source = Rollouts(objective, Engine("cpu"), tok, {"train": None}, model)
    ids = torch.tensor([tok.apply_chat_template(QUESTION, tools=source.loop.toolbox.schemas, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)] * 2)
    lengths = torch.tensor(played.lengths)
    kept = torch.arange(60)[None] < lengths[:, None]
    scored = (torch.tensor([1.0, -1.0]), torch.zeros(0), torch.zeros(2), torch.zeros(2, 0))
    batch = source.batch(ids, torch.ones_like(ids), played.tokens, scored, True,
                         (played.made, kept, torch.ones(2, 1, dtype=torch.bool)))
    rollout = batch.pop("labels")
    output = objective.forward(model, batch)
    output.head.hidden.retain_grad()
    objective.loss(output, rollout).backward()
    grad = output.head.hidden.grad.abs().sum(-1)[:, ids.shape[1] - 1:-1]  # the positions predicting the completion
    tool = ~played.made & kept
    assert (rollout.labels[:, ids.shape[1] - 1:-1][tool] == IGNORE).all()
    assert (grad[tool] == 0).all() and (grad[played.made] > 0).all()


# ---------------------------------------------------------------------------------------------
# Runs


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The scripted model (its first turn a call of multiply or a malformed call, even odds, each
    ending its turn) and tool_task's prompts: 16 to train on, 8 held out."""
    import tiny_decoders as td
    import tool_task

    folder = tmp_path_factory.mktemp("tool_task")
    script = {"Ċ": {tm.CALL: 30.0, tm.MALFORMED: 30.0}, tm.CALL: {END: 30.0}, tm.MALFORMED: {END: 30.0}}
    return {"model": tm.save(folder / "model", script), "folder": folder,
            "train": td.write_jsonl(folder / "train.jsonl", tool_task.tool_rows(16, 1, "prompts")),
            "validation": td.write_jsonl(folder / "validation.jsonl", tool_task.tool_rows(8, 2, "prompts"))}


def tool_args(task, *extra):
    return ["--backend", "cpu", "--problem", "grpo", "--model", task["model"], "--train-file", task["train"],
            "--validation-file", task["validation"], "--reward", "xla_train.rewards:number_match", "--tools", MULTIPLY,
            "--max-tool-calling-iterations", 1, "--num-generations", 4, "--batch-size", 8,
            "--max-completion-length", 64, "--max-length", 48, "--no-data-cache", "--max-steps", 2, "--log-every", 1,
            *extra]


def _check_run(m):
    """Both steps called the tool from about half their completions (the script's odds), none
    failed; the completions' lengths count the model's tokens only (a call and its end: 2, then
    the second turn's 2), not the tool's result."""
    assert m["steps"] == 2 and all(math.isfinite(loss) for _, loss, _ in m["train_loss"]), m["train_loss"]
    for _, metrics in m["train_metrics"]:
        assert 0 < metrics["tools/call_frequency"] < 1 and metrics["tools/failure_frequency"] == 0, metrics
        assert metrics["completions/max_length"] <= 4, metrics
    assert m["eval"]["n"] == 8 and math.isfinite(m["eval"]["reward"])


def _check_sampler(m, bound=1e-5):
    """The sampler is the trainer across tool turns: the log-probabilities the decode graph drew the
    model's tokens with are the update's (tool results are out of both), to `bound`."""
    differences = [metrics["sampling/sampling_logp_difference/max"] for _, metrics in m["train_metrics"]]
    print("sampling/sampling_logp_difference/max", differences)
    assert all(0 <= d <= bound for d in differences), differences


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_grpo_run_calls_the_tool(task, tmp_path, precision):
    """A short GRPO run on the CPU with --tools tests/tool_task.py:multiply: the model's calls are
    run, their results appended, the metrics logged under TRL's names; the rollout in the update's
    precision (bf16 autocast: within bf16's rounding, as tests/test_grpo.py's bound)."""
    proc, m = run_cli(tool_args(task, "--precision", precision), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(m)
    _check_sampler(m, 0.1 if precision == "bf16" else 1e-5)


@pytest.mark.parametrize("where", ["cpu", pytest.param("xla-fsdp-4", marks=pytest.mark.slow)])
def test_an_environment_is_made_per_completion_and_reset_per_rollout(task, tmp_path, where):
    """--environment tests/tool_task.py:Ledger, without --tools or --reward (TRL's
    environment_factory): its `multiply` is the tool, its get_reward (its calls since its reset)
    the reward. That reward equals the calls per completion at every step only if each completion
    has an instance of its own, reset before each rollout; the reward functions get the instances
    (each completion's own: it called the tool where its instance counted a call) and the prompts
    with reset's text appended. --eval-samples go through the same loop: each sample's turns,
    scored as the evaluation scores them. On the CPU, and under FSDPv2 on 4 XLA:CPU devices (the
    rows sharded over them, the tool turns' tokens copied back whole)."""
    import tool_task

    rewards = tmp_path / "env_rewards.py"
    rewards.write_text("def told(prompts, environments, **kw):\n"
                       f"    return [float(p[-1]['content'].endswith({tool_task.Ledger.NOTE!r})"
                       " and e.answer is not None) for p, e in zip(prompts, environments)]\n\n\n"
                       "def agree(completions, environments, **kw):\n"
                       "    return [float(any(t['role'] == 'tool' for t in c) == (e.calls > 0))"
                       " for c, e in zip(completions, environments)]\n")
    args = tool_args(task, "--environment", f"{ROOT / 'tests' / 'tool_task.py'}:Ledger", "--reward",
                     f"{rewards}:told", "--reward", f"{rewards}:agree", "--eval-samples", 3, "--output-dir",
                     tmp_path / "run")
    del args[args.index("--tools"):args.index("--tools") + 2]
    del args[args.index("xla_train.rewards:number_match") - 1:args.index("xla_train.rewards:number_match") + 1]
    env = None
    if where == "xla-fsdp-4":
        args[args.index("cpu")] = "xla"
        args += ["--strategy", "fsdp"]
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_USE_SPMD": "1"}
    proc, m = run_cli(args, tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for _, metrics in m["train_metrics"]:
        assert 0 < metrics["tools/call_frequency"] < 1, metrics
        assert metrics["rewards/told/mean"] == 1 and metrics["rewards/agree/mean"] == 1, metrics
        assert metrics["rewards/Ledger/mean"] == pytest.approx(metrics["tools/call_frequency"]), metrics
    assert m["eval"]["rewards/told/mean"] == 1 and m["eval"]["rewards/agree/mean"] == 1, m["eval"]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step-2.jsonl").read_text().splitlines()]
    assert len(samples) == 3
    for sample in samples:
        turns = sample["completion"]
        assert turns[0]["role"] == "assistant" and sample["rewards/told"] == sample["rewards/agree"] == 1, sample
        assert sample["rewards/Ledger"] == sum(t["role"] == "tool" for t in turns), sample
        assert sample["reward"] == pytest.approx(2 + sample["rewards/Ledger"]), sample


def test_environments_by_name_keep_their_own_instances_and_classes(tools_file, tmp_path):
    """One factory under two names makes two pools (TRL calls it per name), and a get_reward scores
    the rows of its exact class only: another class of the same name, without one, is None there."""
    from xla_train.tasks.rewards import Reward
    from xla_train.tasks.tools import ENVIRONMENT_REWARD, Environments, Toolbox

    other = tmp_path / "other.py"
    other.write_text(tools_file.read_text().replace("class Quiet(NoTools)", "class Ledger(NoTools)"))
    ledger = f"{ROOT / 'tests' / 'tool_task.py'}:Ledger"
    box = Toolbox((), f"a={ledger},b={ledger},c={other}:Ledger")
    pool = Environments(box)
    rows = [{"prompt": QUESTION, "answer": "156", "environment": name, "_where": name} for name in "abc"]
    instances, _ = pool.reset(rows)
    assert len({id(i) for i in instances}) == 3 and pool.pools["a"][0] is not pool.pools["b"][0]
    (owner, (shown, _)), = box.rewarded.items()  # one class of the three owns a reward
    instances[0].calls, instances[1].calls = 2, 3
    reward = Reward(shown, ENVIRONMENT_REWARD, owner=owner)
    assert shown == "Ledger" and reward.function(completions=[[]] * 3, environments=instances) == [2.0, 3.0, None]


def test_each_row_takes_the_environment_its_column_names(task, tools_file, tmp_path):
    """Two environments by name (TRL's dict): rows alternate between tool_task.Ledger (whose
    `multiply` the model calls) and a Quiet one (whose only tool is `look`). Each row's prompt
    lists its own environment's tools; a call reaches the row's own instance (Ledger's counted,
    Quiet's a failure: no such tool there); Ledger's get_reward scores its rows only."""
    import datasets
    import tiny_decoders as td
    import tool_task

    from xla_train.tasks.grpo import PromptRows

    rows = [{**row, "environment": ("ledger", "quiet")[i % 2]} for i, row in enumerate(tool_task.tool_rows(16, 1,
                                                                                                          "prompts"))]
    train = td.write_jsonl(tmp_path / "train.jsonl", rows)
    spec = f"ledger={ROOT / 'tests' / 'tool_task.py'}:Ledger,quiet={tools_file}:Quiet"
    tok = tm.tokenizer()
    data, _ = PromptRows("conversational", None, 4, (), spec).tokenize(
        {"train": datasets.Dataset.from_list(rows[:2])}, tok, 64)
    ledger, quiet = (tok.decode(ids) for ids in data["train"]["input_ids"])
    assert "<tools> multiply</tools>" in ledger and "<tools> look</tools>" in quiet, (ledger, quiet)
    rewards = tmp_path / "routed.py"
    rewards.write_text("def routed(completions, environments, environment, **kw):\n"
                       "    out = []\n"
                       "    for c, e, name in zip(completions, environments, environment):\n"
                       "        results = [t['content'] for t in c if t['role'] == 'tool']\n"
                       "        ok = type(e).__name__.lower() == name\n"
                       "        if name == 'ledger':\n"
                       "            ok = ok and (e.calls > 0) == bool(results)"
                       " and not any('error' in r for r in results)\n"
                       "        else:\n"
                       "            ok = ok and all('not found' in r for r in results)\n"
                       "        out.append(float(ok))\n"
                       "    return out\n")
    args = tool_args({**task, "train": train}, "--environment", spec, "--reward", f"{rewards}:routed",
                     "--max-steps", 4)
    del args[args.index("--tools"):args.index("--tools") + 2]
    del args[args.index("xla_train.rewards:number_match") - 1:args.index("xla_train.rewards:number_match") + 1]
    args[args.index("--validation-file") + 1] = train
    proc, m = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [metrics for _, metrics in m["train_metrics"]]
    assert all(s["rewards/routed/mean"] == 1 for s in steps), steps
    # Quiet's rows' calls failed and Ledger's counted, in the steps that held them
    assert any(s["tools/failure_frequency"] > 0 for s in steps) and any(s["rewards/Ledger/mean"] > 0 for s in steps)
    assert m["eval"]["rewards/routed/mean"] == 1, m["eval"]


@pytest.mark.slow
def test_xla_compiles_a_bounded_number_of_graphs_across_tool_turns(task, tmp_path):
    """The run on XLA:CPU over 2 epochs of 8 prompts, its tool an environment's (tool_task.Ledger,
    whose reset appends to the prompts: rendered again at --max-length): the prompt's pass, the
    one-token step and the appended chunk's pass (training's and evaluation's shapes), the step's
    graphs: none after the first epoch, whatever the turns; no aten fallback; a host transfer per
    turn and the row numbers' for the resets."""
    import tiny_decoders as td
    import tool_task

    train = td.write_jsonl(tmp_path / "train.jsonl", tool_task.tool_rows(8, 3, "prompts"))
    args = tool_args({**task, "train": train}, "--epochs", 2, "--max-steps", 8)
    args[args.index("--tools") + 1] = f"{ROOT / 'tests' / 'tool_task.py'}:Ledger"
    args[args.index("--tools")] = "--environment"
    args[args.index("cpu")] = "xla"
    proc, m = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla = m["xla"]
    assert xla["compiles"] <= 16 and xla["compiles_after_first_epoch"] == 0 and xla["aten_fallbacks"] == 0, xla
    # the rows for the resets, a transfer for the first turn and one for the second (--max-tool-calling-iterations
    # 1), and the log point's
    assert xla["host_syncs_per_step"] <= 4, xla
    assert m["steps"] == 8
    for _, metrics in m["train_metrics"]:
        assert 0 < metrics["tools/call_frequency"] < 1, metrics
        assert metrics["rewards/Ledger/mean"] == pytest.approx(metrics["tools/call_frequency"]), metrics
    _check_sampler(m)


def test_mistakes_with_tools_are_one_line(task, tools_file, tmp_path, capsys):
    """A tool that cannot be described, a chat template that cannot render tools, --tools on
    another kind, --max-tool-calling-iterations without tools, --tools on text prompts; an
    environment without a reset, without tools, whose reset raises (at the first rollout), several
    of them not all named, a row naming none of them: one line each."""
    import tiny_decoders as td

    plain = tmp_path / "plain"
    tm.save(plain, {})
    tok = td.family_tokenizer("qwen2")  # Qwen3's template as the tests shape it: no tools
    tok.save_pretrained(plain)
    capsys.readouterr()
    text = td.write_jsonl(tmp_path / "text.jsonl", [{"prompt": "What is 2 times 3?", "answer": "6"}] * 4)
    cases = [
        (["--tools", f"{tools_file}:nodoc"], f"--tools {tools_file}:nodoc: the chat template cannot be told about it"),
        (["--tools", "nowhere.py:f"], "--tools nowhere.py:f: no such file nowhere.py"),
        (["--model", plain], "--tools: the chat template does not render tools ("),
        (["--train-file", text, "--validation-file", text], "--tools needs chat prompts"),
        (["--environment", f"{tools_file}:NoReset"], f"--environment {tools_file}:NoReset: NoReset has no reset"),
        (["--environment", f"{tools_file}:NoTools"], f"--environment {tools_file}:NoTools: NoTools has no public"),
        (["--environment", f"{tools_file}:Broken"], f"--environment {tools_file}:Broken: reset raised KeyError: "
                                                    f"'seed' ({task['train']}: row "),
        (["--environment", f"a={tools_file}:Quiet", "--environment", f"{tools_file}:Quiet"],
         f"--environment {tools_file}:Quiet: with several environments, name each NAME=module:Class"),
        (["--environment", f"a={tools_file}:Quiet"], "row 1: 'environment' must name one of --environment's (a)"),
    ]
    for extra, message in cases:
        assert main(["train", *map(str, tool_args(task, *extra))]) == 2, extra
        err = capsys.readouterr().err
        lines = [line for line in err.split("\n")[:-1] if not line.startswith("\r")]  # the progress bar's: \r
        assert len(lines) == 1 and message in lines[0], (extra, err)
    assert main(["train", "--backend", "cpu", "--tools", MULTIPLY]) == 2
    assert "--tools applies to --problem grpo" in capsys.readouterr().err
    args = tool_args(task)
    del args[args.index("--tools"):args.index("--tools") + 2]
    assert main(["train", *map(str, args)]) == 2
    assert "--max-tool-calling-iterations applies to rollouts with --tools or --environment" in capsys.readouterr().err


@pytest.mark.slow
def test_tool_turns_stay_in_step_over_processes_whose_forwards_meet(task, tmp_path):
    """Under FSDP2 over two gloo processes every forward pass calls collectives, and each process
    runs its own rows' tool turns: here results of 0 to 40 tokens (the row's answer's), so the
    processes' rows need different chunks and decode steps, and one may have no row to resume.
    They take as many as the one that needs most (else gloo aborts on mismatched collectives), and
    so do --eval-samples' completions (every process completes every sample)."""
    uneven = tmp_path / "uneven.py"
    uneven.write_text("class Uneven:\n"
                      "    def reset(self, answer, **row):\n"
                      "        self.n = int(answer) % 41\n\n"
                      "    def multiply(self, a: int, b: int) -> str:\n"
                      '        """Multiplies two integers.\n\n        Args:\n            a: The first factor.\n'
                      '            b: The second factor.\n        """\n'
                      "        return '7' * self.n\n")
    args = tool_args(task, "--strategy", "fsdp", "--num-processes", 2, "--max-steps", 4, "--eval-samples", 3,
                     "--output-dir", tmp_path / "run")
    args[args.index("--tools"):args.index("--tools") + 2] = ["--environment", f"{uneven}:Uneven"]
    proc, m = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["steps"] == 4 and all(0 < s["tools/call_frequency"] < 1 for _, s in m["train_metrics"]), m
    samples = (tmp_path / "run" / "samples" / "step-4.jsonl").read_text().splitlines()
    assert len(samples) == 3 and all(json.loads(line)["completion"][0]["role"] == "assistant" for line in samples)


@pytest.mark.slow
@pytest.mark.parametrize("tools", ["--tools", "--environment"])
def test_resumed_midway_a_multi_turn_run_is_exact(task, tmp_path, tools):
    """Resumed from its step-4 checkpoint, with tool turns in every rollout and a reward for
    calling the tool (so the weights move): the resumed run ends with the weights, metrics and
    evaluation of an uninterrupted one (the sampling generator's state comes back with the
    checkpoint; the tool loop keeps nothing between steps; an environment's pool is made again,
    tool_task.Ledger resetting all it holds)."""
    rewards = tmp_path / "tool_rewards.py"
    rewards.write_text("def used_tool(completions, **kw):\n"
                       "    return [float(any(t['role'] == 'tool' for t in c)) for c in completions]\n")
    args = tool_args(task, "--max-steps", 7, "--save-every", 4, "--lr", 1e-2)
    args[args.index("xla_train.rewards:number_match")] = f"{rewards}:used_tool"
    if tools == "--environment":
        args[args.index("--tools"):args.index("--tools") + 2] = ["--environment",
                                                                 f"{ROOT / 'tests' / 'tool_task.py'}:Ledger"]
    proc, whole = run_cli([*args, "--output-dir", tmp_path / "whole"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = resume_midway(args, tmp_path / "whole", tmp_path / "run", tmp_path)
    assert resumed["steps"] == 7
    assert_same_weights(tmp_path / "run", tmp_path / "whole", atol=0)
    assert resumed["eval"] == whole["eval"] and resumed["train_metrics"][-1] == whole["train_metrics"][-1]
    assert whole["train_metrics"][-1][1]["tools/call_frequency"] > 0
