"""Evaluation during training: every evaluation split scored by the task's metric, every row
exactly once, printed, logged and handed to the run state (best model, early stopping)."""

from .core.inference import infer
from .generation import sample_generator
from .tasks import scores


def evaluate_model(engine, model, eval_dl, task, metric):
    """The task's metrics over every row of one evaluation split exactly once (`compute` empties
    `metric` for the next call), and `n`, the rows scored."""
    return task.score(metric, infer(engine, model, eval_dl, task.eval_columns, forward=task.forward))


def evaluate_all(engine, model, task, eval_dls, metric):
    """Every evaluation split, keys suffixed per split (MNLI's mismatched set: `accuracy_mm`, `n_mm`)."""
    results = {}
    for split, dl in eval_dls.items():
        suffix = task.eval_suffix(split)
        results.update({k + suffix: v for k, v in evaluate_model(engine, model, dl, task, metric).items()})
    return results


class Evaluator:
    """Scores every evaluation split, prints and logs the scores, and hands them to the run state
    (best model, early stopping). Mid-epoch (--eval-every) it pauses the training clock."""

    def __init__(self, engine, task, loaders, state, monitor, samples=None):
        self.engine, self.task, self.loaders, self.state, self.monitor = engine, task, loaders, state, monitor
        self.metric = task.load_metric()
        self.samples = samples and sample_generator(engine, samples)  # --eval-samples: generation.Samples

    def __call__(self, model, where, mid_epoch=False):
        if mid_epoch:
            self.monitor.clock.stop(self.state.step)
        with self.monitor.clock.evaluating():
            results = evaluate_all(self.engine, model, self.task, self.loaders, self.metric)
            written = self.samples(model) if self.samples else None
        self.engine.print(f"{where}: {scores(results)}")
        if written:
            self.monitor.samples(self.state.step, written)
        self.monitor.evaluated(self.state.step, results)
        self.state.evaluated(results, model, self.task.main)
        if mid_epoch:
            model.train()
            self.monitor.clock.start()
