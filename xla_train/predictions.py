"""The rows to predict and the predictions written, for `xla-train predict` and a training run's
--test-file alike.

Output: for a GLUE file (a `.tsv` in GLUE's layout, for a model trained on that GLUE task), GLUE's
submission format `index<TAB>prediction`; otherwise the input's columns plus `prediction` (the
task's prediction: a label's name, or a value) and `score` (its probability; the value for a
regression), in the output file's format by extension (.csv .tsv .json .jsonl).
"""

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from .core.errors import UserError
from .core.files import atomic_write
from .tasks import GLUE, glue_columns, read_table, text_columns_of

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
    return write_rows(path, header, rows, glue=bool(table.glue))


def write_rows(path, header, rows, glue=False):
    """Writes `rows` (dicts with the `header`'s keys) to `path` in the format of its extension,
    atomically (`glue`: GLUE's unquoted TSV)."""
    path = Path(path)
    suffix = path.suffix.lower()

    def write(f):
        if suffix in (".csv", ".tsv"):
            quoting = csv.QUOTE_NONE if glue else csv.QUOTE_MINIMAL
            writer = csv.DictWriter(f, header, delimiter="\t" if suffix == ".tsv" else ",", quoting=quoting,
                                    escapechar="\\" if glue else None)
            writer.writeheader()
            writer.writerows(rows)
        elif suffix == ".jsonl":
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        else:
            json.dump(rows, f, ensure_ascii=False, indent=1)

    return atomic_write(path, write)


def tokenize_rows(table, task, tokenizer, max_length):
    """The input's rows tokenised as the task tokenises its splits, with their positions (`row`)."""
    import datasets

    ds = datasets.Dataset.from_dict({**table.texts, "label": [0] * len(table), "row": list(range(len(table)))})
    data, truncated = task.tokenize(datasets.DatasetDict(predict=ds), tokenizer, max_length)
    return data["predict"], truncated["predict"]
