"""`xla-train predict` on a causal LM's folder: a completion for every prompt of a file.

    xla-train predict --model runs/chat --input questions.jsonl --output answers.jsonl

Rows have a `prompt` column (text, tokenised with the tokenizer's special tokens as training
tokenised prompts) or a `messages` column (chat turns, rendered by the chat template with the
generation prompt; in a .csv, the turns as JSON). The output holds the input's columns plus
`completion`, the generated text up to the first end-of-sequence token, row for row.

How the tokens are generated (static shapes on XLA): core/generate.py.
"""

import copy
import json
from dataclasses import dataclass

from .core.errors import UserError
from .core.generate import Sampling, generate_rows
from .core.inference import predict_loader
from .core.shapes import forward_padding, padding_for
from .predictions import write_rows
from .tasks import read_table
from .tasks.base import row_name
from .tasks.causal_lm import encode, prompt_ids, window_shorter_than

MAX_NEW_TOKENS = 64  # --max-new-tokens' default (xla-train predict; a causal-LM run's --test-file)
FORMS = ("prompt", "messages")  # the columns a row's prompt may come in, in the order looked for


def read_prompts(path, tokenizer, max_length):
    """The input's columns (as read) and its prompts tokenised as a dataset with `row` numbers;
    a prompt longer than `max_length` keeps its last `max_length` tokens. Returns (columns, data,
    prompts truncated)."""
    ds = read_table(path)
    form = next((c for c in FORMS if c in ds.column_names), None)
    if form is None:
        raise UserError(f"{path}: rows need a 'prompt' column, or a 'messages' column of chat turns, to generate "
                        f"from (columns: {', '.join(ds.column_names)})")
    if form == "messages" and not tokenizer.chat_template:
        raise UserError(f"{path}: messages need a chat template, and the model's tokenizer has none; give a "
                        "'prompt' column instead")
    columns = {c: ds[c] for c in ds.column_names}
    ids = []
    for i, row in enumerate(ds.to_list()):
        where = f"{path}: {row_name(path, i)}"
        if form == "messages" and isinstance(row["messages"], str):  # a CSV cell: the turns as JSON
            row["messages"] = _json(row["messages"], where)
        ids.append(prompt_ids(row, form, tokenizer, where))
    data, truncated = prompt_data(ids, max_length)
    return columns, data, truncated


def prompt_data(ids, max_length):
    """Prompts' token ids as a dataset with `row` numbers, each cut to its last `max_length`
    tokens; returns (data, prompts truncated)."""
    import datasets

    truncated = sum(len(x) > max_length for x in ids)
    ids = [x[-max_length:] for x in ids]
    data = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids],
                                       "length": [len(x) for x in ids], "row": list(range(len(ids)))})
    return data, truncated


@dataclass
class Prompts:
    """Prompts to complete, read and checked in the launching process: `xla-train predict`'s input
    and a causal-LM run's --test-file alike (`prompts_to_complete`, then `complete`)."""

    columns: dict  # the input's columns, as read, written back beside each completion
    data: object  # the prompts tokenised (prompt_data)
    padding: object  # shapes.Padding: the prompts' buckets
    sampling: Sampling
    tokenizer: object  # a left-padded copy (left_padded): pads the prompts, decodes the completions
    truncated: int  # prompts cut to their last max_length tokens


def prompts_to_complete(path, tokenizer, model, max_length, buckets, accelerator, max_new_tokens, temperature=0.0,
                        top_p=1.0):
    """The prompts of `path` for `model` (unwrapped, on the CPU) on `accelerator`: read, tokenised,
    bucketed for generation (two graphs a bucket) and checked against the model's positions."""
    columns, data, truncated = read_prompts(path, tokenizer, max_length)
    padding = forward_padding(data["length"], accelerator, buckets, max_length, graphs=2)
    check_lengths(model, tokenizer, max(data["length"]), padding.buckets[-1] + max_new_tokens, max_new_tokens,
                  accelerator.static_shapes)
    eos = end_ids(tokenizer, model)
    tokenizer = left_padded(tokenizer, eos)
    sampling = Sampling(max_new_tokens, eos, tokenizer.pad_token_id, temperature, top_p)
    return Prompts(columns, data, padding, sampling, tokenizer, truncated)


def complete(engine, model, prompts, batch_size):
    """Every prompt's completion from a prepared `model`, in input order, on every replica (each
    generates its share): (texts, tokens generated per row)."""
    loader = predict_loader(engine, prompts.tokenizer, prompts.data, batch_size, prompts.padding)
    tokens = generate_rows(engine, model, loader, prompts.sampling)
    return completions(tokens, prompts.tokenizer, prompts.sampling.eos_ids)


def _json(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: 'messages' is not JSON ({e.msg} at character {e.pos})") from None


def completions(tokens, tokenizer, eos_ids):
    """Each row's text up to its first end-of-sequence token (special tokens left out), and the
    tokens it generated (the end-of-sequence token counted)."""
    texts, counts = [], []
    for row in tokens.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
        counts.append(len(row) if end is None else end + 1)
    return texts, counts


def write_completions(path, columns, texts):
    """The input's columns plus `completion` (an input column of that name is replaced)."""
    header = [*[c for c in columns if c != "completion"], "completion"]
    rows = [{**{c: columns[c][i] for c in header[:-1]}, "completion": text} for i, text in enumerate(texts)]
    return write_rows(path, header, rows)


def end_ids(tokenizer, model):
    """The tokens that end a row: the tokenizer's end-of-sequence token and the model's
    generation_config.json ones (a chat model's end-of-turn token)."""
    config = getattr(model, "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    listed = listed if isinstance(listed, (list, tuple)) else [listed]
    ids = tuple(dict.fromkeys(i for i in [tokenizer.eos_token_id, *listed] if i is not None))
    if not ids:
        raise UserError("the model's tokenizer has no end-of-sequence token, and its generation config names none")
    return ids


def generation_model(model):
    """The model as generation runs it: an adapter merged into its base (one weight per layer)."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.eval()


def check_lengths(model, tokenizer, longest, cache_length, max_new_tokens, static):
    """The positions a row reaches (its prompt's `longest` tokens plus the new ones) fit the model;
    with `static` shapes, the cache's `cache_length` slots fit its sliding attention window (one
    mask serves every layer)."""
    from .models import position_limit

    limit = position_limit(model.config, tokenizer)
    if longest + max_new_tokens > limit:
        raise UserError(f"prompts of up to {longest} tokens plus --max-new-tokens {max_new_tokens} pass the model's "
                        f"{limit} positions; lower --max-length or --max-new-tokens")
    window = window_shorter_than(model.config, cache_length) if static else None
    if window:
        raise UserError(f"a bucket's prompts plus --max-new-tokens {max_new_tokens} ({cache_length} tokens) pass the "
                        f"model's sliding attention window ({window}); lower --max-length or --max-new-tokens")


def left_padded(tokenizer, eos_ids):
    """A copy of the tokenizer that pads on the left, so every prompt ends where generation
    starts; without a padding token it pads with the end of a sequence (padding is masked)."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos_ids[0])
    return tokenizer


# ---------------------------------------------------------------------------------------------
# --eval-samples: completions of a few evaluation prompts at every evaluation


@dataclass
class Samples:
    """Evaluation prompts, made once in the launching process; every worker generates from them."""

    shown: list  # each sample as the files show it: its prompt (or messages) and its reference
    data: object  # the prompts tokenised (prompt_data)
    sampling: Sampling  # greedy, up to as many tokens as the longest reference takes
    tokenizer: object  # decodes the completions; a left-padded copy pads the prompts
    batch_size: int  # rows per replica and batch


def eval_samples(rows, form, tokenizer, model, max_length, static, batch_size):
    """`Samples` of the task's `sample_rows`: a sample may write as many tokens as its reference
    answer takes in training's rendering (its end-of-turn markup included)."""
    ids, new = [], 1
    for i, (prompt, prompt_form, _, full) in enumerate(rows):
        where = f"--eval-samples: validation row {i + 1}"
        ids.append(prompt_ids(prompt, prompt_form, tokenizer, where))
        new = max(new, len(encode(full, form, tokenizer, where)[0]) - len(ids[-1]))
    data, _ = prompt_data(ids, max_length)
    longest = max(data["length"])
    check_lengths(model, tokenizer, longest, longest + new, new, static)
    eos = end_ids(tokenizer, model)
    pad = left_padded(tokenizer, eos).pad_token_id
    shown = [{**prompt, "reference": reference} for prompt, _, reference, _ in rows]
    return Samples(shown, data, Sampling(new, eos, pad), tokenizer, min(batch_size, len(rows)))


def sample_generator(engine, samples):
    """A function of the model that generates every sample (on every replica: each takes its
    share) and returns the samples with their `completion`, one bucket: the longest prompt."""
    longest = max(samples.data["length"])
    padding = padding_for("buckets", [longest], longest, [samples.data["length"]])
    loader = predict_loader(engine, left_padded(samples.tokenizer, samples.sampling.eos_ids), samples.data,
                            samples.batch_size, padding)

    def generate(model):
        tokens = generate_rows(engine, model, loader, samples.sampling)
        texts, _ = completions(tokens, samples.tokenizer, samples.sampling.eos_ids)
        return [{**shown, "completion": text} for shown, text in zip(samples.shown, texts)]

    return generate
