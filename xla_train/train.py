"""The fine-tuning job: the Hugging Face course's full training loop on xla_train's Engine API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers

`run` prepares the job once in this process (data, shapes, model: `Job`), then every worker runs
`train_worker`: set-up, the loop, the finish.
"""

import copy
import dataclasses
import functools

import torch
from tqdm.auto import tqdm

from . import STARTED
from .core.batching import make_loader
from .core.clock import Startup
from .core.engine import Engine
from .core.select import select_roles
from .core.signals import StopRequest
from .evaluation import Evaluator
from .job import launch, open_output, prepare
from .memory import check_fits, device_bytes
from .memory import describe as describe_memory
from .memory import plan as plan_of
from .monitor import Monitor
from .outputs import finish
from .profile import Profile
from .run_state import RunState

# ---------------------------------------------------------------------------------------------
# In the launching process: every check, then the job, then the workers


def run(cfg):
    """Runs the whole job: data in this process, then training on every local worker."""
    startup = Startup(STARTED)
    startup.lap("imports")  # this module's imports: torch, transformers, the package
    cfg.validate()
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    if cfg.compile:
        backend.use_compile()  # refused before any work where it does not apply; --buckets auto counts its cost
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


@dataclasses.dataclass
class Training:
    """A worker's training objects, made by `set_up`."""

    model: object
    optimizer: object
    scheduler: object
    train_dl: object
    evaluate: object  # Evaluator
    state: RunState
    shapes: object  # shapes.Shapes: the job's, with this run's device count
    total_steps: int
    steps_per_epoch: int
    task: object  # tasks.Task: the loss
    memory: dict  # the memory plan (memory.plan), and the parameter counts
    counts: dict
    profile: Profile  # --profile-steps


def train_worker(job):
    """The training function each worker runs: the course's loop on the Engine API."""
    cfg = job.cfg
    engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                    max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                    compile_cache=cfg.compile_cache, strategy=cfg.strategy, compile=cfg.compile)
    engine.seed(cfg.seed)  # dropout
    shapes = dataclasses.replace(job.shapes, devices=engine.data_parallel_size)
    # TensorBoard, compilation log, explainer and the run's clock; before anything is compiled
    monitor = Monitor(engine, cfg, shapes, job.startup, job.run_id)
    t = set_up(engine, job, shapes, monitor)
    try:
        train_loop(engine, cfg, t, monitor)
    finally:
        t.profile.close()  # a run stopped inside the window keeps what was captured
    t.state.check_finite()  # the last log interval's loss, which no closure has read yet on XLA
    return finish(engine, job, t, monitor)


def set_up(engine, job, shapes, monitor):
    """Loaders, model, optimizer and scheduler on the device; the run state (resumed if asked)."""
    cfg, task = job.cfg, job.task
    model = _private_copy(job.model)
    if cfg.gradient_checkpointing:
        engine.checkpoint_activations(model)
    loaders = [make_loader(job.data[split], job.tokenizer, cfg.batch_size, shapes.padding, shuffle=split == "train",
                           seed=cfg.seed, fill="repeat" if split == "train" else "mask",
                           collate=task.collator(job.tokenizer))
               for split in ("train", *task.eval_splits)]  # filler: repeats to train on, masked rows to score
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=engine.fused_optimizer or None)
    train_dl, *eval_dls, model, optimizer = engine.prepare(*loaders, model, optimizer)
    memory, counts = plan_memory(engine, cfg, shapes, model, task.per_token_logits)  # before anything compiles
    steps_per_epoch = shapes.steps_per_epoch(len(job.data["train"]))
    total_steps = shapes.total_steps(len(job.data["train"]), cfg.epochs, cfg.max_steps)
    scheduler = linear_schedule(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)
    state = RunState(engine, cfg, job.resume)  # where the run stands, and its stop and checkpoint decisions
    state.track(model, optimizer, scheduler, monitor.clock,
                {"buckets": shapes.padding.bucket_list, "n_train": len(job.data["train"]), "run_id": job.run_id})
    evaluate = Evaluator(engine, task, dict(zip(task.eval_splits, eval_dls)), state, monitor, job.samples)
    return Training(model, optimizer, scheduler, train_dl, evaluate, state, shapes, total_steps, steps_per_epoch,
                    task, memory, counts, Profile(engine, cfg.profile_steps, state.store))


def linear_schedule(optimizer, warmup_steps, total_steps):
    """transformers' `get_scheduler("linear", ...)`, the same LambdaLR (its state dict too): the rate
    rises to the peak over `warmup_steps`, then falls linearly to 0 at `total_steps`. Written here
    because importing transformers.optimization imports peft (trainer_utils): seconds of start-up."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_linear, warmup_steps, total_steps))


def _linear(warmup_steps, total_steps, step):
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def plan_memory(engine, cfg, shapes, model, logits=False):
    """The memory plan, printed; a run that cannot fit the device stops here, before compiling."""
    length = max(shapes.padding.lengths or [cfg.max_length])
    memory, counts = plan_of(engine.unwrap_model(model), cfg.batch_size, length, cfg.precision,
                             shards=engine.strategy.param_shards, device_bytes=device_bytes(engine.accelerator),
                             checkpointed=cfg.gradient_checkpointing, logits=logits)
    engine.print(describe_memory(memory, counts))
    check_fits(memory, cfg.batch_size, length, cfg.gradient_checkpointing, engine.strategy.param_shards > 1, cfg.lora)
    return memory, counts


def train_loop(engine, cfg, t, monitor):
    """The course's loop: forward, backward, optimizer step; logs, evaluations and checkpoints
    at their steps; every replica stops at the same step on a signal or a non-finite loss."""
    model, optimizer, scheduler, state, total = t.model, t.optimizer, t.scheduler, t.state, t.total_steps
    bar = tqdm(total=total, initial=state.step, desc="Training", disable=not engine.is_main_process,
               dynamic_ncols=True)
    with StopRequest() as stop, bar:  # the bar is closed (its line ended) before any message
        while state.unfinished(total):
            t.train_dl.set_epoch(state.epoch, start=state.batch)
            model.train()
            monitor.clock.start()
            for batch in monitor.clock.timed(t.train_dl):  # its waits are the data's, not the steps
                if state.step >= total or state.batch == t.steps_per_epoch * cfg.grad_accum:
                    break  # done, or the epoch's last micro-batches would not fill an optimizer step
                state.next_micro_batch()
                engine.seed_micro_batch(cfg.seed, state.epoch, state.batch)  # dropout: from the position
                with t.profile.micro_batch(state.step + 1):  # inside --profile-steps' window: annotated
                    labels = batch.pop("labels")  # the loss is the job's own: no model head can add a host sync
                    with engine.autocast():
                        loss = t.task.loss(t.task.forward(model, batch), labels)
                    engine.backward(loss)
                    state.tracker.add(loss)
                    stepped = engine.optimizer_step(optimizer)
                if not stepped:
                    continue
                lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.stepped()
                bar.update(1)
                monitor.step(state.step, batch)
                if after_step(cfg, t, lr, bar, monitor, stop):
                    break
            monitor.clock.stop(state.step)  # the training phase's time ends here, before evaluation
            t.profile.ended(state.step)  # after the cut that ran the loop's last step
            state.end_epoch()
            if state.eval_at_epoch_end(total):
                t.evaluate(model, f"epoch {state.epoch}")
            monitor.clock.end_of_epoch()
            if state.save_due(total, end_of_epoch=True):
                state.save()  # every epoch by default; the end of the run in any case


def after_step(cfg, t, lr, bar, monitor, stop):
    """A step's log point, stop check, evaluation and checkpoint. Returns True when the epoch's
    loop must end (the last step, or early stopping)."""
    state, total = t.state, t.total_steps
    log_point = state.step % cfg.log_every == 0 or state.step == total
    if log_point:
        state.log_point(lr, bar, monitor)
    state.check_stop(stop, log_point)  # a signal or a non-finite loss on any replica
    if state.eval_due(total):  # --eval-every
        t.evaluate(t.model, f"step {state.step}", mid_epoch=True)
    if state.save_due(total):
        state.save()
    return state.step == total or state.stopped_early


def _private_copy(model):
    if any(p.is_shared() for p in model.parameters()):
        # Spawned workers receive the parent's tensors in shared memory (torch.multiprocessing
        # pickling): every worker would update the same storage. Train a private copy.
        return copy.deepcopy(model)
    return model


