"""The fine-tuning job: the Hugging Face course's full training loop on xla_train's Engine API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers

`run` prepares the job once in this process (data, shapes, model: `Job`), then every worker runs
`train_worker`: a `Trainer`'s set-up, its loop (`Trainer.train`, the step read top to bottom),
its finish.
"""

import contextlib
import copy
import dataclasses
import functools

import torch
from tqdm.auto import tqdm

from .. import STARTED
from ..core.batching import make_loader
from ..core.clock import Startup
from ..core.engine import Engine
from ..core.errors import Stopped
from ..core.select import select_roles
from ..core.signals import StopRequest
from ..evaluation import Evaluator
from ..job import Job, launch, open_output, prepare, pretrained
from ..memory import check_fits, checkpointing_needed, device_bytes, shape_of
from ..memory import describe as describe_memory
from ..memory import plan as plan_of
from ..observe.monitor import Monitor
from ..observe.profile import Profile
from ..run import outputs
from ..run.state import RunState
from ..tasks import scores
from ..tasks.base import as_loaded

# ---------------------------------------------------------------------------------------------
# In the launching process: every check, then the job, then the workers


def run(cfg, started=None):
    """Runs the whole job: data in this process, then training on every local worker. `started`:
    when the command began (default: the package's import, the process's start near enough)."""
    startup = Startup(started or STARTED)
    startup.lap("imports")  # this module's imports: torch, transformers, the package
    cfg.validate()
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy, cfg.mesh())
    if cfg.compile:
        backend.use_compile()  # refused before any work where it does not apply; --buckets auto counts its cost
    if cfg.tf32:
        backend.accelerator.use_tf32()  # refused before any work off CUDA (each worker sets it again)
    folder, resume, done = open_output(cfg, backend)
    if done:
        print(done)
        return None
    job = prepare(cfg, backend, resume, startup)
    job.run_id = folder.claim(resume) if folder else None  # every check passed: the folder is this run's
    job.pod_marker = folder.pod_marker if folder else None
    launch(backend, job, train_worker)


# ---------------------------------------------------------------------------------------------
# In every worker: set-up, the loop, the finish


def train_worker(job: Job) -> dict:
    """The training function each worker runs (the launchers call it): the course's loop on the
    Engine API. Returns the run's metrics."""
    trainer = Trainer(job)
    trainer.setup()
    try:
        trainer.train()
    finally:
        trainer.profile.close()  # a run stopped inside the window keeps what was captured
    return trainer.finish()


class Trainer:
    """One worker's training, as a torchtune recipe: `setup` puts the model, optimizer, schedule,
    loaders and run state on the device; `train` is the loop, each step read top to bottom;
    `finish` writes what the run leaves.

    Observers are called at named points of the loop and never change what it computes: the
    monitor (TensorBoard, trackers, the compilation log) at each step, log point and evaluation;
    its clock (training-phase time, goodput) around the loader and each training phase; the
    profile (--profile-steps) around each micro-batch. `RunState` keeps where the run stands (the
    position, the loss, evaluations, the best model) and writes and restores checkpoints."""

    def __init__(self, job: Job) -> None:
        """The engine (seeded for dropout) and the observers, before anything is compiled."""
        cfg = self.cfg = job.cfg
        self.job, self.task = job, job.task
        self.engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                             max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                             compile_cache=cfg.compile_cache, strategy=cfg.strategy, compile=cfg.compile,
                             tf32=cfg.tf32)
        self.engine.seed(cfg.seed)  # dropout
        self.shapes = dataclasses.replace(job.shapes, devices=self.engine.data_parallel_size)  # shapes.Shapes
        # TensorBoard, compilation log, explainer and the run's clock; before anything is compiled
        self.monitor = Monitor(self.engine, cfg.output_dir, self.shapes, job.startup, job.run_id, cfg.report_to,
                               dataclasses.asdict(cfg))
        self.clock = self.monitor.clock  # core.clock.RunClock
        self.bar: tqdm | None = None  # the progress bar, while `train` runs
        self.stopping = False  # a signal agreed on, the run stopping at the next step it can save at

    def setup(self) -> None:
        """Loaders, model, optimizer and schedule on the device; the run state (resumed if asked)."""
        engine, job, cfg, task = self.engine, self.job, self.cfg, self.task
        model = _private_copy(job.model)
        # the memory plan and the parameter counts, before anything compiles: checkpointing where only it fits
        self.memory, checkpointed = plan_memory(engine, cfg, self.shapes, model, task.objective)  # memory.Plan
        if checkpointed:
            engine.checkpoint_activations(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      fused=engine.fused_optimizer or None)
        self.model, self.optimizer = engine.prepare(model, optimizer)

        def loader(ds, split, order=False):  # filler: repeats to train on, masked rows to score
            training = split == "train" and not order
            return make_loader(ds, job.tokenizer, self.shapes.batch_size, self.shapes.padding, shuffle=training,
                               seed=cfg.seed, fill="repeat" if training else "mask",
                               collate=task.rows.collator(job.tokenizer),
                               repeats=self.shapes.repeats if training else 1, grad_accum=cfg.grad_accum)

        # the kind's columns computed with the model before training (a preference kind's reference log-probabilities)
        data = task.objective.before_training(engine, self.model, job.data,
                                              lambda ds, split: engine.prepare(loader(ds, split, order=True)),
                                              functools.partial(_initial_model, engine, job, self.model))
        self.train_dl, *eval_dls = engine.prepare(*[loader(data[split], split)
                                                    for split in ("train", *task.eval_splits)])
        n_train = len(job.data["train"])
        self.steps_per_epoch = self.shapes.steps_per_epoch(n_train)
        self.total_steps = self.shapes.total_steps(n_train, cfg.epochs, cfg.max_steps)
        self.scheduler = linear_schedule(self.optimizer, int(cfg.warmup_ratio * self.total_steps), self.total_steps)
        self.state = RunState(engine, cfg.section("checkpoints"), cfg.section("evaluation"), cfg.grad_accum,
                              job.resume)  # where the run stands; its checkpoints
        padding = self.shapes.padding
        assert padding is not None  # the job settled it (job.prepare)
        self.state.track(self.model, self.optimizer, self.scheduler, self.clock,
                         {"buckets": padding.bucket_list, "n_train": n_train, "run_id": job.run_id,
                          "config": dataclasses.asdict(cfg)})
        # what makes the step's batch of a loaded one: the batch itself, or a kind's rollouts (GRPO)
        self.source = task.objective.batch_source(engine, job.tokenizer, data, self.model, self.total_steps,
                                                  functools.partial(_initial_model, engine, job, self.model, True))
        self.evaluator = Evaluator(engine, task, dict(zip(task.eval_splits, eval_dls)), job.samples, self.source)
        self.profile = Profile(engine, cfg.profile_steps, self.state.store)  # --profile-steps

    def train(self) -> None:
        """The course's loop: fetch, forward, backward, optimizer step, schedule; then the log point,
        the stop check, evaluation and checkpoint at their steps. Every replica stops at the same
        step, on a signal or a non-finite loss. Nothing here reads the device (rule 4): the loss is
        read in a step closure at log points, and replicas agree on stopping at log points only."""
        engine, cfg, state, clock, model, total = \
            self.engine, self.cfg, self.state, self.clock, self.model, self.total_steps
        objective = self.task.objective
        bar = self.bar = tqdm(total=total, initial=state.step, desc="Training", disable=not engine.is_main_process,
                              dynamic_ncols=True)
        with StopRequest() as stop, bar:  # the bar is closed (its line ended) before any message
            while self.unfinished():
                self.train_dl.set_epoch(state.epoch, start=state.batch)
                model.train()
                clock.start()  # a training phase begins
                for batch in clock.timed(self.train_dl):  # fetch: its waits are the data's, not the step's
                    if state.step >= total or state.batch == self.steps_per_epoch * cfg.grad_accum:
                        break  # done, or the epoch's last micro-batches would not fill an optimizer step
                    state.batch += 1
                    engine.seed_micro_batch(cfg.seed, state.epoch, state.batch)  # dropout: from the position
                    with self.profile.micro_batch(state.step + 1):  # inside --profile-steps' window: annotated
                        with self.rollout_phase():  # GRPO: a rollout (generation, rewards), timed apart
                            inputs = self.source(model, batch, step=state.step, epoch=state.epoch)
                        labels = inputs.pop("labels")  # the loss is the job's own: no model head can add a host sync
                        with engine.autocast():
                            output = objective.forward(model, inputs)  # forward
                            loss = objective.loss(output, labels)
                        engine.backward(loss)
                        state.tracker.add(loss)  # on the device: read at log points
                        state.metrics.add(objective.step_metrics(output, labels))  # the kind's own, if any
                        del output, inputs
                        stepped = engine.optimizer_step(self.optimizer)  # at the last micro-batch of a step
                    if not stepped:
                        continue
                    lr = self.scheduler.get_last_lr()[0]  # the rate this step used
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    state.step += 1
                    bar.update(1)
                    self.monitor.step(state.step, batch)
                    log_point = state.step % cfg.log_every == 0 or state.step == total
                    if log_point:  # the loss is read once the step has run (a step closure on XLA)
                        engine.step_closure(self._log, (state.step, lr, engine.last_grad_norm))
                        clock.mark(state.step)
                    self.check_stop(stop, log_point)  # a signal or a non-finite loss on any replica
                    if self.eval_due():  # --eval-every
                        self.evaluate(f"step {state.step}", mid_epoch=True)
                    if self.save_due():  # --save-every
                        state.save()
                    if state.step == total or state.stopped_early:
                        break
                clock.stop(state.step)  # the training phase's time ends here, before evaluation
                self.profile.ended(state.step)  # after the cut that ran the loop's last step
                state.epoch, state.batch = state.epoch + 1, 0
                if self.eval_at_epoch_end():
                    self.evaluate(f"epoch {state.epoch}")
                clock.end_of_epoch()
                if self.save_due(end_of_epoch=True):
                    state.save()  # every epoch by default; the end of the run in any case

    def rollout_phase(self):
        """The clock's rollout phase around the batch source where the kind makes its rows in the
        step (its source is not the loaded batch itself); else nothing to time."""
        return self.clock.rolling_out() if self.source is not as_loaded else contextlib.nullcontext()

    # --- the loop's decisions ---------------------------------------------------------------
    def unfinished(self) -> bool:
        """Steps are left, or an epoch was cut short (a run stopped at its last step resumes
        for the evaluation it had not run); never after early stopping."""
        state = self.state
        return not state.stopped_early and (state.step < self.total_steps or state.batch > 0)

    def eval_due(self) -> bool:
        """With --eval-every N: every N steps and at the last one (else at each epoch's end)."""
        every, step = self.cfg.eval_every, self.state.step
        return bool(every) and (step % every == 0 or step == self.total_steps)

    def eval_at_epoch_end(self) -> bool:
        """Without --eval-every, at every epoch's end; with it, only if the run's last step has not
        been evaluated (a run stopped by a signal right at its end)."""
        if not self.cfg.eval_every:
            return True
        state = self.state
        last = state.evaluations[-1][0] if state.evaluations else None
        return state.step == self.total_steps and last != state.step and not state.stopped_early

    def save_due(self, end_of_epoch: bool = False) -> bool:
        """Whether a checkpoint is due now: every --save-every steps, else at each epoch's end; the
        end of the run in any case; never without an output folder."""
        every, state = self.cfg.save_every, self.state
        if not state.store:
            return False
        if end_of_epoch:
            return not every or state.step == self.total_steps or state.stopped_early
        return bool(every) and state.step % every == 0

    # --- the loop's named points --------------------------------------------------------------
    def _log(self, step, lr, grad_norm):
        """A log point, once its step has run: the mean loss since the previous one, from the
        running sum and the gradient norm (one transfer), to the bar and the monitor."""
        assert self.bar is not None  # a log point comes inside train(), which makes the bar
        metrics = self.state.metrics
        host = self.engine.strategy.read([self.state.tracker.t] + ([grad_norm] if grad_norm is not None else [])
                                         + ([metrics.t] if metrics.t is not None else []))
        loss = self.state.logged(step, lr, host[0])
        grad_norm = float(host[1]) if grad_norm is not None else None
        extra = self.state.logged_metrics(step, host[-1]) if metrics.t is not None else {}
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False,
                             **{k: f"{v:.3f}" for k, v in list(extra.items())[:2]})  # the kind's first two
        self.monitor.log(step, loss, lr, grad_norm, extra)

    def check_stop(self, stop: StopRequest, at_log_point: bool) -> None:
        """Raises `Stopped` on every replica at once if any replica got a signal (after saving a
        checkpoint) or saw a non-finite loss (without saving). Where a step's batches are trained
        on several times in a row (Shapes.repeats: GRPO's K updates on one rollout, whose rule reads
        in tasks.grpo.Iterations), an agreed signal stops the run once the last of them has run: a
        checkpoint falls between rollouts."""
        state = self.state
        if not self.stopping:
            if self.engine.strategy.peers > 1 and not at_log_point:  # agreeing needs a collective
                return
            StopRequest.signum, bad_step = state.agree(stop.signum)
            if bad_step:
                raise state.diverged()
            self.stopping = bool(stop.signum)
        if self.stopping and state.step % self.shapes.repeats == 0:
            assert stop.signum is not None
            where = f"checkpoint saved to {state.save()}" if state.store else "nothing saved (no --output-dir)"
            raise Stopped(f"stopped by {stop.name} after step {state.step}: {where}"
                          + ("; continue with --resume" if state.store else ""), 128 + stop.signum)

    def evaluate(self, where: str, mid_epoch: bool = False) -> None:
        """Scores every evaluation split, prints and logs the scores, and records them in the run
        state (best model, early stopping). Mid-epoch (--eval-every) the training clock pauses."""
        step = self.state.step
        if mid_epoch:
            self.clock.stop(step)
        with self.clock.evaluating():
            results, samples = self.evaluator(self.model)
        self.engine.print(f"{where}: {scores(results)}")
        if samples:
            self.monitor.samples(step, samples)
        self.monitor.evaluated(step, results)
        self.state.evaluated(results, self.model, self.evaluator.main)
        if mid_epoch:
            self.model.train()
            self.clock.start()

    def finish(self) -> dict:
        """After the loop: the last log interval's loss checked (no closure has read it yet on XLA),
        then the final (or best) model, predictions, the metrics JSON and the run folder's files."""
        self.state.check_finite()
        return outputs.finish(self.engine, self.job, self, self.monitor)


def linear_schedule(optimizer, warmup_steps, total_steps):
    """transformers' `get_scheduler("linear", ...)`, the same LambdaLR (its state dict too): the rate
    rises to the peak over `warmup_steps`, then falls linearly to 0 at `total_steps`. Written here
    because importing transformers.optimization imports peft (trainer_utils): seconds of start-up."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_linear, warmup_steps, total_steps))


def _linear(warmup_steps, total_steps, step):
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def plan_memory(engine, cfg, shapes, model, objective):
    """The memory plan (memory.Plan) of `model` (not yet prepared) under the task's `objective` (its
    step as the kind describes it: Objective.memory_inputs) on the strategy's mesh, printed, and
    whether its blocks are to be checkpointed: as asked, or switched on (and said on the console)
    where the run fits only with it; a run that cannot fit the device even so stops here, before
    compiling. Returns (plan, checkpointed)."""
    from ..kernels.attention import kind_of
    from ..kernels.experts import planned_experts

    length = max(shapes.padding.lengths or [cfg.max_length])
    kind = kind_of(torch.empty(0, device=engine.device))
    path = objective.memory_inputs(model, kind, length)
    if path.note:  # the attention path taken, where it is not the device's kernel
        engine.print(path.note)
    length = path.length or length  # the rows the step runs, where the kind makes them longer (a completion)
    step = dataclasses.replace(path, length=length, rows=cfg.batch_size, precision=cfg.precision,
                               checkpointed=cfg.gradient_checkpointing, adapters=cfg.lora,
                               experts=planned_experts(model, kind, cfg.batch_size * length))
    mesh, device = engine.strategy.layout(), device_bytes(engine.accelerator)
    shape = shape_of(model, cfg.quantization())  # a quantized base counted as kept (kernels.quant.projection_bytes)
    memory = plan_of(mesh, step, shape, device)
    if not step.checkpointed and device and getattr(model, "supports_gradient_checkpointing", False):
        checkpointed = plan_of(mesh, dataclasses.replace(step, checkpointed=True), shape, device)
        switch, line = checkpointing_needed(memory, checkpointed)
        if switch:
            engine.print(line)
            memory = checkpointed
    engine.print(describe_memory(memory))
    check_fits(memory)
    return memory, memory.step.checkpointed


def _initial_model(engine, job, model, copy=False):
    """The model as training began from it: `model`, or where a resumed run loaded its checkpoint's
    weights (or a `copy` is asked for: a frozen reference beside the trained model), the pretrained
    model loaded again and prepared, without gradients (asked for by kinds that take log-
    probabilities from a model without adapters: with them, the base is the model as it began)."""
    if not job.resume and not copy:
        return model
    with torch.random.fork_rng(devices=[]):  # loading reseeds the host generator: not the training stream
        fresh = pretrained(engine.strategy, job.cfg, job.task, job.tokenizer)  # under FSDPv2 read into its shards
    return engine.prepare(fresh, trained=False).requires_grad_(False)  # DDP wraps only a module it could train


def _private_copy(model):
    if any(p.is_shared() for p in model.parameters()):
        # Spawned workers receive the parent's tensors in shared memory (torch.multiprocessing
        # pickling): every worker would update the same storage. Train a private copy.
        return copy.deepcopy(model)
    return model
