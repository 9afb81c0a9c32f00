"""The loop's decisions and RunState's records, one by one, without a run: when to evaluate, when
to save, whether steps are left (train.Trainer), what counts as an improvement, when patience runs
out, which results the final model has (RunState)."""

import math

import pytest

from xla_train.commands.train import Trainer
from xla_train.core.engine import Engine
from xla_train.options import TrainOptions
from xla_train.run.state import RunState, _improves


@pytest.fixture(scope="module")
def engine():
    return Engine("cpu")


def state(engine, **options):
    cfg = TrainOptions(backend="cpu", **options)
    return RunState(engine, cfg.section("checkpoints"), cfg.section("evaluation"), cfg.grad_accum)


def trainer(engine, total_steps=10, **options):
    """A Trainer without a job: its decisions read only the options, the run state and the step count."""
    t = Trainer.__new__(Trainer)
    t.cfg = TrainOptions(backend="cpu", **options)
    t.state, t.total_steps = state(engine, **options), total_steps
    return t


def test_evaluations_every_n_steps_and_at_the_last(engine):
    t = trainer(engine, eval_every=3)
    due = []
    for t.state.step in range(1, 11):
        due.append(t.eval_due())
    assert [step for step, d in zip(range(1, 11), due) if d] == [3, 6, 9, 10]
    assert not trainer(engine).eval_due()  # without --eval-every: at epoch ends
    plain = trainer(engine)
    plain.state.step = 4
    assert plain.eval_at_epoch_end()
    t.state.step, t.state.evaluations = 10, [[9, {}]]
    assert t.eval_at_epoch_end()  # the last step was not evaluated yet
    t.state.evaluations.append([10, {}])
    assert not t.eval_at_epoch_end()


def test_checkpoints_every_n_steps_each_epoch_and_at_the_end(engine, tmp_path):
    assert not trainer(engine).save_due(end_of_epoch=True)  # no output folder: never
    every = trainer(engine, output_dir=str(tmp_path), save_every=4)
    saves = []
    for every.state.step in range(1, 11):
        saves.append(every.save_due())
    assert [step for step, d in zip(range(1, 11), saves) if d] == [4, 8]
    every.state.step = 6
    assert not every.save_due(end_of_epoch=True) and every.save_due() is False
    every.state.step = 10
    assert every.save_due(end_of_epoch=True)  # the end of the run, whatever --save-every says
    epochs = trainer(engine, output_dir=str(tmp_path))
    epochs.state.step = 3
    assert epochs.save_due(end_of_epoch=True) and not epochs.save_due()


def test_unfinished_while_steps_are_left_or_an_epoch_was_cut(engine):
    t = trainer(engine)
    t.state.step, t.state.batch = 5, 0
    assert t.unfinished()
    t.state.step = 10
    assert not t.unfinished()
    t.state.batch = 3  # stopped at its last step mid-epoch: the epoch's evaluation is still due
    assert t.unfinished()
    t.state.stopped_early = True
    assert not t.unfinished()


def test_a_log_point_records_the_mean_loss_since_the_previous_one(engine):
    """RunState.logged: from the tracker's running sum on the host, the mean loss per step since
    the previous log point; the first non-finite micro-step's optimizer step is noted."""
    s = state(engine, grad_accum=2)
    assert s.logged(2, 1e-3, [3.0, 4.0, 0.0]) == 1.5 and s.bad_step is None
    assert s.logged(6, 5e-4, [5.0, 12.0, 0.0]) == 0.5
    assert s.history == [[2, 1.5, 1e-3, 3.0], [6, 0.5, 5e-4, 5.0]]
    s.logged(7, 5e-4, [math.nan, 14.0, 13.0])  # micro-step 13: optimizer step 7
    assert s.bad_step == 7 and s.agree(None) == (None, 7)  # one replica: its own flags


def test_what_counts_as_an_improvement():
    assert _improves(0.5, None, minimise=False) and _improves(0.6, 0.5, minimise=False)
    assert not _improves(0.5, 0.5, minimise=False) and not _improves(0.4, 0.5, minimise=False)
    assert _improves(0.1, 0.2, minimise=True) and not _improves(0.3, 0.2, minimise=True)  # mse
    assert not _improves(math.nan, 0.2, minimise=True) and _improves(math.nan, None, minimise=False)
    assert _improves(0.9, math.nan, minimise=False)  # anything beats a NaN


def test_patience_counts_evaluations_without_improvement(engine, capsys):
    s = state(engine, early_stopping_patience=2)
    for s.step, accuracy in ((1, 0.6), (2, 0.7), (3, 0.65), (4, 0.7)):
        s.evaluated({"accuracy": accuracy, "n": 8}, model=None, main_metric="accuracy")
        assert s.stopped_early == (s.step == 4)
    assert s.best == {"step": 2, "metric": "accuracy", "value": 0.7} and s.bad_evals == 2
    assert "early stopping at step 4" in capsys.readouterr().out
    minimised = state(engine, metric_for_best="mse")
    for minimised.step, mse in ((1, 0.5), (2, 0.3), (3, 0.4)):
        minimised.evaluated({"mse": mse, "n": 8}, model=None, main_metric="pearson")
    assert minimised.best["step"] == 2 and not minimised.stopped_early


def test_the_final_results_are_the_last_evaluations_unless_the_best_is_kept(engine):
    s = state(engine)
    for s.step, accuracy in ((1, 0.7), (2, 0.6)):
        s.evaluated({"accuracy": accuracy}, model=None, main_metric="accuracy")
    assert s.restore_best(model=None) == {"accuracy": 0.6}  # without --save-best: the last


@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (10, 10), (2, 1)])
def test_the_linear_schedule_is_transformers_own(warmup, total):
    """train.linear_schedule (written out, so that start-up does not import peft through
    transformers.optimization) gives get_scheduler("linear")'s rates at every step, past the end
    too, and the same state dict (what a checkpoint keeps)."""
    import torch
    from transformers import get_scheduler

    from xla_train.commands.train import linear_schedule

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        scheduler = make(optimizer)
        out = []
        for _ in range(total + 3):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out, scheduler.state_dict()

    ours, ours_state = rates(lambda o: linear_schedule(o, warmup, total))
    theirs, their_state = rates(lambda o: get_scheduler("linear", o, num_warmup_steps=warmup,
                                                         num_training_steps=total))
    assert ours == theirs and ours_state == their_state
    assert max(ours) <= 0.5 and ours[-1] == 0.0
