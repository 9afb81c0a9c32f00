"""The prediction part of a kind that generates (causal-lm): a completion for every prompt of a file.

    xla-train predict --model runs/chat --input questions.jsonl --output answers.jsonl

Rows have a `prompt` column (text, tokenised with the tokenizer's special tokens as training
tokenised prompts) or a `messages` column (chat turns, rendered by the chat template with the
generation prompt, and with the row's `tools` column's schemas where it has one; in a .csv, the
turns as JSON). The output holds the input's columns plus `completion`, the generated text up to
the first end-of-sequence token, row for row.

How the tokens are generated (static shapes on XLA): kernels/generate.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import UserError
from ..core.shapes import forward_padding, lengths, padding_for
from .base import row_name
from .documents import TOOLS, encode, prompt_ids
from .files import read_table
from .table import write_rows

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.shapes import Padding
    from ..kernels.generate import Sampling
    from .base import PredictSettings, Task

MAX_NEW_TOKENS = 64  # --max-new-tokens' default (xla-train predict; a causal-LM run's --test-file)
FORMS = ("prompt", "messages")  # the columns a row's prompt may come in, in the order looked for


def read_prompts(path, tokenizer, max_length):
    """The input's columns (as read) and its prompts tokenised as a dataset with `row` numbers;
    a prompt longer than `max_length` keeps its last `max_length` tokens. Returns Prompts, not
    yet fitted to a model (`fit_prompts`)."""
    ds = read_table(path)
    column = next((c for c in FORMS if c in ds.column_names), None)
    if column is None:
        raise UserError(f"{path}: rows need a 'prompt' column, or a 'messages' column of chat turns, to generate "
                        f"from (columns: {', '.join(ds.column_names)})")
    # chat turns: a 'messages' column, or a 'prompt' of turns (TRL's conversational preference pairs)
    form = "messages" if column == "messages" or (len(ds) and isinstance(ds[0][column], list)) else "prompt"
    if form == "messages" and not tokenizer.chat_template:
        raise UserError(f"{path}: messages need a chat template, and the model's tokenizer has none; give a "
                        "'prompt' column instead" if column == "messages" else
                        f"{path}: the prompts are chat turns, which need a chat template, and the model's tokenizer "
                        "has none; give the prompts as text")
    columns = {c: ds[c] for c in ds.column_names}
    ids = []
    for i, row in enumerate(ds.to_list()):
        where = f"{path}: {row_name(path, i)}"
        if column == "messages" and isinstance(row["messages"], str):  # a CSV cell: the turns as JSON
            row["messages"] = _json(row["messages"], where)
        ids.append(prompt_ids({form: row[column], TOOLS: row.get(TOOLS)}, form, tokenizer, where))
    data, truncated = prompt_data(ids, max_length)
    return Prompts(columns, data, tokenizer, truncated)


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
    and a causal-LM run's --test-file alike (`read_prompts`, `fit_prompts`, then `complete`)."""

    columns: dict[str, list]  # the input's columns, as read, written back beside each completion
    data: Any  # the prompts tokenised (prompt_data)
    tokenizer: Any  # the model's; once fitted, a left-padded copy (left_padded): pads the prompts, decodes
    truncated: int  # prompts cut to their last max_length tokens
    padding: Padding | None = None  # the prompts' buckets (`fit_prompts`)
    sampling: Sampling | None = None


def fit_prompts(prompts, model, accelerator, max_length, buckets, max_new_tokens, temperature=0.0, top_p=1.0):
    """`prompts` (read_prompts') for `model` (unwrapped, on the CPU) on `accelerator`: bucketed for
    generation (two graphs a bucket) and checked against the model's positions."""
    from ..kernels.generate import Sampling

    data, tokenizer = prompts.data, prompts.tokenizer
    padding = forward_padding(lengths(data), accelerator, buckets, max_length, graphs=2)
    check_lengths(model, tokenizer, max(lengths(data)), max_new_tokens)
    eos = end_ids(tokenizer, model)
    tokenizer = left_padded(tokenizer, eos)
    sampling = Sampling(max_new_tokens, eos, tokenizer.pad_token_id, temperature, top_p)
    return dataclasses.replace(prompts, tokenizer=tokenizer, padding=padding, sampling=sampling)


def complete(engine, model, prompts, batch_size):
    """Every prompt's completion from a prepared `model`, in input order, on every replica (each
    generates its share): (texts, tokens generated per row)."""
    from ..core.inference import predict_loader
    from ..kernels.generate import generate_rows

    loader = predict_loader(engine, prompts.tokenizer, prompts.data, batch_size, prompts.padding)
    tokens = generate_rows(engine, model, loader, prompts.sampling)
    return completions(tokens, prompts.tokenizer, prompts.sampling.eos_ids)


class Completions:
    """A kind's prediction that generates: each prompt's completion (greedy unless --temperature),
    up to its first end-of-sequence token. `xla-train predict` and a training run's --test-file
    both go through `read`, `predict` and `write`."""

    unit = "prompts (each keeps its last tokens)"

    def __init__(self, task: Task):
        self.task = task

    def check(self, settings: PredictSettings) -> None:
        given = [flag for flag, value in (("--task", settings.glue_task), ("--text-columns", settings.text_columns))
                 if value]
        if given:
            raise UserError(f"{given[0]} applies to classifiers; a causal LM's rows are told by their columns "
                            "(prompt or messages)")

    def load(self, folder: str, accelerator: str = "cpu") -> Any:
        """The model to generate with: a whole model, or an adapter (--lora) merged into its base."""
        return generation_model(self.task.model.load_trained(folder, accelerator))

    pads_like_training = False  # prompts are left-padded to buckets of their own (two graphs each)

    def read(self, path: str, tokenizer: Any, settings: PredictSettings) -> Prompts:
        """The prompts of `path`, read and tokenised; checked before any model loads."""
        return read_prompts(path, tokenizer, settings.max_length)

    def fit(self, rows: Prompts, model: Any, accelerator: Any, settings: PredictSettings,
            training_padding: Padding | None = None) -> Prompts:
        """The prompts bucketed for generation and checked against `model`'s positions."""
        return fit_prompts(rows, model, accelerator, settings.max_length, settings.buckets,
                           settings.max_new_tokens or MAX_NEW_TOKENS, settings.temperature or 0.0,
                           settings.top_p or 1.0)

    def predict(self, engine: Engine, model: Any, rows: Prompts, batch_size: int) -> tuple[list[str], list[int]]:
        """Every prompt's (text, tokens generated), in input order, each replica its share."""
        return complete(engine, model, rows, batch_size)

    def output_name(self, test_file: str) -> str:
        return "predictions.jsonl"

    def write(self, path: str | Path, rows: Prompts, result: tuple[list[str], list[int]],
              seconds: float) -> tuple[str, dict[str, Any]]:
        """Writes the completions; returns (what was written, for a console line; its metrics)."""
        texts, counts = result
        assert rows.sampling is not None and len(texts) == len(rows.data), len(texts)  # fitted; each row once
        write_completions(path, rows.columns, texts)
        rate = sum(counts) / max(seconds, 1e-9)
        return (f"generated {len(texts)} completions ({sum(counts)} tokens, {rate:.1f} tokens/s)",
                {"rows": len(texts), "max_new_tokens": rows.sampling.max_new_tokens, "tokens_generated": sum(counts),
                 "seconds": round(seconds, 3), "tokens_per_s": round(rate, 2)})


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
    """The model as generation runs it: an adapter merged into its base (one weight per layer),
    except into a base held in 8 or 4 bits (--load-in-8bit/4bit), which keeps its live adapter:
    merging would round the adapter into the quantized blocks (peft's bnb merge warns of it)."""
    from ..models import holds_quantized_base

    if hasattr(model, "merge_and_unload") and not holds_quantized_base(model):
        model = model.merge_and_unload()
    return model.eval()


def check_lengths(model, tokenizer, longest, max_new_tokens):
    """The positions a row reaches (its prompt's `longest` tokens plus the new ones) fit the model.
    (A sliding attention window shorter than the row is no limit: kernels/generate.py caches each
    layer type by its own window.)"""
    from ..models import position_limit

    limit = position_limit(model.config, tokenizer)
    if longest + max_new_tokens > limit:
        raise UserError(f"prompts of up to {longest} tokens plus --max-new-tokens {max_new_tokens} pass the model's "
                        f"{limit} positions; lower --max-length or --max-new-tokens")


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

    shown: list[dict]  # each sample as the files show it: its prompt (or messages) and its reference
    data: Any  # the prompts tokenised (prompt_data)
    sampling: Sampling  # greedy, up to as many tokens as the longest reference takes
    tokenizer: Any  # decodes the completions; a left-padded copy pads the prompts
    batch_size: int  # rows per replica and batch

    def generator(self, engine: Engine) -> Callable[[Any], list[dict]]:
        """A function of the model that generates every sample (on every replica: each takes its
        share) and returns the samples with their `completion`, one bucket: the longest prompt."""
        from ..core.inference import predict_loader
        from ..kernels.generate import generate_rows

        longest = max(lengths(self.data))
        padding = padding_for("buckets", [longest], longest, [lengths(self.data)])
        loader = predict_loader(engine, left_padded(self.tokenizer, self.sampling.eos_ids), self.data,
                                self.batch_size, padding)

        def generate(model):
            tokens = generate_rows(engine, model, loader, self.sampling)
            texts, _ = completions(tokens, self.tokenizer, self.sampling.eos_ids)
            return [{**shown, "completion": text} for shown, text in zip(self.shown, texts)]

        return generate


def eval_samples(rows, form, tokenizer, model, max_length, batch_size):
    """`Samples` of the task's `sample_rows`: a sample may write as many tokens as its reference
    answer takes in training's rendering (its end-of-turn markup included)."""
    ids, new = [], 1
    for i, (prompt, prompt_form, _, full) in enumerate(rows):
        where = f"--eval-samples: validation row {i + 1}"
        ids.append(prompt_ids(prompt, prompt_form, tokenizer, where))
        new = max(new, len(encode(full, form, tokenizer, where)[0]) - len(ids[-1]))
    shown = [{**prompt, "reference": reference} for prompt, _, reference, _ in rows]
    return samples_of(ids, shown, new, tokenizer, model, max_length, batch_size)


def samples_of(ids, shown, new, tokenizer, model, max_length, batch_size, kind=None, **fields):
    """`Samples` (or the `kind` of them, with its `fields`) of prompts' token `ids`, each shown as
    `shown` says, completed greedily up to `new` tokens; checked against the model's positions."""
    from ..kernels.generate import Sampling

    data, _ = prompt_data(ids, max_length)
    longest = max(lengths(data))
    check_lengths(model, tokenizer, longest, new)
    eos = end_ids(tokenizer, model)
    pad = left_padded(tokenizer, eos).pad_token_id
    return (kind or Samples)(shown, data, Sampling(new, eos, pad), tokenizer, min(batch_size, len(shown)), **fields)
