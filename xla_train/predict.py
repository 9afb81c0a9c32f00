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

import torch
from tqdm.auto import tqdm

from .api import Engine
from .data import make_loader, model_inputs_only, tokenize
from .errors import UserError, first_line
from .files import atomic_write
from .models import load_classifier, load_pretrained
from .options import PredictOptions, check_model_path, parse_buckets
from .core.select import select_roles
from .shapes import CostModel, Padding, choose_buckets
from .tasks import GLUE, glue_columns, read_table, text_columns_of

TASK_FILE = "xla_train_task.json"  # what training saved beside the model: task, text columns, labels
GLUE_TEST_TEXTS = {"cola": ("sentence",)}  # test files whose text columns differ from train/dev's


PredictConfig = PredictOptions  # the name before options.py


@dataclass
class ModelInfo:
    """What a fine-tuned classifier folder says about itself."""

    problem: str  # classification | regression
    labels: list  # names in id order (None for a regression)
    task: str = None  # the GLUE task it was trained on, "custom", or None (not trained by xla-train)
    text_columns: list = None  # the training data's own column names
    max_length: int = 128

    @classmethod
    def read(cls, folder):
        from transformers import AutoConfig

        folder = Path(folder)
        check_model_path(folder, need=True)
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError) as e:  # no or unreadable config.json (OSError), no or unknown model_type
            raise UserError(f"--model {folder}: not a transformers model folder ({first_line(e)})")
        if not any(a.endswith("ForSequenceClassification") for a in config.architectures or ()):
            raise UserError(f"--model {folder}: not a fine-tuned sequence classifier (architectures: "
                            f"{', '.join(config.architectures or ['none'])})")
        regression = config.problem_type == "regression" or config.num_labels == 1
        labels = None if regression else [config.id2label[i] for i in range(config.num_labels)]
        saved = json.loads((folder / TASK_FILE).read_text()) if (folder / TASK_FILE).is_file() else {}
        return cls("regression" if regression else "classification", labels, saved.get("task"),
                   saved.get("text_columns"), saved.get("max_length", 128))

    def write(self, folder):
        atomic_write(Path(folder) / TASK_FILE, json.dumps(
            {"task": self.task, "problem": self.problem, "labels": self.labels, "text_columns": self.text_columns,
             "max_length": self.max_length}, indent=1) + "\n")


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


def read_input(path, info, text_columns=None, task=None):
    """The rows of `path` to predict, with the text columns the model was trained on."""
    path = Path(path)
    task = task or (info.task if info.task in GLUE else None)
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
        wanted = text_columns or (",".join(info.text_columns) if info.text_columns else None)
        names = [text_columns_of(ds, "label", wanted, path, what=None if text_columns else "the model was trained on")]
        glue = None
    if not columns or not next(iter(columns.values())):
        raise UserError(f"{path}: no rows to predict")
    texts = {f"text{i + 1}": ["" if v is None else str(v) for v in columns[c]] for i, c in enumerate(names[0])}
    return Table(columns, texts, glue, path)


def write_output(path, table, info, scores):
    """Writes one row per input row, in input order (see the module docstring); atomically."""
    path = Path(path)
    if info.problem == "regression":
        ids, values = None, scores[:, 0].tolist()
    else:
        best = scores.max(1)
        ids, values = best.indices.tolist(), best.values.tolist()
    if table.glue:
        spec = GLUE[table.glue]
        index = table.columns.get("index") or table.columns.get("id") or list(range(len(table)))
        preds = [f"{v:.3f}" for v in values] if ids is None else [spec.file_labels[i] for i in ids]
        rows, header = [dict(zip(("index", "prediction"), r)) for r in zip(index, preds)], ["index", "prediction"]
    else:
        preds = [round(v, 6) for v in values] if ids is None else [info.labels[i] for i in ids]
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
        cost = CostModel(compile_seconds=backend.accelerator.compile_seconds,
                         token_seconds=backend.accelerator.token_seconds, graphs_per_bucket=1)
        buckets, _ = choose_buckets(lengths, 1 / 3, max_length, cost)
    padding = Padding("buckets", buckets, max_length)
    padding.check_fit(lengths)
    return padding


def infer(engine, model, loader, columns, desc=None):
    """The one inference loop (evaluation and prediction): every row of `loader` exactly once
    across replicas. `columns(batch, logits)` gives a batch's 1-D tensors of one dtype; they are
    gathered on the device per batch and copied to the host once, at the end (a per-batch copy
    would make the host wait for every batch). Returns the host columns, filler rows dropped."""
    model.eval()
    parts = []
    bar = tqdm(total=len(loader), desc=desc, disable=not (desc and engine.is_main_process), dynamic_ncols=True,
               leave=False)
    with engine.inference_mode(), bar:
        for batch in loader:
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "row")}
            with engine.autocast():
                logits = model(**inputs).logits
            parts.append(engine.gather_on_device(columns(batch, logits)))
            bar.update(1)
    return engine.rows_to_host(parts)


def predict_rows(engine, model, loader, problem, desc="Predicting"):
    """Scores of every row the loader holds, across replicas, in input order: a (rows, classes)
    tensor of probabilities, or (rows, 1) values for a regression. The loader's dataset has a
    `row` column (the input position); filler rows are dropped."""

    def columns(batch, logits):
        logits = logits.float()
        out = logits[:, :1] if problem == "regression" else logits.softmax(-1)
        # floats only: the row numbers are exact in float32 below 2**24, and 64-bit integer
        # collectives may not lower on every device
        return (batch["row"].float(), *out.T)

    table = torch.stack(infer(engine, model, loader, columns, desc), 1)
    order = table[:, 0].round().long().argsort()
    return table[order, 1:]


def predict_loader(engine, tokenizer, data, batch_size, padding):
    """A prepared loader over tokenised rows (with their `row` numbers) padded by `padding`, in order."""
    loader = make_loader(data, tokenizer, batch_size, padding, shuffle=False, seed=0, fill="mask")
    return engine.prepare(loader)


def tokenize_rows(table, tokenizer, max_length):
    import datasets

    ds = datasets.Dataset.from_dict({**table.texts, "label": [0] * len(table), "row": list(range(len(table)))})
    data, truncated = tokenize(datasets.DatasetDict(predict=ds), tokenizer, max_length)
    return data["predict"], truncated["predict"]


def predict_worker(cfg, info, table, model, tokenizer, data, padding):
    engine = Engine(cfg.backend, num_processes=cfg.num_processes, strategy=cfg.strategy)
    loader = predict_loader(engine, tokenizer, data, cfg.batch_size, padding)
    model = engine.prepare(model)
    scores = predict_rows(engine, model, loader, info.problem)
    if engine.is_main_process:
        assert len(scores) == len(table), (len(scores), len(table))  # each row exactly once
        write_output(cfg.output, table, info, scores)
        stats = engine.compile_stats()
        compiled = f"; {stats['compiles']} graphs compiled for buckets {padding.buckets}" if stats else ""
        engine.print(f"predicted {len(scores)} rows into {cfg.output}{compiled}")


def run(cfg):
    """`xla-train predict`: every check first, then the model, then the replicas."""
    from transformers import AutoTokenizer

    cfg.validate()
    info = ModelInfo.read(cfg.model)
    cfg.max_length = cfg.max_length or info.max_length
    table = read_input(cfg.input, info, cfg.text_columns, cfg.task)
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    tokenizer = load_pretrained(AutoTokenizer, cfg.model)
    data, truncated = tokenize_rows(table, tokenizer, cfg.max_length)
    if truncated:
        print(f"truncated to --max-length {cfg.max_length} tokens: {truncated} rows")
    padding = plan(data["length"], backend, cfg.buckets, cfg.max_length)
    model = load_classifier(cfg.model)  # a whole model, or an adapter (--lora) on its base
    data = model_inputs_only(data, model)
    backend.launch(predict_worker, (cfg, info, table, model, tokenizer, data, padding))
