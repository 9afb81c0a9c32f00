"""GLUE's metrics, and those for a user's own data, as one `evaluate` metric module that loads
without the hub: `evaluate.load(path_of_this_folder, config_name)`.

config_name: a GLUE task (the same definitions as `evaluate.load("glue", task)`: CoLA Matthews
correlation, STS-B Pearson and Spearman, MRPC and QQP accuracy and F1 of the positive class, the
others accuracy), "classification" (accuracy and macro F1) or "regression" (Pearson, Spearman, MSE).
"""

import datasets
import evaluate
import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

REGRESSION = ("stsb", "regression")
KNOWN = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli", "classification", "regression")
# The keys each config computes, the main one first (others: accuracy). The one statement of them:
# the tasks read it (`keys`) for --metric-for-best's choices.
KEYS = {"cola": ("matthews_correlation",), "stsb": ("pearson", "spearmanr"), "mrpc": ("accuracy", "f1"),
        "qqp": ("accuracy", "f1"), "classification": ("accuracy", "f1"), "regression": ("pearson", "spearmanr", "mse")}


def keys(config_name):
    return KEYS.get(config_name, ("accuracy",))


def _f1(p, r, config_name):
    # MRPC and QQP: F1 of the positive class (GLUE's); own data: macro F1 over the classes
    return f1_score(r, p, average="macro" if config_name == "classification" else "binary")


VALUES = {  # key: value from (predictions, references, config name)
    "pearson": lambda p, r, _: float(pearsonr(p, r)[0]),
    "spearmanr": lambda p, r, _: float(spearmanr(p, r)[0]),
    "mse": lambda p, r, _: float(np.mean((p - r) ** 2)),
    "matthews_correlation": lambda p, r, _: float(matthews_corrcoef(r, p)),
    "accuracy": lambda p, r, _: float((p == r).mean()),
    "f1": lambda p, r, name: float(_f1(p, r, name)),
}


class TaskMetric(evaluate.Metric):
    def _info(self):
        if self.config_name not in KNOWN:
            raise KeyError(f"config_name must be one of {', '.join(KNOWN)}, not {self.config_name!r}")
        value = "float32" if self.config_name in REGRESSION else "int64"
        return evaluate.MetricInfo(
            description="GLUE task metrics, and accuracy/macro F1 or Pearson/Spearman/MSE for own data.",
            citation="Wang et al., GLUE: A Multi-Task Benchmark and Analysis Platform for NLU, 2019.",
            inputs_description="predictions and references: class ids, or floats for a regression.",
            features=datasets.Features({"predictions": datasets.Value(value), "references": datasets.Value(value)}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        return {key: VALUES[key](p, r, self.config_name) for key in keys(self.config_name)}
