"""A kind is one module and one registration: a kind defined here, registered, is trained, scores
its evaluation, predicts --test-file and is read back by `xla-train predict`, with nothing outside
xla_train/tasks/ knowing its name.

The throwaway kind: a regression trained on the mean absolute error (L1) rather than the squared
one, with its own evaluation metric (the MAE), built on the sequence kinds' rows and model.
"""

import csv
import json
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import pytest

from xla_train.commands.cli import main
from xla_train.tasks import KINDS, Regression, from_folder, problems, register
from xla_train.tasks.sequence import RegressionObjective


@dataclass(frozen=True)
class AbsoluteObjective(RegressionObjective):
    """|prediction - target| as the loss, scored by its mean over the evaluation rows."""

    calls: ClassVar[dict] = {"loss": 0, "score": 0}  # what the loop and the evaluation asked of this kind

    def loss(self, output, labels):
        AbsoluteObjective.calls["loss"] += 1
        return (output.logits.squeeze(-1) - labels).abs().mean()

    def load_metric(self):
        return None  # scored here: no `evaluate` module

    def keys(self):
        return ["mae"]

    def score(self, metric, columns):
        AbsoluteObjective.calls["score"] += 1
        predictions, references = columns
        return {"mae": float((predictions - references).abs().mean()), "n": len(references)}


@dataclass(frozen=True)
class AbsoluteError(Regression):
    """A regression with its own objective: the rows, model and prediction are the sequence kinds'."""

    kind = "regression-l1"
    own_main = "mae"  # own files' main metric

    @cached_property
    def objective(self):
        return AbsoluteObjective(self.metric_name, self.eval_splits)


@pytest.fixture
def absolute_error():
    register(AbsoluteError)
    AbsoluteObjective.calls.update(loss=0, score=0)
    yield AbsoluteError
    del KINDS[AbsoluteError.kind]


def _rows(path, n, offset=0):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["sentence", "score"])
        for i in range(offset, offset + n):
            w.writerow([f"a sentence with {i % 7} words more or less", (i % 7) / 7])
    return path


@pytest.mark.slow
def test_a_kind_defined_outside_the_package_trains_and_predicts(absolute_error, tiny_model, tmp_path, capsys):
    assert "regression-l1" in problems()
    train, dev, test = _rows(tmp_path / "t.csv", 32), _rows(tmp_path / "d.csv", 12, 3), _rows(tmp_path / "x.csv", 5, 9)
    out, metrics = tmp_path / "run", tmp_path / "m.json"
    code = main(["train", "--backend", "cpu", "--model", tiny_model, "--problem", "regression-l1",
                 "--train-file", str(train), "--validation-file", str(dev), "--label-column", "score",
                 "--test-file", str(test),
                 "--max-steps", "4", "--batch-size", "8", "--max-length", "32", "--buckets", "32",
                 "--metric-for-best", "mae", "--save-best", "--output-dir", str(out), "--metrics-out", str(metrics)])
    assert code == 0, capsys.readouterr().err
    m = json.loads(metrics.read_text())
    # the loop took the kind's loss at every step, and evaluation its score (each epoch's end and the last step)
    assert AbsoluteObjective.calls["loss"] == 4 and AbsoluteObjective.calls["score"] >= 1
    assert m["problem"] == "regression-l1" and m["main_metric"] == "mae" and m["best"]["metric"] == "mae"
    assert m["eval"]["n"] == 12 and 0 <= m["eval"]["mae"] < 10
    with open(out / "predictions.csv", newline="", encoding="utf-8") as f:
        predicted = list(csv.DictReader(f))
    assert [r["sentence"] for r in predicted] == [f"a sentence with {i % 7} words more or less" for i in range(9, 14)]
    # xla-train predict reads the folder back as the kind that trained it (its record's) and agrees
    assert type(from_folder(out)) is AbsoluteError
    again = tmp_path / "again.csv"
    assert main(["predict", "--backend", "cpu", "--model", str(out), "--input", str(test), "--output", str(again)]) == 0
    with open(again, newline="", encoding="utf-8") as f:
        assert [float(r["prediction"]) for r in csv.DictReader(f)] == pytest.approx(
            [float(r["prediction"]) for r in predicted], abs=1e-5)
