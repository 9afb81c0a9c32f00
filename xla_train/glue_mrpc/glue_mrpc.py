"""GLUE MRPC accuracy and F1 as an `evaluate` metric module that loads without the hub.

Same definitions as `evaluate.load("glue", "mrpc")`: accuracy, and F1 of the positive class
(sklearn's `f1_score`). Loaded from this folder with `evaluate.load(path)`.
"""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import f1_score


class GlueMrpc(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="GLUE MRPC: accuracy and F1 of the paraphrase class.",
            citation="Wang et al., GLUE: A Multi-Task Benchmark and Analysis Platform for NLU, 2019.",
            inputs_description="predictions and references: lists of 0/1 labels.",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()),
                "f1": float(f1_score(references, predictions))}
