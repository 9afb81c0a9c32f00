"""Evaluation during training: every evaluation split scored by the task's metric, every row
exactly once (the trainer prints, logs and records the scores: train.Trainer.evaluate)."""

import functools

from .core.inference import infer
from .tasks.base import as_loaded


def evaluate_model(engine, model, eval_dl, objective, metric, source=as_loaded):
    """The metrics of a kind's `objective` over every row of one evaluation split exactly once
    (`compute` empties `metric` for the next call), and `n`, the rows scored. `source`: what makes
    a batch of a loaded one (Objective.batch_source, told the split)."""
    return objective.score(metric, infer(engine, model, eval_dl, objective.eval_columns, forward=objective.forward,
                                         prepare=source))


def evaluate_all(engine, model, task, eval_dls, metric, source=as_loaded):
    """Every evaluation split, keys suffixed per split (MNLI's mismatched set: `accuracy_mm`, `n_mm`)."""
    results = {}
    for split, dl in eval_dls.items():
        suffix = task.objective.eval_suffix(split)
        scored = evaluate_model(engine, model, dl, task.objective, metric, functools.partial(source, split=split))
        results.update({k + suffix: v for k, v in scored.items()})
    return results


class Evaluator:
    """Scores every evaluation split with the task's metric (and writes --eval-samples' completions);
    the trainer prints, logs and records the scores."""

    def __init__(self, engine, task, loaders, samples=None, source=as_loaded):
        self.engine, self.task, self.loaders, self.source = engine, task, loaders, source
        self.main = task.main  # the metric the best model is chosen by, unless --metric-for-best
        self._metric = None  # loaded at the first evaluation: `evaluate` is not imported before the first step
        self.samples = samples and samples.generator(engine)  # --eval-samples: the task's samples

    def __call__(self, model):
        """(the scores of every split, the sample completions written or None)."""
        if self._metric is None:
            self._metric = self.task.objective.load_metric()
        results = evaluate_all(self.engine, model, self.task, self.loaders, self._metric, self.source)
        return results, (self.samples(model) if self.samples else None)
