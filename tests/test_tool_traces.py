"""SFT on tool-calling traces (issue 64, item 2): causal-lm rows in TRL's SFT form (`messages` with
an assistant `tool_calls` turn and a `tool` turn, and a `tools` column) rendered with the tools by a
tiny Qwen3 tokenizer carrying Qwen3's real chat template (TRL 1.16's copy); the loss on the
assistant's turns only (the call and the final answer); plain multi-turn chats with the same
template as before; the bad inputs as one line each; and a tiny model taught by the package's own
SFT on traces that calls the tool for new questions (conftest's `tool_caller`, which the GRPO
tests start from)."""

import json
import re
import sys

import pytest
import tiny_decoders as td
import tool_task

from xla_train.core.errors import UserError
from xla_train.tasks.causal_lm import IGNORE, chat, documents, prompt_ids


@pytest.fixture(scope="module")
def trl_templates():
    """TRL's module of chat templates: the published ones, as TRL 1.16 copies them (the dev
    extra; xla-train[agents]). Imported when a test needs it, not at collection."""
    return pytest.importorskip("trl.chat_template_utils")


@pytest.fixture(scope="module")
def qwen3(trl_templates):
    """The tiny Qwen3 tokenizer with Qwen3's own chat template (tools, thinking), as published."""
    tok = td.family_tokenizer("qwen3")
    tok.chat_template = trl_templates.qwen3_chat_template
    return tok


def runs_of(tok, ids, trained):
    """The trained stretches of a document, as text."""
    return [tok.decode(r) for r in td.trained_runs(ids, trained)]


def test_a_trace_trains_the_call_and_the_answer_and_not_the_tool_result(qwen3):
    """Qwen3's template renders a tool-calling turn without its empty thought once the tool's
    result follows, so the prefix rule cannot find it; TRL's training template (its markers) does.
    Trained: exactly the two assistant turns, each with its end of turn; not the question, not
    the system prompt listing the tool, not the tool's result."""
    row = tool_task.tool_rows(1, 0)[0]
    messages, tools = row["messages"], json.loads(row["tools"])
    a, b = messages[1]["tool_calls"][0]["function"]["arguments"].values()
    own = qwen3.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert not qwen3.apply_chat_template(messages, tools=tools, tokenize=False).startswith(own)  # the rule fails

    ids, trained = chat(messages, qwen3, "row 1", tools)
    empty = "<think>\n\n</think>\n\n"
    assert runs_of(qwen3, ids, trained) == [
        f'{empty}<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>\n',
        f"{empty}The product is {a * b}.<|im_end|>\n"]
    text = qwen3.decode(ids)
    assert '"name": "multiply", "description"' in text  # the tool's schema, in the system prompt (untrained)
    assert f"<tool_response>\n{a * b}\n</tool_response>" in text  # the tool's result (untrained)

    # the question's prompt for generation (predict, --eval-samples, GRPO) is how training saw it begin
    prompt = prompt_ids({"messages": messages[:1], "tools": row["tools"]}, "messages", qwen3, "row 1")
    assert ids[:len(prompt)] == prompt and qwen3.decode(prompt).endswith("<|im_start|>assistant\n")

    # as causal-lm documents (labels shifted), from a split of such rows: the tools column is a JSON string
    import datasets

    plain = {"messages": td.reverse_rows(1, 0, "messages")[0]["messages"], "tools": ""}  # a row without tools
    ((doc_ids, labels), (plain_ids, _)), _, _ = documents(datasets.Dataset.from_list([row, plain]), "messages",
                                                          qwen3, 1024, "t.jsonl")
    assert doc_ids == ids and labels == [n if t else IGNORE for n, t in zip(ids[1:], trained[1:])] + [IGNORE]
    assert plain_ids == chat(plain["messages"], qwen3, "row 2")[0]


def test_predict_renders_a_rows_tools(qwen3, tmp_path):
    """`xla-train predict`'s input (and a run's --test-file): a `messages` row's `tools` column is
    rendered into its prompt, as training rendered it."""
    from xla_train.tasks.completion import read_prompts

    row = tool_task.tool_rows(1, 5)[0]
    question = {"messages": row["messages"][:1], "tools": row["tools"]}
    prompts = read_prompts(td.write_jsonl(tmp_path / "questions.jsonl", [question]), qwen3, 2048)
    ids = prompts.data["input_ids"][0]
    assert ids == prompt_ids(question, "messages", qwen3, "row 1") and '"name": "multiply"' in qwen3.decode(ids)


def test_plain_multi_turn_chats_with_qwen3s_template_keep_the_prefix_rule(qwen3, monkeypatch):
    """Two exchanges without tools: both answers trained, each with its end of turn, found without
    TRL (the earlier turn by the prefix rule, the last one, with its empty thought, by its text)."""
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)  # no TRL: the prefix rule alone
    rows = td.reverse_rows(2, 1, "messages")
    ids, trained = chat(rows[0]["messages"] + rows[1]["messages"], qwen3, "row 1")
    first, last = runs_of(qwen3, ids, trained)
    assert first.split() == [*rows[0]["messages"][1]["content"].split()[:-1],
                             rows[0]["messages"][1]["content"].split()[-1] + "<|im_end|>"]
    assert last.endswith(rows[1]["messages"][1]["content"] + "<|im_end|>\n")


@pytest.mark.parametrize("template", ["qwen2_5", "llama3_1", "gptoss"])
def test_templates_that_keep_earlier_turns_need_no_markers(template, trl_templates, monkeypatch):
    """Qwen2.5's, Llama 3.1's and gpt-oss's templates (TRL's copies) render a trace's earlier turns
    as the start of later ones: the prefix rule finds the call and the answer, without TRL, and
    trains each with its end of turn (gpt-oss's <|call|>, then <|return|>)."""
    tok = td.family_tokenizer("qwen3")
    tok.chat_template = getattr(trl_templates, f"{template}_chat_template")
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)
    row = tool_task.tool_rows(1, 0)[0]
    ids, trained = chat(row["messages"], tok, "row 1", json.loads(row["tools"]))
    call, answer = runs_of(tok, ids, trained)
    assert '"a": 60, "b": 64}' in call and answer.startswith(("The product is 3840.", "<|channel|>final"))
    assert call.endswith(("<|im_end|>\n", "<|eot_id|>", "<|call|>")), call


def test_a_template_with_its_own_markers_needs_no_trl(trl_templates, monkeypatch):
    """A tokenizer whose own template carries {% generation %} markers (here TRL's Qwen3 training
    template, saved as the model's) is read by them, with TRL not installed."""
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)
    tok = td.family_tokenizer("qwen3")
    tok.chat_template = trl_templates.qwen3_training_chat_template
    row = tool_task.tool_rows(1, 3)[0]
    ids, trained = chat(row["messages"], tok, "row 1", json.loads(row["tools"]))
    assert len(runs_of(tok, ids, trained)) == 2


def test_bad_traces_are_one_line(qwen3, trl_templates, monkeypatch):
    row = tool_task.tool_rows(1, 0)[0]
    tools = json.loads(row["tools"])
    # the tiny tokenizers' trimmed Qwen3 template renders neither the tools nor the calls
    with pytest.raises(UserError, match=r"row 1: the chat template does not render tools \('multiply'"):
        chat(row["messages"], td.family_tokenizer("qwen3"), "row 1", tools)
    gemma3 = td.family_tokenizer("qwen3")
    gemma3.chat_template = trl_templates.gemma3_chat_template  # it knows no tool role
    with pytest.raises(UserError, match="row 1: the chat template refuses these turns: Conversation roles must alt"):
        chat(row["messages"], gemma3, "row 1", tools)
    import datasets

    for bad, message in ((dict(row, tools="[{"), "'tools' is not JSON"),
                         (dict(row, tools='{"name": "multiply"}'), "'tools' must be a list of the tools' JSON")):
        with pytest.raises(UserError, match=message):
            documents(datasets.Dataset.from_list([bad]), "messages", qwen3, 1024, "t.jsonl")
    from xla_train.tasks.causal_lm import form_of

    with pytest.raises(UserError, match="a 'tools' column goes with 'messages' rows"):
        form_of(datasets.Dataset.from_list([{"text": "x", "tools": "[]"}]), "t.jsonl")
    # Qwen3's own template, no markers, no TRL: the line names the extra
    monkeypatch.setitem(sys.modules, "trl.chat_template_utils", None)
    from xla_train.tasks import documents as module

    monkeypatch.setattr(module, "_TRAINING_TEMPLATES", {})
    with pytest.raises(UserError, match=r"assistant turn 2 cannot be found .*pip install 'xla-train\[agents\]'"):
        chat(row["messages"], qwen3, "row 1", tools)


def test_sft_on_traces_trains_a_model_that_calls_the_tool(tool_caller, tmp_path):
    """The package's own SFT on traces (conftest's tool_caller): the loss falls, the evaluation's
    samples answer after the tool's result, and the package's greedy generation (`xla-train
    predict`, as GRPO's rollouts generate) of new questions with the tool's schema writes what
    transformers' `generate` writes: a call that TRL's `parse_response` parses with Qwen3's
    response template, `multiply` with two integer arguments, then the end of the turn."""
    import torch
    from conftest import cli
    from transformers import AutoModelForCausalLM, AutoTokenizer

    losses = [loss for _, loss, _ in tool_caller["metrics"]["train_loss"]]
    assert losses[-1] < losses[0] / 3, losses
    # --eval-samples: each validation trace up to its tool's result (with its tools), completed
    last = tool_caller["model"] / "samples" / f"step-{tool_caller['metrics']['train_loss'][-1][0]}.jsonl"
    samples = [json.loads(line) for line in last.read_text().splitlines()]
    assert [s["reference"] for s in samples] == [r["messages"][-1]["content"] for r in tool_task.tool_rows(2, 2)]
    assert all(s["tools"] and "The product is" in s["completion"] for s in samples), samples

    questions = [{"messages": row["prompt"], "tools": json.dumps([tool_task.schema()])}
                 for row in tool_task.tool_rows(4, 7, "prompts")]
    out = tmp_path / "calls.jsonl"
    proc = cli("predict", ["--model", tool_caller["model"], "--input", td.write_jsonl(tmp_path / "q.jsonl", questions),
                           "--output", out, "--backend", "cpu", "--max-new-tokens", 48, "--max-length", 256])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    from trl.chat_template_utils import add_response_schema, parse_response

    tok = add_response_schema(AutoTokenizer.from_pretrained(tool_caller["model"]))  # Qwen3's response template
    model = AutoModelForCausalLM.from_pretrained(tool_caller["model"]).eval()
    for question, completion in zip(questions, ours):
        prompt = tok.apply_chat_template(question["messages"], tools=json.loads(question["tools"]),
                                         add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**prompt, max_new_tokens=48, do_sample=False)
        ids = generated[0, prompt["input_ids"].shape[1]:].tolist()
        text = tok.decode(ids)
        assert re.fullmatch(r"<think>\n\n</think>\n\n<tool_call>\n.*\n</tool_call><\|im_end\|>", text, re.S), text
        (call,) = parse_response(tok, ids, prefix=prompt["input_ids"][0].tolist(), tools=[tool_task.schema()])[
            "tool_calls"]
        assert call["function"]["name"] == "multiply" and all(
            isinstance(call["function"]["arguments"][k], int) for k in "ab"), call
        assert completion == text.removesuffix("<|im_end|>"), (completion, text)  # special tokens left out
