"""Predictions from a fine-tuned classifier, with static shapes on XLA.

    xla-train predict --model runs/mrpc --input test.tsv --output predictions.tsv
    xla-train predict --model runs/reviews --input new_reviews.csv --output scored.csv --backend xla

Rows are sorted by length into a few buckets (chosen like training's, for a forward pass's cost),
every batch has the same row count (the last is filled with masked rows), replicas each predict a
shard, and the predictions are put back in input order: each row is predicted exactly once.

Output: for a GLUE file (a `.tsv` in GLUE's layout, for a model trained on that GLUE task), GLUE's
submission format `index<TAB>prediction`; otherwise the input's columns plus `prediction` (the
label's name) and `score` (its probability; the value for a regression), in the output file's
format by extension (.csv .tsv .json .jsonl).
"""

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from .api import Engine
from .data import model_inputs_only
from .errors import UserError
from .files import atomic_write
from .inference import predict_loader, predict_rows
from .models import load_pretrained
from .shapes import parse_buckets
from .selection import select_backend
from .shapes import CostModel, Padding, choose_buckets
from .tasks import GLUE, from_folder, glue_columns, read_table, text_columns_of

GLUE_TEST_TEXTS = {"cola": ("sentence",)}  # test files whose text columns differ from train/dev's


# ---------------------------------------------------------------------------------------------
# Reading the input, writing the output


@dataclass
class Table:
    """The input: its rows (columns as read), the texts to predict from, and its output format."""

    columns: dict  # name: list of values, as read
    texts: dict  # text1 [, text2]: lists of strings
    glue: str = None  # the GLUE task whose submission format the output takes, or None
    path: Path = None

    def __len__(self):
        return len(self.texts["text1"])


def read_input(path, trained, text_columns=None, task=None):
    """The rows of `path` to predict, with the text columns the model was trained on (`trained`:
    the model's task)."""
    path = Path(path)
    task = task or (trained.name if trained.name in GLUE else None)
    if path.suffix.lower() == ".tsv" and task:
        columns = glue_columns(path)
        spec = GLUE[task]
        options = [list(spec.file_texts), list(GLUE_TEST_TEXTS.get(task, ())), list(spec.texts)]
        names = [c for c in ([text_columns.split(",")] if text_columns else options) if c and set(c) <= set(columns)]
        if not names:
            raise UserError(f"{path}: none of {task}'s text columns ({', '.join(spec.file_texts)}) in its header "
                            f"(found: {', '.join(columns)})")
        glue = task
    else:
        ds = read_table(path)
        columns = {c: ds[c] for c in ds.column_names}
        wanted = text_columns or (",".join(trained.text_columns) if trained.text_columns else None)
        names = [text_columns_of(ds, "label", wanted, path, what=None if text_columns else "the model was trained on")]
        glue = None
    if not columns or not next(iter(columns.values())):
        raise UserError(f"{path}: no rows to predict")
    texts = {f"text{i + 1}": ["" if v is None else str(v) for v in columns[c]] for i, c in enumerate(names[0])}
    return Table(columns, texts, glue, path)


def write_output(path, table, task, scores):
    """Writes one row per input row, in input order (see the module docstring); atomically.
    `scores`: the task's predict columns, a row per input row."""
    path = Path(path)
    if table.glue:
        index = table.columns.get("index") or table.columns.get("id") or list(range(len(table)))
        preds = task.glue_predictions(scores, GLUE[table.glue].file_labels)
        rows, header = [dict(zip(("index", "prediction"), r)) for r in zip(index, preds)], ["index", "prediction"]
    else:
        preds, values = task.predictions(scores)
        header = [*table.columns, "prediction", "score"]
        rows = [{**{c: table.columns[c][i] for c in table.columns}, "prediction": preds[i], "score": round(values[i], 6)}
                for i in range(len(table))]
    suffix = path.suffix.lower()

    def write(f):
        if suffix in (".csv", ".tsv"):
            quoting = csv.QUOTE_NONE if table.glue else csv.QUOTE_MINIMAL
            writer = csv.DictWriter(f, header, delimiter="\t" if suffix == ".tsv" else ",", quoting=quoting,
                                    escapechar="\\" if table.glue else None)
            writer.writeheader()
            writer.writerows(rows)
        elif suffix == ".jsonl":
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        else:
            json.dump(rows, f, ensure_ascii=False, indent=1)

    return atomic_write(path, write)


# ---------------------------------------------------------------------------------------------
# Predicting


def plan(lengths, backend, buckets, max_length):
    """The padding of one forward pass over these rows: the given bucket lengths, or `--buckets
    auto`'s for a forward pass (about a third of a training step's cost; one graph per bucket)."""
    buckets = parse_buckets(buckets, max_length)
    if buckets == "auto":
        cost = CostModel(compile_seconds=backend.compile_seconds, token_seconds=backend.token_seconds,
                         graphs_per_bucket=1)
        buckets, _ = choose_buckets(lengths, 1 / 3, max_length, cost)
    padding = Padding("buckets", buckets, max_length)
    padding.check_fit(lengths)
    return padding


def tokenize_rows(table, task, tokenizer, max_length):
    """The input's rows tokenised as the task tokenises its splits, with their positions (`row`)."""
    import datasets

    ds = datasets.Dataset.from_dict({**table.texts, "label": [0] * len(table), "row": list(range(len(table)))})
    data, truncated = task.tokenize(datasets.DatasetDict(predict=ds), tokenizer, max_length)
    return data["predict"], truncated["predict"]


def predict_worker(cfg, task, table, model, tokenizer, data, padding):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    loader = predict_loader(engine, tokenizer, data, cfg.batch_size, padding)
    model = engine.prepare(model)
    scores = predict_rows(engine, model, loader, task.predict_columns)
    if engine.is_main_process:
        assert len(scores) == len(table), (len(scores), len(table))  # each row exactly once
        write_output(cfg.output, table, task, scores)
        stats = engine.compile_stats()
        compiled = f"; {stats['compiles']} graphs compiled for buckets {padding.buckets}" if stats else ""
        engine.print(f"predicted {len(scores)} rows into {cfg.output}{compiled}")


def run(cfg):
    """`xla-train predict`: every check first, then the model, then the replicas."""
    from transformers import AutoTokenizer

    cfg.validate()  # --model is a model folder
    task = from_folder(cfg.model)
    cfg.max_length = cfg.max_length or task.max_length
    table = read_input(cfg.input, task, cfg.text_columns, cfg.task)
    backend = select_backend(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    data, truncated = tokenize_rows(table, task, tokenizer, cfg.max_length)
    if truncated:
        print(f"truncated to --max-length {cfg.max_length} tokens: {truncated} rows")
    padding = plan(data["length"], backend, cfg.buckets, cfg.max_length)
    model = task.load_trained(cfg.model)  # a whole model, or an adapter (--lora) on its base
    data = model_inputs_only(data, model)
    backend.launch(predict_worker, (cfg, task, table, model, tokenizer, data, padding))
