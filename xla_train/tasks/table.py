"""The rows to predict and the predictions written, for `xla-train predict` and a training run's
--test-file alike.

Output: for a GLUE file (a `.tsv` in GLUE's layout, for a model trained on that GLUE task), GLUE's
submission format `index<TAB>prediction`; otherwise the input's columns plus `prediction` (the
task's prediction: a label's name, or a value) and `score` (its probability; the value for a
regression), in the output file's format by extension (.csv .tsv .json .jsonl).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from ..core.errors import UserError
from ..core.shapes import lengths
from ..io.files import atomic_write
from .files import read_table, text_columns_of
from .glue import GLUE, glue_columns, submission

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.shapes import Padding
    from .base import ModelPart, PredictSettings, Rows

GLUE_TEST_TEXTS = {"cola": ("sentence",)}  # test files whose text columns differ from train/dev's


# ---------------------------------------------------------------------------------------------
# Reading the input, writing the output


@dataclass
class Table:
    """The input: its rows (columns as read), the texts to predict from, and its output format."""

    columns: dict  # name: list of values, as read
    texts: dict  # text1 [, text2]: lists of strings
    glue: str | None = None  # the GLUE task whose submission format the output takes, or None
    path: Path | None = None

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
        preds = submission(table.glue, scores)
        rows, header = [dict(zip(("index", "prediction"), r)) for r in zip(index, preds)], ["index", "prediction"]
    else:
        preds, values = task.objective.predictions(scores)
        header = [*table.columns, "prediction", "score"]
        rows = [{**{c: table.columns[c][i] for c in table.columns}, "prediction": preds[i],
                 "score": round(values[i], 6)} for i in range(len(table))]
    return write_rows(path, header, rows, glue=bool(table.glue))


def write_rows(path, header, rows, glue=False):
    """Writes `rows` (dicts with the `header`'s keys) to `path` in the format of its extension,
    atomically (`glue`: GLUE's unquoted TSV)."""
    path = Path(path)
    suffix = path.suffix.lower()

    def write(f):
        if suffix in (".csv", ".tsv"):
            quoting: Literal[0, 1, 2, 3] = csv.QUOTE_NONE if glue else csv.QUOTE_MINIMAL  # csv's QUOTE_* values
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
    data, truncated = task.rows.tokenize(datasets.DatasetDict(predict=ds), tokenizer, max_length)
    return data["predict"], truncated["predict"]


# ---------------------------------------------------------------------------------------------
# The prediction part of a kind that scores rows (classification, regression)


@dataclass
class ScoreRows:
    """Rows to score, read and tokenised in the launching process (`Scores.read`)."""

    table: Table
    data: Any  # the rows tokenised, with their `row` numbers
    tokenizer: Any
    truncated: int  # rows cut to the maximum length
    padding: Padding | None = None  # a forward pass's buckets, or a training run's (`Scores.fit`)

    def __len__(self):
        return len(self.table)


class ScoringObjective(Protocol):
    """What `Scores` asks of its kind's objective (sequence.ClassifierObjective, RegressionObjective)."""

    def predict_columns(self, output: Any) -> tuple:
        """A batch's predictions as 1-D float device tensors (rows' scores)."""

    def predictions(self, scores: Any) -> tuple[list, list[float]]:
        """(each row's prediction, its score) from predict_columns' rows in input order."""


class ScoredTask(Protocol):
    """What `Scores` asks of its kind (sequence.SequenceTask's members and parts)."""

    kind: ClassVar[str | None]

    # read-only, as a frozen dataclass's fields and its cached parts are
    @property
    def name(self) -> str | None: ...

    @property
    def text_columns(self) -> list[str] | None: ...

    @property
    def rows(self) -> Rows: ...

    @property
    def model(self) -> ModelPart: ...

    @property
    def objective(self) -> ScoringObjective: ...


class Scores:
    """A kind's prediction that scores every row: the label and its probability, or the value
    (GLUE's submission format for a GLUE task's test file). `xla-train predict` and a training
    run's --test-file both go through `read`, `predict` and `write`."""

    generation_options = ("max_new_tokens", "temperature", "top_p", "seed")  # predict's options it has no use for
    unit = "rows"

    def __init__(self, task: ScoredTask):
        self.task = task

    def check(self, settings: PredictSettings) -> None:
        given = [name for name in self.generation_options if getattr(settings, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"{flag} applies to a causal LM's folder (predict generates text there); --model "
                            f"{settings.model} is a {self.task.kind or 'classification'} model")

    def load(self, folder: str, accelerator: str = "cpu") -> Any:
        """The model to predict with: a whole model, or an adapter (--lora) on its base."""
        return self.task.model.load_trained(folder, accelerator)

    pads_like_training = True  # a training run's --test-file rows take its batches' padding

    def read(self, path: str, tokenizer: Any, settings: PredictSettings) -> ScoreRows:
        """`path`'s rows, tokenised as training tokenised its rows; checked before any model loads."""
        table = read_input(path, self.task, settings.text_columns, settings.glue_task)
        data, truncated = tokenize_rows(table, self.task, tokenizer, settings.max_length)
        return ScoreRows(table, data, tokenizer, truncated)

    def fit(self, rows: ScoreRows, model: Any, accelerator: Any, settings: PredictSettings,
            training_padding: Padding | None = None) -> ScoreRows:
        """The rows with `model`'s inputs only, padded like a training run's batches
        (`training_padding`) or bucketed for a forward pass."""
        from ..core.batching import model_inputs_only
        from ..core.shapes import forward_padding

        padding = training_padding or forward_padding(lengths(rows.data), accelerator, settings.buckets,
                                                      settings.max_length)
        return dataclasses.replace(rows, data=model_inputs_only(rows.data, model), padding=padding)

    def predict(self, engine: Engine, model: Any, rows: ScoreRows, batch_size: int) -> Any:
        """Every row's scores (a (rows, columns) host tensor in input order), each replica its share."""
        from ..core.inference import predict_loader, predict_rows

        loader = predict_loader(engine, rows.tokenizer, rows.data, batch_size, rows.padding)
        return predict_rows(engine, model, loader, self.task.objective.predict_columns)

    def output_name(self, test_file: str) -> str:
        return f"predictions{Path(test_file).suffix.lower()}"

    def write(self, path: str | Path, rows: ScoreRows, scores: Any, seconds: float) -> tuple[str, dict[str, Any]]:
        """Writes the predictions; returns (what was written, for a console line; its metrics)."""
        assert len(scores) == len(rows), (len(scores), len(rows))  # each row exactly once
        write_output(path, rows.table, self.task, scores)
        return f"predicted {len(scores)} rows", {"rows": len(scores), "seconds": round(seconds, 3)}
