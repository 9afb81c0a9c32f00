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
        task = self.config_name
        if task in REGRESSION:
            out = {"pearson": float(pearsonr(p, r)[0]), "spearmanr": float(spearmanr(p, r)[0])}
            if task == "regression":
                out["mse"] = float(np.mean((p - r) ** 2))
            return out
        if task == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(r, p))}
        out = {"accuracy": float((p == r).mean())}
        if task in ("mrpc", "qqp"):
            out["f1"] = float(f1_score(r, p))
        elif task == "classification":
            out["f1"] = float(f1_score(r, p, average="macro"))
        return out
