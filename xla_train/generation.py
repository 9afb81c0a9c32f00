"""`xla-train predict` on a causal LM's folder: a completion for every prompt of a file.

    xla-train predict --model runs/chat --input questions.jsonl --output answers.jsonl

Rows have a `prompt` column (text, tokenised with the tokenizer's special tokens as training
tokenised prompts) or a `messages` column (chat turns, rendered by the chat template with the
generation prompt; in a .csv, the turns as JSON). The output holds the input's columns plus
`completion`, the generated text up to the first end-of-sequence token, row for row.

How the tokens are generated (static shapes on XLA): core/generate.py.
"""

import json

from .core.errors import UserError
from .predictions import write_rows
from .tasks import read_table
from .tasks.base import row_name
from .tasks.causal_lm import prompt_ids, window_shorter_than

FORMS = ("prompt", "messages")  # the columns a row's prompt may come in, in the order looked for


def read_prompts(path, tokenizer, max_length):
    """The input's columns (as read) and its prompts tokenised as a dataset with `row` numbers;
    a prompt longer than `max_length` keeps its last `max_length` tokens. Returns (columns, data,
    prompts truncated)."""
    import datasets

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
    truncated = sum(len(x) > max_length for x in ids)
    ids = [x[-max_length:] for x in ids]
    data = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids],
                                       "length": [len(x) for x in ids], "row": list(range(len(ids)))})
    return columns, data, truncated


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
