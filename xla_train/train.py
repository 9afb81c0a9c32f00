"""The fine-tuning job: the Hugging Face course's full training loop on xla_train's Engine API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers

`run` prepares the job once in this process (data, shapes, model: `Job`), then every worker runs
`train_worker`: set-up, the loop, the finish.
"""

import copy
import dataclasses
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, get_scheduler

from . import STARTED, checkpoint
from .api import Engine
from .data import make_loader, model_inputs_only, tokenize
from .errors import UserError
from .files import atomic_write
from .job import Job
from .memory import check_fits, device_bytes
from .memory import describe as describe_memory
from .memory import plan as plan_of
from .launchers import watch_pod
from .models import (add_adapters, hold_frozen_in_bf16, load_model, load_pretrained, load_tokenizer, position_limit,
                     save_merged)
from .monitor import Monitor
from .profile import Profile
from .options import TrainOptions
from .predict import ModelInfo, infer, predict_loader, predict_rows, read_input, tokenize_rows, write_output
from .run_folder import RunFolder, write_finished
from .run_state import RunState
from .core.select import select_roles
from .shapes import ShapePlan, check_steps, settle_padding
from .signals import StopRequest
from .storage import open_store
from .tasks import load_metric, load_task, scores, task_loss

TrainConfig = TrainOptions  # the name the package's API, notebook and scripts use
LAUNCH_ID = "XLA_TRAIN_LAUNCH_ID"  # one start of the job on every host of a pod (scripts/tpu_pod.py)


# ---------------------------------------------------------------------------------------------
# In the launching process: every check, then the job, then the workers


def run(cfg):
    """Runs the whole job: data in this process, then training on every local worker."""
    cfg.validate()
    backend = select_roles(cfg.backend, cfg.num_processes, cfg.strategy)
    folder, resume, done = open_output(cfg, backend)
    if done:
        print(done)
        return None
    job = prepare(cfg, backend, resume)
    job.run_id = folder.claim(resume) if folder else None  # every check passed: the folder is this run's
    job.started = STARTED
    # Workers get the tokenised data and the model from here: forked replicas (XLA) share these
    # pages instead of each loading a copy; spawned ones (gloo, NCCL) receive them pickled.
    with StopRequest():  # a launcher passes SIGTERM on to its workers, which save and stop
        backend.launch(train_worker, (job,))


def open_output(cfg, backend):
    """The output folder's run and the checkpoint to resume, checked before any work. Returns
    (RunFolder or None, checkpoint.Resume or None, the line to print if the run has finished)."""
    if not cfg.output_dir:
        return None, None, None
    store = open_store(cfg.output_dir)
    host, hosts = backend.host_position()
    if hosts > 1 and not store.url.startswith("gs://"):
        # only global ordinal 0 writes; every host decides on its own whether to resume
        raise UserError(f"--output-dir {cfg.output_dir}: a run on {hosts} hosts needs a gs:// output, which every "
                        "host reads alike (a local folder holds host 0's checkpoints only)")
    if hosts > 1 and os.environ.get(LAUNCH_ID):  # scripts/tpu_pod.py gives every host one launch id
        watch_pod(store.url, os.environ[LAUNCH_ID])  # a failing host tells the others there
    store.check_writable()
    folder = RunFolder(store, cfg, writer=host == 0)  # one run per folder
    folder.check()
    done = folder.finished_message()
    if done:
        return folder, None, done
    resume = None
    if cfg.resume_from or (cfg.resume and any(store.checkpoints().values())):
        resume = checkpoint.Resume(*checkpoint.find(store, cfg.resume_from))
        folder.check_checkpoint(resume)
    elif cfg.resume:
        print(f"--resume: no complete checkpoint in {cfg.output_dir} yet; starting from the beginning")
    return folder, resume, None


def prepare(cfg, backend, resume=None):
    """The job: the task's data read and checked before the model loads, tokenised once, the
    shapes settled, the model loaded (with a resumed run's weights)."""
    task = load_task(cfg.task, cfg.data_dir, cfg.train_file, cfg.validation_file, cfg.text_columns,
                     cfg.label_column, cfg.problem)
    if cfg.metric_for_best and cfg.metric_for_best not in task.metric_keys:
        raise UserError(f"--metric-for-best must be one of {task.name}'s metrics: {', '.join(task.metric_keys)}; "
                        f"not {cfg.metric_for_best!r}")
    if cfg.test_file:
        task.test = read_input(cfg.test_file, task_info(task, cfg))
    print(task.describe())
    tokenizer = load_tokenizer(cfg.model)
    limit = position_limit(load_pretrained(AutoConfig, cfg.model), tokenizer)
    if cfg.max_length > limit:
        raise UserError(f"--max-length {cfg.max_length} is longer than model {cfg.model} takes ({limit} tokens)")
    shapes = ShapePlan(cfg.batch_size, backend.planned_data_parallel_size(), cfg.grad_accum)
    check_steps(shapes, len(task.splits["train"]))
    data, truncated = tokenize_task(cfg, task, tokenizer)
    if resume:
        resume.check(cfg, len(data["train"]), backend)
    settle_padding(cfg, shapes, data, task.eval_splits, backend.accelerator, resume)
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    model = load_model(cfg.model, cfg.seed, task, tokenizer.pad_token_id)
    if cfg.lora:
        model = add_adapters(model, cfg)
    if weights is not None:
        resume.load_model(model, weights)
        del weights
    if cfg.lora and cfg.precision == "bf16":
        hold_frozen_in_bf16(model)  # here, once: forked replicas share these pages
    return Job(cfg, task, tokenizer, model_inputs_only(data, model), shapes, model, truncated=truncated,
               resume=resume)


def tokenize_task(cfg, task, tokenizer):
    """Every split (and the test rows) tokenised once; the workers get this copy."""
    data, truncated = tokenize(task.splits, tokenizer, cfg.max_length)
    if task.test is not None:
        data["test"], truncated["test"] = tokenize_rows(task.test, tokenizer, cfg.max_length)
    task.splits = None
    if any(truncated.values()):
        print(f"truncated to --max-length {cfg.max_length} tokens: "
              + ", ".join(f"{n} {split} rows" for split, n in truncated.items()))
    return data, truncated


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
    shapes: ShapePlan  # the job's, with this run's device count
    total_steps: int
    steps_per_epoch: int
    problem: str  # classification | regression: the loss
    memory: dict  # the memory plan (memory.plan), and the parameter counts
    counts: dict
    profile: Profile  # --profile-steps


def train_worker(job):
    """The training function each worker runs: the course's loop on the Engine API."""
    cfg = job.cfg
    engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                    max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                    compile_cache=cfg.compile_cache, strategy=cfg.strategy)
    engine.seed(cfg.seed)  # dropout
    shapes = dataclasses.replace(job.shapes, devices=engine.data_parallel_size)
    # TensorBoard, compilation log, explainer and the run's clock; before anything is compiled
    monitor = Monitor(engine, cfg, shapes, job.started, job.run_id)
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
                           seed=cfg.seed, fill="repeat" if split == "train" else "mask")
               for split in ("train", *task.eval_splits)]  # filler: repeats to train on, masked rows to score
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=engine.fused_optimizer or None)
    train_dl, *eval_dls, model, optimizer = engine.prepare(*loaders, model, optimizer)
    memory, counts = plan_memory(engine, cfg, shapes, model)  # before anything compiles
    steps_per_epoch = shapes.steps_per_epoch(len(job.data["train"]))
    total_steps = shapes.total_steps(len(job.data["train"]), cfg.epochs, cfg.max_steps)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    state = RunState(engine, cfg, job.resume)  # where the run stands, and its stop and checkpoint decisions
    state.track(model, optimizer, scheduler, monitor.clock,
                {"buckets": shapes.padding.bucket_list, "n_train": len(job.data["train"]), "run_id": job.run_id})
    evaluate = Evaluator(engine, task, dict(zip(task.eval_splits, eval_dls)), state, monitor)
    return Training(model, optimizer, scheduler, train_dl, evaluate, state, shapes, total_steps, steps_per_epoch,
                    task.problem, memory, counts, Profile(engine, cfg.profile_steps, _profile_folder(cfg)))


def _profile_folder(cfg):
    return Path(cfg.output_dir) / "profile" if cfg.output_dir else None


def plan_memory(engine, cfg, shapes, model):
    """The memory plan, printed; a run that cannot fit the device stops here, before compiling."""
    length = max(shapes.padding.lengths or [cfg.max_length])
    memory, counts = plan_of(engine.unwrap_model(model), cfg.batch_size, length, cfg.precision,
                             shards=engine.strategy.param_shards, device_bytes=device_bytes(engine.accelerator),
                             checkpointed=cfg.gradient_checkpointing)
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
                state.batch += 1
                engine.seed_micro_batch(cfg.seed, state.epoch, state.batch)  # dropout: from the position
                t.profile.step_begins(state.step + 1)
                labels = batch.pop("labels")  # the loss is the job's own: no model head can add a host sync
                with engine.autocast():
                    loss = task_loss(model(**batch).logits, labels, t.problem)
                engine.backward(loss)
                state.tracker.add(loss)
                if not engine.optimizer_step(optimizer):
                    continue
                lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                t.profile.step_ended(state.step)
                bar.update(1)
                monitor.step(state.step, batch)
                if after_step(cfg, t, lr, bar, monitor, stop):
                    break
            monitor.clock.stop(state.step)  # the training phase's time ends here, before evaluation
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


def finish(engine, job, t, monitor):
    """After the loop: the final (or best) model, its predictions for --test-file, the metrics
    JSON and the run folder's files."""
    cfg, state = job.cfg, t.state
    timing = monitor.clock.summary(state.step, t.shapes.rows_per_step, state.first_step)  # before the graphs below
    results = state.restore_best(t.model)  # --save-best: the best evaluation's weights
    predictions = save_outputs(engine, job, t, results) if state.store else None
    metrics = {**run_metrics(engine, job, t, monitor, timing, results), "predictions": predictions}
    if engine.is_main_process:
        engine.print(f"dev {scores(results)}  (training {metrics['train_samples_per_s']:.1f} samples/s)")
        if cfg.metrics_out:
            atomic_write(cfg.metrics_out, json.dumps(metrics, indent=2) + "\n")  # makes missing folders
    monitor.close(metrics)
    seconds = metrics["goodput"]["seconds"]
    engine.print(f"goodput {metrics['goodput']['ratio']:.2f}: training steps {seconds['train_steps']:.1f} s of "
                 f"{seconds['wall']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()
                                                     if k not in ("train_steps", "wall")) + ")")
    return metrics


def save_outputs(engine, job, t, results):
    """The model and tokenizer, the task's description, --test-file's predictions and the run's
    record, into the output folder (published to gs:// from there). Returns the predictions' URL."""
    cfg, task, state = job.cfg, job.task, t.state
    folder = state.store.local_folder()
    if cfg.merge_lora:  # merged on the CPU, into the base model loaded again
        def load_base():
            return add_adapters(load_model(cfg.model, cfg.seed, task, job.tokenizer.pad_token_id), cfg)

        save_merged(engine, t.model, load_base, job.tokenizer, folder)
    else:
        engine.save_pretrained(t.model, job.tokenizer, folder)
    predictions = scored = None
    if task.test is not None:  # padded like the training batches (buckets, max_length or dynamic)
        loader = predict_loader(engine, job.tokenizer, job.data["test"], cfg.batch_size, t.shapes.padding)
        scored = predict_rows(engine, t.model, loader, task.problem)
        predictions = f"{state.store.url.rstrip('/')}/predictions{Path(cfg.test_file).suffix.lower()}"

    def write_files():
        task_info(task, cfg).write(folder)
        if scored is not None:
            write_output(folder / Path(predictions).name, task.test, task_info(task, cfg), scored)
        write_finished(folder, job.run_id, cfg, state.step, results, state.best, state.stopped_early)
        state.store.publish()

    engine.on_main(write_files, f"cannot write the run's files to {state.store.url}")
    return predictions


def run_metrics(engine, job, t, monitor, timing, results):
    """The metrics JSON of the run (DESIGN.md's contract and more)."""
    cfg, task, state = job.cfg, job.task, t.state
    sums = replica_checksums(engine, t.model)
    plan = t.train_dl.loader.batch_sampler
    return {
        "backend": engine.runtime, "device": engine.describe_device(),
        "world_size": engine.data_parallel_size, "model": cfg.model, "task": task.name, "problem": task.problem,
        "labels": task.labels, "num_labels": task.num_labels, "main_metric": task.main, "steps": state.step,
        "epochs": round(state.step / t.steps_per_epoch, 4),
        "train_samples": state.step * t.shapes.rows_per_step, **timing,
        "padding_efficiency": round(plan.padding_efficiency(), 4),
        "padding_by_bucket": plan.padding_by_length(),
        "eval": results,  # of the saved model: the last evaluation, or the best with --save-best
        "best": state.best, "evaluations": state.evaluations, "stopped_early": state.stopped_early,
        "train_loss": [h[:3] for h in state.history],  # [step, mean loss since the last entry, learning rate]
        "param_checksum": float(sums[0].double().sum()),
        "replicas_identical": bool((sums == sums[0]).all()),
        "buckets": t.shapes.padding.bucket_list,
        "padding": cfg.padding, "precision": cfg.precision,
        "resumed_from": job.resume.url if job.resume else None,
        "first_step": state.first_step, "checkpoint": state.saved, "config": asdict(cfg), **job.report(),
        "memory": {**t.memory, "peak_bytes": engine.peak_memory()}, **t.counts,
        "goodput": monitor.clock.goodput(),  # last: the wall time up to the metrics
    }


def replica_checksums(engine, model):
    """Per-parameter sums from every replica (rows), to show that replicas hold the same model."""
    params = list(engine.unwrap_model(model).parameters())
    sums = torch.stack([engine.strategy.whole(p.detach().float().sum()) for p in params])  # FSDP: of every shard
    (host,) = engine.to_host([engine.strategy.gather(sums[None])])
    return host


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate_model(engine, model, eval_dl, metric, problem):
    """The task's metrics over every row of one evaluation split exactly once (`compute` empties
    `metric` for the next call), and `n`, the rows scored."""

    def columns(batch, logits):
        if problem == "regression":
            return logits[:, 0].float(), batch["labels"].float()
        # int32 across replicas: 64-bit integer collectives may not lower on TPU (pytorch/xla#1952)
        return logits.argmax(-1).int(), batch["labels"].int()

    preds, refs = infer(engine, model, eval_dl, columns)
    metric.add_batch(predictions=preds, references=refs)
    n = len(metric)
    return {**metric.compute(), "n": n}


class Evaluator:
    """Scores every evaluation split, prints and logs the scores, and hands them to the run state
    (best model, early stopping). Mid-epoch (--eval-every) it pauses the training clock."""

    def __init__(self, engine, task, loaders, state, monitor):
        self.engine, self.task, self.loaders, self.state, self.monitor = engine, task, loaders, state, monitor
        self.metric = load_metric(task.metric_name)

    def __call__(self, model, where, mid_epoch=False):
        if mid_epoch:
            self.monitor.clock.stop(self.state.step)
        with self.monitor.clock.evaluating():
            results = evaluate_all(self.engine, model, self.task, self.loaders, self.metric)
        self.engine.print(f"{where}: {scores(results)}")
        self.monitor.evaluated(self.state.step, results)
        self.state.evaluated(results, model, self.task.main)
        if mid_epoch:
            model.train()
            self.monitor.clock.start()


def task_info(task, cfg):
    """What the saved model folder records of its training data (read back by `xla-train predict`)."""
    return ModelInfo(task.problem, task.labels, task.name, task.text_columns, cfg.max_length)


def evaluate_all(engine, model, task, eval_dls, metric):
    """Every evaluation split, keys suffixed per split (MNLI's mismatched set: `accuracy_mm`, `n_mm`)."""
    results = {}
    for split, dl in eval_dls.items():
        suffix = task.eval_suffix(split)
        results.update({k + suffix: v for k, v in evaluate_model(engine, model, dl, metric, task.problem).items()})
    return results
