"""Where a run stands, and its checkpoints.

`RunState` holds the position (optimizer steps, epoch, micro-batches taken from the epoch), the
loss tracker, the loss history, the evaluations and the best one, and the latest checkpoint. It
records log points, makes every replica agree on stopping (a signal or a non-finite loss on any of
them), keeps the best model (--save-best), counts evaluations for early stopping
(--early-stopping-patience), and writes, resumes and restores checkpoints. When each of these
happens is the loop's decision (train.Trainer).
"""

import math

import torch

from ..core.errors import Stopped
from ..core.ties import first_names_only
from ..io.storage import open_store
from ..tasks import MINIMISED
from . import checkpoint


class LossTracker:
    """The running sum of the loss and the first micro-step whose loss was not finite, kept on the
    device as one tensor [sum, micro-steps, first bad micro-step] and read only at log points."""

    def __init__(self, engine, loss_sum, micro_steps, grad_accum):
        # Made on the CPU and uploaded: torch_xla turns a constant made on the device into a
        # graph of its own, compiled and run once before the first step.
        self.t = torch.tensor([loss_sum, float(micro_steps), 0.0]).to(engine.device)
        self.grad_accum = grad_accum

    def add(self, loss):
        loss = loss.detach().float()
        micro = self.t[1] + 1
        first_bad = torch.where((self.t[2] == 0) & ~torch.isfinite(loss), micro, self.t[2])
        self.t = torch.stack([self.t[0] + loss / self.grad_accum, micro, first_bad])

    def parse(self, host):
        """(loss sum, first optimizer step with a non-finite loss or None) from `t` on the CPU."""
        total, _, first_bad = (float(x) for x in host)
        return total, (math.ceil(first_bad / self.grad_accum) if first_bad else None)


class MetricTracker:
    """A kind's own training metrics (Objective.step_metrics): their running sums over micro-steps,
    one device tensor read with the loss at log points; None until a micro-step gives some."""

    def __init__(self, engine, saved=None):
        """`saved`: a checkpoint's sums ({"names", "sums"}), restored so that a resumed run's means
        are an uninterrupted one's to the bit (the sums are float32 on the device)."""
        self.engine, self.names, self.t = engine, None, None
        if saved:
            self.names = saved["names"]
            self.t = torch.tensor(saved["sums"], dtype=torch.float32).to(engine.device)

    def add(self, values):
        if not values:
            return
        if self.names is None:  # uploaded from the CPU, as LossTracker's: no constant graph of its own
            self.names = list(values)
            self.t = torch.zeros(len(self.names)).to(self.engine.device)
        assert self.t is not None  # made with `names`, above
        self.t = self.t + torch.stack([values[name].detach().float() for name in self.names])


class RunState:
    """One per worker: the run's position, loss, evaluations and checkpoints."""

    def __init__(self, engine, checkpoints, evaluation, grad_accum=1, resume=None):
        """`checkpoints` and `evaluation`: the options' sections (options.Section) of those names;
        `grad_accum`: micro-batches per optimizer step."""
        run = resume.state["run"] if resume else {}
        self.engine, self.checkpoints, self.evaluation, self.resume = engine, checkpoints, evaluation, resume
        self.store = open_store(checkpoints.output_dir) if checkpoints.output_dir else None
        self.step, self.epoch, self.batch = run.get("step", 0), run.get("epoch", 0), run.get("batch", 0)
        self.history = run.get("history", [])  # [step, mean loss since the last entry, lr, loss sum]
        self.results = run.get("results")  # the latest evaluation
        self.evaluations = run.get("evaluations", [])  # [[step, results], ...]
        self.best = run.get("best")  # {"step", "metric", "value"} of the best evaluation so far
        self.bad_evals = run.get("bad_evals", 0)  # evaluations since the best one
        self.stopped_early = run.get("stopped_early", False)
        self.best_weights = None  # the best model on the CPU, with --save-best and no output folder
        self.first_step = self.step
        self.tracker = LossTracker(engine, run.get("loss_sum", 0.0), self.step * grad_accum, grad_accum)
        saved_metrics = run.get("metric_sums")
        self.metrics = MetricTracker(engine, saved_metrics)  # the kind's own training metrics, if any
        self.train_metrics = run.get("train_metrics", [])  # [step, {name: mean since the last entry}]
        # the step and sums of the last read
        self._metrics_read = tuple(saved_metrics["read"]) if saved_metrics else (self.step, None)
        self.grad_accum = grad_accum
        self.bad_step = None  # the first optimizer step whose loss was not finite, once known
        # the latest checkpoint, and the position it holds
        self.saved: str | None
        self.saved_at: tuple[int, int, int] | None
        self.saved, self.saved_at = (resume.url, self.position) if resume else (None, None)
        self._checkpoint_args = None

    @property
    def position(self):
        return self.step, self.epoch, self.batch

    # --- the loss ---------------------------------------------------------------------------
    def logged(self, step, lr, tracker):
        """Records a log point from the loss tracker's values on the host (`LossTracker.t`): the mean
        loss since the previous log point, in the history and returned; a non-finite loss noted."""
        total, bad = self.tracker.parse(tracker)
        self.bad_step = self.bad_step or bad
        prev_step, prev_total = (self.history[-1][0], self.history[-1][3]) if self.history else (0, 0.0)
        loss = (total - prev_total) / (step - prev_step)
        self.history.append([step, round(loss, 6), lr, total])
        return loss

    def logged_metrics(self, step, sums):
        """Records a log point's kind metrics from `MetricTracker.t` on the host: each one's mean
        over the micro-steps since the previous read, in `train_metrics` and returned."""
        prev_step, prev = self._metrics_read
        assert self.metrics.names is not None  # a log point reads metrics once a micro-step gave some
        sums = [float(x) for x in sums]
        micro = max(1, (step - prev_step) * self.grad_accum)
        means = {name: round((s - (prev[i] if prev else 0.0)) / micro, 6)
                 for i, (name, s) in enumerate(zip(self.metrics.names, sums))}
        self._metrics_read = (step, sums)
        self.train_metrics.append([step, means])
        return means

    def check_finite(self, *also):
        """Reads the loss tracker (a sync), with the device tensors `also` in the same transfer,
        and stops every replica if any saw a non-finite loss. Returns the loss sum, then `also`'s
        host copies."""
        host, *copies = self.engine.to_host([self.tracker.t, *also])
        total, bad = self.tracker.parse(host)
        (self.bad_step,) = self._agree([self.bad_step or bad or 0])
        if self.bad_step:
            raise self.diverged()
        return [total, *copies]

    # --- stopping -----------------------------------------------------------------------------
    def agree(self, signum):
        """(signal, first bad step): the largest of each any replica has (None for none), so that
        every replica stops alike (a collective every replica reaches)."""
        flags = self._agree([signum or 0, self.bad_step or 0])
        self.bad_step = flags[1] or None
        return flags[0] or None, self.bad_step

    def _agree(self, flags):
        """Per position, the largest value any replica has (a collective every replica reaches)."""
        if self.engine.strategy.peers == 1:
            return flags
        return self._agree_across(flags)

    def _agree_across(self, flags):
        # Cut the step's graph first, as xm.rendezvous does (torch_xla 2.9's
        # core.xla_model.xla_rendezvous): the step then runs as the graph already compiled, and the
        # flags' all_gather is a small graph of its own. Built on the pending step, the gather
        # and the step would compile as one new graph at the first log point of every bucket.
        self.engine.cut_graph()
        # int32: 64-bit integer collectives may not lower on TPU (pytorch/xla#1952). The largest
        # is taken on the device: under SPMD the rows are sharded over several hosts' devices.
        # one expression: a gathered tensor still named at the copy would be a second output of the graph
        (agreed,) = self.engine.to_host([self.engine.strategy.gather_rows(torch.tensor(flags, dtype=torch.int32))
                                         .amax(0)])
        return agreed.tolist()

    def diverged(self):
        """The `Stopped` error of a non-finite loss (exit 3)."""
        return Stopped(f"the training loss was not finite at step {self.bad_step}; stopped without saving "
                       f"(last good checkpoint: {self.saved or 'none'}); try a lower --lr or --max-grad-norm", 3)

    # --- evaluations and the best model -------------------------------------------------------
    def evaluated(self, results, model, main_metric):
        """Records an evaluation: the best so far (its weights kept with --save-best) and the
        early-stopping count. Every replica has the same results, so all decide alike."""
        self.results = results
        self.evaluations.append([self.step, results])
        name = self.evaluation.metric_for_best or main_metric
        if _improves(results[name], self.best["value"] if self.best else None, name in MINIMISED):
            self.best, self.bad_evals = {"step": self.step, "metric": name, "value": results[name]}, 0
            if self.evaluation.save_best:
                self.best_weights = checkpoint.save_best(self.engine, self.store, model)
        else:
            self.bad_evals += 1
        patience = self.evaluation.early_stopping_patience
        if patience and self.bad_evals >= patience:
            self.stopped_early = True
            assert self.best is not None  # every evaluation has set it: the first one always improves
            self.engine.print(f"early stopping at step {self.step}: {name} has not improved in {patience} "
                              f"evaluation(s); the best, {self.best['value']:.4f}, was at step {self.best['step']}")

    def restore_best(self, model):
        """With --save-best: puts the best evaluation's weights back into `model`. Returns the
        results of the evaluation the model now has."""
        if not (self.evaluation.save_best and self.best) or self.best["step"] == self.evaluations[-1][0]:
            return self.results
        weights = self.best_weights if self.best_weights is not None else checkpoint.load_best(self.store)
        weights, _ = first_names_only(self.engine.unwrap_model(model), weights)  # a tie by its first name (core.ties)
        self.engine.strategy.load_weights(model, weights)
        return next(r for s, r in self.evaluations if s == self.best["step"])

    # --- checkpoints --------------------------------------------------------------------------
    def track(self, model, optimizer, scheduler, clock, extra):
        """What a checkpoint holds besides the position: the objects, and `extra` state (JSON).
        A resumed run loads the optimizer's and scheduler's state and the random state here."""
        self._checkpoint_args = (model, optimizer, scheduler, clock, extra)
        if self.resume:
            self.resume.load_training_state(self.engine, model, optimizer, scheduler, self.engine.data_parallel_size)
            self.engine.print(f"resumed from {self.resume.url} at step {self.step}")

    def save(self):
        """Writes a checkpoint of this position (once; every replica calls it). Returns its URL."""
        if self.saved_at == self.position:
            return self.saved
        assert self._checkpoint_args is not None  # set by track(), before the first save
        model, optimizer, scheduler, clock, extra = self._checkpoint_args
        # The pending step's graph is cut here, so its log point's read (a step closure) is
        # counted as the training's sync, not the checkpoint's (the wait for the step's device
        # time may still fall in the checkpoint's phase when no log point forced it).
        self.engine.cut_graph()
        with clock.excluding():  # a checkpoint's reads are not the training steps' syncs
            metrics = self.metrics
            loss_sum, *kept = self.check_finite(*([] if metrics.t is None else [metrics.t]))  # one transfer
            sums = {"names": metrics.names, "read": self._metrics_read, "sums": kept[0].tolist()} if kept else None
            run = {"step": self.step, "epoch": self.epoch, "batch": self.batch, "loss_sum": loss_sum,
                   "history": self.history, "results": self.results, "evaluations": self.evaluations,
                   "best": self.best, "bad_evals": self.bad_evals, "stopped_early": self.stopped_early,
                   "train_metrics": self.train_metrics, "metric_sums": sums}
            state = {"run": run, **extra, "world_size": self.engine.data_parallel_size}
            self.saved = checkpoint.save(self.engine, self.store, model, optimizer, scheduler, state,
                                         self.checkpoints.keep_last)
        self.saved_at = self.position
        return self.saved


def _improves(value, best, minimise):
    """Whether `value` beats `best` (None: nothing yet); a NaN never does, and anything beats one."""
    if math.isnan(value):
        return best is None
    if best is None or math.isnan(best):
        return True
    return value < best if minimise else value > best
