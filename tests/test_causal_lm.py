"""--problem causal-lm in process: the three row forms and their label masks, packing, the packed
loss against each document's own for five decoder families, packed against unpacked evaluation,
the memory plan's logits, and each bad input as one line."""

import json

import pytest
import tiny_decoders as td
import tool_task
import torch

from xla_train.commands.cli import main
from xla_train.core.errors import UserError
from xla_train.tasks import Source, load_task
from xla_train.tasks.causal_lm import IGNORE, CausalLM, PackCollator, documents, join, pack


@pytest.fixture(scope="module")
def tok():
    return td.tokenizer(chat=True)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return {f: td.save(f, tmp_path_factory.mktemp(f), chat=f == "llama") for f in td.FAMILIES}


def docs_of(rows, form, tok, max_length=64):
    import datasets

    return documents(datasets.Dataset.from_list(rows), form, tok, max_length, "rows.jsonl")


def trained_text(tok, ids, labels):
    """The tokens the loss covers, as text (a label is the next token)."""
    return tok.decode([label for label in labels if label != IGNORE])


def test_prompt_completion_trains_the_completion_and_eos_only(tok):
    ((ids, labels),), _, _ = docs_of([{"prompt": "reverse a b =", "completion": " b a"}], "prompt/completion", tok)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert trained_text(tok, ids, labels) == "b a [SEP]"
    prompt = len(tok("reverse a b =")["input_ids"])
    assert labels[:prompt - 1] == [IGNORE] * (prompt - 1) and labels[-1] == IGNORE
    assert labels[prompt - 1:-1] == ids[prompt:]  # shifted: each trained position predicts the next token


def test_messages_train_the_assistant_turns_only(tok):
    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "bye now"}]}]
    ((ids, labels),), _, _ = docs_of(rows, "messages", tok)
    assert trained_text(tok, ids, labels) == "hello [SEP] bye now [SEP]"  # each turn's end markup is trained
    assert "assistant" in tok.decode(ids)  # the generation prompt's markup is in the input, not the loss


def test_text_trains_every_token_and_truncation_is_counted(tok):
    docs, truncated, _ = docs_of([{"text": "one two three"}, {"text": " ".join(["word"] * 40)}], "text", tok,
                                 max_length=16)
    ids, labels = docs[0]
    assert trained_text(tok, ids, labels) == "one two three [SEP]"  # every token after the first
    assert truncated == 1 and len(docs[1][0]) == 16


def test_packing_keeps_documents_whole_and_each_once():
    lengths = [30, 5, 17, 64, 40, 8, 8, 25, 1, 33]
    rows = pack(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert len(rows) == -(-sum(lengths) // 64)  # best-fit decreasing fills these tightly: 231 tokens in 4 rows


def test_packed_columns_reset_positions_and_number_documents():
    out = join([([5, 6, 7], [6, 7, IGNORE]), ([8, 9], [9, IGNORE])], [[0, 1]])
    assert out["position_ids"] == [[0, 1, 2, 0, 1]] and out["segments"] == [[1, 1, 1, 2, 2]]
    assert out["length"] == [5] and out["trained"] == [3]


@pytest.mark.parametrize("family", td.FAMILIES)
def test_packed_loss_equals_the_documents_losses_one_by_one(family, families, tok):
    """fp32: a packed row's loss is its documents' token-weighted loss computed one by one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families[family], dtype=torch.float32).eval()
    docs, _, _ = docs_of(td.reverse_rows(6, 3) + [{"prompt": "a longer prompt " * 3, "completion": " x y"}],
                         "prompt/completion", tok)
    task, collate = CausalLM("custom", None), PackCollator(tok.eos_token_id)
    packed = join(docs, pack([len(d[0]) for d in docs], 64))
    assert len(packed["input_ids"]) < len(docs)  # several documents share a row

    def batch_loss(columns, rows):
        items = [({c: columns[c][r] for c in ("input_ids", "labels", "position_ids", "segments")}, 64, 1) for r in rows]
        batch = collate(items)
        batch.pop("valid")
        labels = batch.pop("labels")
        with torch.no_grad():
            return task.objective.loss(task.objective.forward(model, batch), labels), int((labels != IGNORE).sum())

    together, _ = batch_loss(packed, range(len(packed["input_ids"])))
    one = [batch_loss(join(docs, [[i]]), [0]) for i in range(len(docs))]
    alone = sum(loss * n for loss, n in one) / sum(n for _, n in one)
    assert abs(float(together) - float(alone)) < 1e-5, (together, alone)


def test_packed_and_unpacked_evaluation_agree(families, tmp_path):
    """The evaluation loop (a CPU Engine) over the same documents, packed and one per row."""
    from xla_train.core.batching import make_loader
    from xla_train.core.engine import Engine
    from xla_train.core.shapes import Padding
    from xla_train.evaluation import evaluate_model

    train = td.write_jsonl(tmp_path / "t.jsonl", td.reverse_rows(8, 1))
    valid = td.write_jsonl(tmp_path / "v.jsonl", td.reverse_rows(21, 2))  # 21: a short last batch either way
    engine = Engine("cpu")
    tok = td.tokenizer()
    tok.pad_token = tok.eos_token
    results = {}
    for packing in (True, False):
        task, splits = load_task(Source(train_file=train, validation_file=valid, problem="causal-lm",
                                        packing=packing))
        data, _ = task.rows.tokenize(splits, tok, 64)
        padding = Padding("max_length", None, 64) if packing else Padding("buckets", [16, 32], 64)
        model = task.model.load(families["qwen2"], seed=0)
        loader = engine.prepare(make_loader(data["validation"], tok, 4, padding, shuffle=False, seed=0, fill="mask",
                                            collate=task.rows.collator(tok)))
        results[packing] = evaluate_model(engine, model, loader, task.objective, None)
    assert results[True]["n"] == results[False]["n"] == 21  # every document once, filler rows dropped
    assert results[True]["n_tokens"] == results[False]["n_tokens"]
    assert abs(results[True]["loss"] - results[False]["loss"]) < 1e-5, results


def test_memory_plan_counts_the_logits(families):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from xla_train.memory import plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.base import PassInputs

    model = AutoModelForCausalLM.from_pretrained(families["llama"])
    step = PassInputs("sdpa", rows=8, length=128)
    memory = plan(Mesh(), replace(step, logits="whole"), shape_of(model))
    # whole fp32 logits: the output's logits, their log-softmax, its gradient and the logits' gradient
    assert memory.logits == 16 * model.config.vocab_size * 8 * 128
    assert memory.total - plan(Mesh(), step, shape_of(model)).total == memory.logits  # at the backward's start
    chunked = plan(Mesh(), replace(step, logits="chunked", chunk_tokens=256), shape_of(model))
    head = model.get_output_embeddings().weight
    assert chunked.logits == 8 * 256 * model.config.vocab_size + head.numel() * head.element_size()


def test_peaks_are_known_or_none():
    from xla_train.core.peaks import peak_flops

    assert peak_flops("TPU v5 lite", "bf16") == 197e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 66.9e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops(None, "bf16") is None and peak_flops("TPU v4", "fp32") is None
    assert peak_flops("Some New Accelerator", "bf16") is None


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line each


def rows_file(tmp, rows, name="rows.jsonl"):
    return td.write_jsonl(tmp / name, rows)


BAD = {
    "messages without a chat template": (
        lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0, "messages")), "--model", m["gpt2"]],
        "rows.jsonl: messages need a chat template"),
    "no assistant turn": (
        lambda tmp, m: ["--train-file", rows_file(tmp, [{"messages": [{"role": "user", "content": "hi"}]}] * 3)],
        "rows.jsonl: row 1: no assistant turn (roles: user)"),
    "messages that are not a list of turns": (
        lambda tmp, m: ["--train-file", rows_file(tmp, [{"messages": "hello"}] * 3)],
        "rows.jsonl: row 1: 'messages' must be a list of turns"),
    "tool-calling traces for a template without tools": (
        lambda tmp, m: ["--train-file", rows_file(tmp, tool_task.tool_rows(3, 0))],
        "rows.jsonl: row 1: the chat template does not render tools ('multiply' is not in its rendering)"),
    "an empty completion": (
        lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(2, 0) + [{"prompt": "p", "completion": " "}])],
        "rows.jsonl: row 3: empty completion"),
    "none of the forms": (
        lambda tmp, m: ["--train-file", rows_file(tmp, [{"question": "q", "answer": "a"}] * 3)],
        "rows.jsonl: rows need a 'messages' column (chat turns), 'prompt' and 'completion' columns, or a 'text' "
        "column (columns: question, answer)"),
    "an encoder": (lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0)), "--model", None],
                   "bert is not a decoder with a causal LM head"),
    "--task with causal-lm": (lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0)), "--task", "rte"],
                              "--problem causal-lm trains on own rows (--train-file), not on a GLUE task"),
    "--buckets with packing": (lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0)),
                                               "--buckets", "32"],
                               "--buckets and --padding apply to --no-packing"),
    "--packing for a classifier": (lambda tmp, m: ["MRPC", "--packing"],
                                   "--packing applies to --problem causal-lm"),
    "--eval-samples for a classifier": (lambda tmp, m: ["MRPC", "--eval-samples", "2"],
                                        "--eval-samples generates text from evaluation prompts: it needs --problem "
                                        "causal-lm"),
    "--eval-samples on text rows": (
        lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0, "text")), "--eval-samples", "2"],
        "--eval-samples needs prompt/completion or messages rows: text rows have no prompt"),
    "--eval-samples 0": (lambda tmp, m: ["--train-file", rows_file(tmp, td.reverse_rows(4, 0)), "--eval-samples", "0"],
                         "--eval-samples must be at least 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_causal_input(case, families, tmp_path, capsys):
    make, message = BAD[case]
    extra = make(tmp_path, families)
    args = ["train", "--backend", "cpu", "--problem", "causal-lm", "--model", str(families["llama"]),
            "--max-steps", "1"]
    if "--model" in extra and extra[extra.index("--model") + 1] is None:
        del extra[extra.index("--model"):extra.index("--model") + 2]
        args = [a for a in args if a not in ("--model", str(families["llama"]))]  # the bundled MiniLM
    if extra[0] == "MRPC":  # a classifier's run on the bundled MRPC
        args, extra = ["train", "--backend", "cpu", "--max-steps", "1"], extra[1:]
    if "--train-file" in extra:  # every row read in file order (no held-out split)
        extra += ["--validation-file", extra[extra.index("--train-file") + 1]]
    code = main(args + [str(a) for a in extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("xla-train: error: "), err
    assert message in err


def test_a_saved_datasets_folder_and_parquet_are_read(tmp_path):
    import datasets

    rows = td.reverse_rows(10, 0, "text")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows[:4]).to_parquet(str(tmp_path / "v.parquet"))
    task, splits = load_task(Source(train_file=str(tmp_path / "saved"),
                                    validation_file=str(tmp_path / "v.parquet"), problem="causal-lm"))
    assert task.form == "text" and len(splits["train"]) == 10 and len(splits["validation"]) == 4
    with pytest.raises(UserError, match="no 'validation' split"):
        load_task(Source(train_file=str(tmp_path / "saved"), validation_file=str(tmp_path / "saved"),
                         problem="causal-lm"))
    _, held = load_task(Source(train_file=str(tmp_path / "saved"), problem="causal-lm"))  # 5%, at least one held out
    assert len(held["validation"]) == 1 and len(held["train"]) == 9


def test_record_reads_back(tmp_path):
    from xla_train.tasks import from_folder

    path = td.save("llama", tmp_path / "m")
    CausalLM("custom", None, max_length=96, packing=False, form="messages").write_record(path)
    task = from_folder(path)
    assert isinstance(task, CausalLM) and task.max_length == 96 and task.form == "messages" and not task.packing
    assert json.loads((path / "xla_train_task.json").read_text())["problem"] == "causal-lm"



# ---------------------------------------------------------------------------------------------
# --eval-samples: the prompts and how long a sample may write


def test_eval_samples_prompt_with_the_turns_before_the_last_answer(families, tmp_path):
    """A conversation's sample is its turns before the last assistant turn, rendered with the
    generation prompt; it may write as many tokens as that turn takes (its end-of-turn markup
    included), and its reference is that turn's text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.completion import eval_samples

    chat = [{"role": "user", "content": "reverse a b ="}, {"role": "assistant", "content": "b a"},
            {"role": "user", "content": "reverse c d e ="}, {"role": "assistant", "content": "e d c"}]
    rows = [{"messages": chat}, *td.reverse_rows(3, 0, "messages")]
    path = rows_file(tmp_path, rows)
    task, splits = load_task(Source(train_file=str(path), validation_file=str(path), problem="causal-lm"))
    picked = task.sample_rows(splits, 2)
    assert [len(r[0]["messages"]) for r in picked] == [3, 1] and picked[0][2] == "e d c"
    tok = AutoTokenizer.from_pretrained(families["llama"])
    model = AutoModelForCausalLM.from_pretrained(families["llama"])
    samples = eval_samples(picked[:1], task.form, tok, model, 64, batch_size=8)
    rendered = tok.apply_chat_template(chat, tokenize=False)
    prompt = tok.apply_chat_template(chat[:3], tokenize=False, add_generation_prompt=True)
    answer = (len(tok(rendered, add_special_tokens=False)["input_ids"])
              - len(tok(prompt, add_special_tokens=False)["input_ids"]))
    assert samples.sampling.max_new_tokens == answer > len(tok("e d c", add_special_tokens=False)["input_ids"])
    assert samples.sampling.greedy and samples.shown[0] == {"messages": chat[:3], "reference": "e d c"}
    assert samples.data["input_ids"][0] == tok(prompt, add_special_tokens=False)["input_ids"]


def test_eval_samples_of_prompt_rows_write_up_to_the_completion_and_its_eos(families, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.completion import eval_samples

    path = rows_file(tmp_path, td.reverse_rows(5, 0))
    task, splits = load_task(Source(train_file=str(path), validation_file=str(path), problem="causal-lm"))
    tok = AutoTokenizer.from_pretrained(families["llama"])
    model = AutoModelForCausalLM.from_pretrained(families["llama"])
    samples = eval_samples(task.sample_rows(splits, 9), task.form, tok, model, 64, batch_size=8)
    longest = max(len(tok(r["completion"], add_special_tokens=False)["input_ids"]) for r in td.reverse_rows(5, 0))
    assert len(samples.shown) == 5 and samples.sampling.max_new_tokens == longest + 1  # all 5 rows; plus the EOS
    first = td.reverse_rows(5, 0)[0]
    assert samples.shown[0] == {"prompt": first["prompt"], "reference": first["completion"]}


def _objective_loss(model, objective, seed=0):
    """NextToken's loss of a packed batch of two documents (and its head's path), with the model
    as given, in fp32 on the CPU."""
    from xla_train.tasks.causal_lm import HeadInput

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
    segments = torch.tensor([[1] * 5 + [2] * 7, [1] * 12])
    positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)
    positions[1] = torch.arange(12)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], 1)
    output = objective.forward(model, {"input_ids": ids, "position_ids": positions, "segments": segments})
    return objective.loss(output, labels), isinstance(output, HeadInput)


@pytest.mark.parametrize("family", td.FAMILIES)
def test_the_chunked_head_computes_the_models_own_loss(families, family):
    """Every family's loss through the chunks (the final hidden states and the head in pieces)
    equals the loss of the model's own logits within 1e-5 in fp32."""
    from transformers import AutoModelForCausalLM

    from xla_train.tasks.causal_lm import NextToken

    model = AutoModelForCausalLM.from_pretrained(families[family], dtype=torch.float32)
    chunked, through_chunks = _objective_loss(model, NextToken(attention="mask"))
    whole, _ = _objective_loss(model, NextToken(attention="mask", chunked_logits=False))
    assert through_chunks and abs(float(chunked) - float(whole)) < 1e-5, (family, chunked, whole)


def test_a_head_the_chunks_cannot_compute_keeps_the_whole_logits(families):
    """LoRA on lm_head (peft wraps it) and a family that rescales its logits after the head
    (Granite's logits_scaling): the objective takes the model's own logits, so the loss is theirs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

    from xla_train.tasks.causal_lm import NextToken

    torch.manual_seed(0)
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0))
    llama = AutoModelForCausalLM.from_pretrained(families["llama"], dtype=torch.float32)
    adapted = get_peft_model(llama, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    for model in (granite, adapted):
        chunked, through_chunks = _objective_loss(model, NextToken(attention="mask"))
        whole, _ = _objective_loss(model, NextToken(attention="mask", chunked_logits=False))
        assert not through_chunks and float(chunked) == float(whole)
