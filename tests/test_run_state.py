"""RunState's decisions, one by one, without a run: when to evaluate, when to save, whether steps
are left, what counts as an improvement, when patience runs out, which results the final model has."""

import math

import pytest

from xla_train.core.engine import Engine
from xla_train.options import TrainOptions
from xla_train.run_state import RunState, _improves


@pytest.fixture(scope="module")
def engine():
    return Engine("cpu")


def state(engine, **options):
    return RunState(engine, TrainOptions(backend="cpu", **options))


def test_evaluations_every_n_steps_and_at_the_last(engine):
    s = state(engine, eval_every=3)
    due = []
    for s.step in range(1, 11):
        due.append(s.eval_due(total_steps=10))
    assert [step for step, d in zip(range(1, 11), due) if d] == [3, 6, 9, 10]
    assert not state(engine).eval_due(total_steps=10)  # without --eval-every: at epoch ends
    plain = state(engine)
    plain.step = 4
    assert plain.eval_at_epoch_end(total_steps=10)
    s.step, s.evaluations = 10, [[9, {}]]
    assert s.eval_at_epoch_end(total_steps=10)  # the last step was not evaluated yet
    s.evaluations.append([10, {}])
    assert not s.eval_at_epoch_end(total_steps=10)


def test_checkpoints_every_n_steps_each_epoch_and_at_the_end(engine, tmp_path):
    assert not state(engine).save_due(10, end_of_epoch=True)  # no output folder: never
    every = state(engine, output_dir=str(tmp_path), save_every=4)
    saves = []
    for every.step in range(1, 11):
        saves.append(every.save_due(10))
    assert [step for step, d in zip(range(1, 11), saves) if d] == [4, 8]
    every.step = 6
    assert not every.save_due(10, end_of_epoch=True) and every.save_due(10) is False
    every.step = 10
    assert every.save_due(10, end_of_epoch=True)  # the end of the run, whatever --save-every says
    epochs = state(engine, output_dir=str(tmp_path))
    epochs.step = 3
    assert epochs.save_due(10, end_of_epoch=True) and not epochs.save_due(10)


def test_unfinished_while_steps_are_left_or_an_epoch_was_cut(engine):
    s = state(engine)
    s.step, s.batch = 5, 0
    assert s.unfinished(10)
    s.step = 10
    assert not s.unfinished(10)
    s.batch = 3  # stopped at its last step mid-epoch: the epoch's evaluation is still due
    assert s.unfinished(10)
    s.stopped_early = True
    assert not s.unfinished(10)


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

    from xla_train.train import linear_schedule

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
