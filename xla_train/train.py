"""The fine-tuning job: the Hugging Face course's full training loop on xla_train's Engine API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers
"""

import copy
import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, get_scheduler

from . import checkpoint
from .api import Engine
from .data import CostModel, auto_buckets, check_fit, make_loader, model_inputs_only, tokenize
from .errors import UserError
from .files import atomic_write
from .monitor import Monitor
from .options import TrainOptions, parse_buckets
from .predict import ModelInfo, load_pretrained, predict_loader, predict_rows, read_input, tokenize_rows, write_output
from .run_folder import RunFolder, write_finished
from .run_state import RunState
from .selection import select_backend
from .signals import StopRequest
from .storage import open_store
from .tasks import bundled_model_path, load_metric, load_task, scores, task_loss

TrainConfig = TrainOptions  # the name the package's API, notebook and scripts use


def position_limit(config, tokenizer):
    """The longest input the model takes: its position embeddings (RoBERTa's two offset ones not
    counted, as its tokenizer's model_max_length says), unbounded for relative positions only."""
    limits = [tokenizer.model_max_length] if tokenizer.model_max_length < 10**6 else []
    relative_only = config.model_type.startswith("deberta") and not getattr(config, "position_biased_input", True)
    if getattr(config, "max_position_embeddings", None) and not relative_only:
        limits.append(config.max_position_embeddings)
    return min(limits, default=10**9)


def load_tokenizer(name):
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, name)
    if tokenizer.pad_token is None:  # GPT-2, Llama and kin: pad with the end-of-sequence token, as users do
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer of {name} has neither a padding nor an end-of-sequence token; save one "
                            "with a pad_token set")
        tokenizer.pad_token = tokenizer.eos_token
        print(f"tokenizer of {name}: no padding token; padding with its end-of-sequence token {tokenizer.eos_token!r}")
    return tokenizer


def prepare_data(cfg, backend, resume=None):
    """In the parent process: read the task's data (every check before the model loads),
    tokenise it once, and settle the bucket lengths."""
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
    devices = backend.planned_devices()
    batches = math.ceil(len(task.splits["train"]) / (cfg.batch_size * devices))
    if batches < cfg.grad_accum:
        raise UserError(f"{len(task.splits['train'])} training rows make {batches} batch(es) of {cfg.batch_size} x "
                        f"{devices} device(s), fewer than one optimizer step takes (--grad-accum {cfg.grad_accum}): "
                        "give more rows, or a smaller --batch-size or --grad-accum")
    data, truncated = tokenize(task.splits, tokenizer, cfg.max_length)
    if task.test is not None:
        data["test"], truncated["test"] = tokenize_rows(task.test, tokenizer, cfg.max_length)
    task.splits = None  # the workers get the tokenised copy
    if any(truncated.values()):
        print(f"truncated to --max-length {cfg.max_length} tokens: "
              + ", ".join(f"{n} {split} rows" for split, n in truncated.items()))
    buckets, estimate = parse_buckets(cfg.buckets, cfg.max_length), None
    if resume:  # the data order depends on the buckets: keep the interrupted run's
        resume.check(cfg, len(data["train"]))
        buckets = resume.state["buckets"] or buckets
    if cfg.padding == "buckets" and buckets == "auto":
        # every device training in data parallel (replicas on every host, SPMD's devices), asked
        # before launch: the plan is for the job the run will really be
        rows_per_step = cfg.batch_size * devices * cfg.grad_accum
        steps_per_epoch = math.ceil(len(data["train"]) / rows_per_step)
        steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
        compile_s = backend.compile_seconds if cfg.compile_seconds is None else cfg.compile_seconds
        cost = CostModel(compile_seconds=compile_s, token_seconds=backend.token_seconds)
        eval_lengths = [n for split in [*task.eval_splits, "test"] if split in data for n in data[split]["length"]]
        buckets, estimate = auto_buckets(data["train"]["length"], eval_lengths, steps,
                                         rows_per_step, cfg.epochs, cfg.max_length, cost)
        estimate.update(steps=steps, devices=devices, rows_per_step=rows_per_step, steps_per_epoch=steps_per_epoch)
        print(f"buckets auto: {buckets} for {steps} steps (global batch {rows_per_step} = {cfg.batch_size} x "
              f"{devices} device(s) x {cfg.grad_accum} accumulated: {steps_per_epoch} steps per epoch, "
              f"{steps_per_epoch * cfg.epochs} for {cfg.epochs} epochs; compile {compile_s:g} s/graph, "
              f"{cost.token_seconds:g} s/token): estimated {estimate['estimated_seconds']} s, "
              f"padding efficiency {estimate['padding_efficiency']}")
    if cfg.padding == "buckets":
        for split in data.values():
            check_fit(split["length"], buckets)
    return task, tokenizer, data, truncated, buckets, estimate


def run(cfg):
    """Runs the whole job: data in this process, then training on every local worker."""
    cfg.validate()
    backend = select_backend(cfg.backend, cfg.num_processes, cfg.strategy)
    store = open_store(cfg.output_dir) if cfg.output_dir else None
    folder = None
    host, hosts = backend.host_position()
    if store and hosts > 1 and not store.url.startswith("gs://"):
        # only global ordinal 0 writes; every host decides on its own whether to resume
        raise UserError(f"--output-dir {cfg.output_dir}: a run on {hosts} hosts needs a gs:// output, which every "
                        "host reads alike (a local folder holds host 0's checkpoints only)")
    if store:
        store.check_writable()
        folder = RunFolder(store, cfg, writer=host == 0)  # one run per folder
        folder.check()
        done = folder.finished_message()
        if done:
            print(done)
            return None
    resume = None
    if cfg.resume_from or (cfg.resume and any(store.checkpoints().values())):
        resume = checkpoint.Resume(*checkpoint.find(store, cfg.resume_from))
        if folder:
            folder.check_checkpoint(resume)
    elif cfg.resume:
        print(f"--resume: no complete checkpoint in {cfg.output_dir} yet; starting from the beginning")
    task, tokenizer, data, truncated, buckets, estimate = prepare_data(cfg, backend, resume)
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    model = load_model(cfg.model, cfg.seed, task, tokenizer.pad_token_id)
    data = model_inputs_only(data, model)
    if resume:
        resume.load_model(model, weights)
        del weights
    run_id = folder.claim(resume) if folder else None  # every check passed: the folder is this run's
    # Workers get the tokenised data and the model from here: forked replicas (XLA) share these
    # pages instead of each loading a copy; spawned ones (gloo, NCCL) receive them pickled.
    with StopRequest():  # a launcher passes SIGTERM on to its workers, which save and stop
        backend.launch(train_worker, (cfg, task, tokenizer, model, data, buckets,
                                      {"run_id": run_id, "truncated": truncated, "buckets_auto": estimate}, resume))


def load_model(name, seed, task, pad_token_id=None):
    """The pretrained encoder with a new head for the task (its label names in the config, so
    pipelines print them), initialised from `seed`."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    options = {"num_labels": task.num_labels, "problem_type": "regression" if task.problem == "regression" else None}
    if task.labels:
        options.update(id2label=dict(enumerate(task.labels)), label2id={n: i for i, n in enumerate(task.labels)})
    config = load_pretrained(AutoConfig, name)
    if config.pad_token_id is None and pad_token_id is not None:
        options["pad_token_id"] = pad_token_id  # decoder classifiers find each row's last token by it
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or ())
    if classifier and config.num_labels != task.num_labels:
        # a classifier fine-tuned for another label set: its head is replaced, as run_glue's
        # --ignore_mismatched_sizes does
        options["ignore_mismatched_sizes"] = True
    # transformers' load report would list the new head as a problem: say it here
    model, info = load_pretrained(AutoModelForSequenceClassification, name, output_loading_info=True, **options)
    new = sorted({*info["missing_keys"], *(k[0] if isinstance(k, tuple) else k for k in info["mismatched_keys"])})
    if new:
        shown = "the bundled MiniLM-L6-H384" if name == bundled_model_path() else name
        print(f"model {shown}: new classification head for {task.num_labels} output(s) ({', '.join(new)}), "
              f"initialised with --seed {seed}")
    return model


def train_worker(cfg, task, tokenizer, model, data, buckets, report, resume=None):
    """The training function each worker runs: the course's loop on the Engine API."""
    engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                    max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                    compile_cache=cfg.compile_cache, strategy=cfg.strategy)
    model = _private_copy(model)
    engine.seed(cfg.seed)  # dropout
    bucket_list = buckets if cfg.padding == "buckets" else None
    # TensorBoard, compilation log, explainer and the run's clock; before anything is compiled
    monitor = Monitor(engine, cfg, bucket_list or ([cfg.max_length] if cfg.padding == "max_length" else None))
    train_dl, *eval_dls = make_loaders(cfg, tokenizer, data, bucket_list, task.eval_splits)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=engine.fused_optimizer or None)
    train_dl, *eval_dls, model, optimizer = engine.prepare(train_dl, *eval_dls, model, optimizer)
    steps_per_epoch = len(train_dl) // cfg.grad_accum
    total_steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    state = RunState(engine, cfg, resume)  # where the run stands, and its stop and checkpoint decisions
    state.track(model, optimizer, scheduler, monitor.clock,
                {"buckets": buckets, "n_train": len(data["train"]), "run_id": report["run_id"]})
    evaluate = Evaluator(engine, task, dict(zip(task.eval_splits, eval_dls)), state, monitor)
    bar = tqdm(total=total_steps, initial=state.step, desc="Training", disable=not engine.is_main_process,
               dynamic_ncols=True)
    with StopRequest() as stop, bar:  # the bar is closed (its line ended) before any message
        while state.unfinished(total_steps):
            train_dl.set_epoch(state.epoch, start=state.batch)
            model.train()
            monitor.clock.start()
            for batch in train_dl:
                if state.step >= total_steps or state.batch == steps_per_epoch * cfg.grad_accum:
                    break  # done, or the epoch's last micro-batches would not fill an optimizer step
                state.batch += 1
                labels = batch.pop("labels")  # the loss is the job's own: no model head can add a host sync
                with engine.autocast():
                    loss = task_loss(model(**batch).logits, labels, task.problem)
                engine.backward(loss)
                state.tracker.add(loss)
                if not engine.optimizer_step(optimizer):
                    continue
                lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                bar.update(1)
                monitor.step(state.step, batch)
                log_point = state.step % cfg.log_every == 0 or state.step == total_steps
                if log_point:
                    state.log_point(lr, bar, monitor)
                state.check_stop(stop, log_point)  # a signal or a non-finite loss on any replica
                if state.eval_due(total_steps):  # --eval-every
                    evaluate(model, f"step {state.step}", mid_epoch=True)
                if state.save_due(total_steps):
                    state.save()
                if state.step == total_steps or state.stopped_early:
                    break
            monitor.clock.stop(state.step)  # the training phase's time ends here, before evaluation
            state.end_epoch()
            if state.eval_at_epoch_end(total_steps):
                evaluate(model, f"epoch {state.epoch}")
            monitor.clock.end_of_epoch()
            if state.save_due(total_steps, end_of_epoch=True):
                state.save()  # every epoch by default; the end of the run in any case
    state.check_finite()  # the last log interval's loss, which no closure has read yet on XLA
    return finish(engine, cfg, task, state, model, tokenizer, (train_dl, data, buckets), monitor, steps_per_epoch,
                  report, resume)


def _private_copy(model):
    if any(p.is_shared() for p in model.parameters()):
        # Spawned workers receive the parent's tensors in shared memory (torch.multiprocessing
        # pickling): every worker would update the same storage. Train a private copy.
        return copy.deepcopy(model)
    return model


def make_loaders(cfg, tokenizer, data, bucket_list, eval_splits):
    """The training loader (shuffled, the last batch filled with repeats), then one per evaluation
    split (in order, the last batch filled with masked rows, so every row is scored once)."""
    return [make_loader(data[split], tokenizer, cfg.batch_size, cfg.padding, bucket_list, cfg.max_length,
                        shuffle=split == "train", seed=cfg.seed, fill="repeat" if split == "train" else "mask")
            for split in ("train", *eval_splits)]


def finish(engine, cfg, task, state, model, tokenizer, loaded, monitor, steps_per_epoch, report, resume):
    """After the loop: the final (or best) model, its predictions for --test-file, the metrics
    JSON and the run folder's files."""
    train_dl, data, buckets = loaded
    step = state.step
    samples_per_step = cfg.batch_size * cfg.grad_accum * engine.num_devices
    timing = monitor.clock.summary(step, samples_per_step, state.first_step)  # before the graphs below
    results = state.restore_best(model)  # --save-best: the best evaluation's weights
    predictions = None
    if state.store:
        folder = state.store.local_folder()
        engine.save_pretrained(model, tokenizer, folder)
        if task.test is not None:
            loader = predict_loader(engine, tokenizer, data["test"], cfg.batch_size,
                                    buckets if cfg.padding == "buckets" else [cfg.max_length], cfg.max_length)
            scores_ = predict_rows(engine, model, loader, task.problem)
            predictions = f"{state.store.url.rstrip('/')}/predictions{Path(cfg.test_file).suffix.lower()}"

        def write_files():
            task_info(task, cfg).write(folder)
            if task.test is not None:
                write_output(folder / Path(predictions).name, task.test, task_info(task, cfg), scores_)
            write_finished(folder, report["run_id"], cfg, step, results, state.best, state.stopped_early)
            state.store.publish()

        engine.on_main(write_files, f"cannot write the run's files to {state.store.url}")
    sums = replica_checksums(engine, model)
    plan = train_dl.loader.batch_sampler
    metrics = {
        "backend": engine.runtime, "device": engine.describe_device(),
        "world_size": engine.num_devices, "model": cfg.model, "task": task.name, "problem": task.problem,
        "labels": task.labels, "num_labels": task.num_labels, "main_metric": task.main, "steps": step,
        "epochs": round(step / steps_per_epoch, 4),
        "train_samples": step * samples_per_step, **timing,
        "padding_efficiency": round(plan.padding_efficiency(), 4),
        "padding_by_bucket": plan.padding_by_length(),
        "eval": results,  # of the saved model: the last evaluation, or the best with --save-best
        "best": state.best, "evaluations": state.evaluations, "stopped_early": state.stopped_early,
        "predictions": predictions,
        "train_loss": [h[:3] for h in state.history],  # [step, mean loss since the last entry, learning rate]
        "param_checksum": float(sums[0].double().sum()),
        "replicas_identical": bool((sums == sums[0]).all()),
        "buckets": plan.buckets if cfg.padding == "buckets" else None,
        "padding": cfg.padding, "precision": cfg.precision, "resumed_from": resume.url if resume else None,
        "first_step": state.first_step, "checkpoint": state.saved, "config": asdict(cfg), **report,
    }
    if engine.is_main_process:
        engine.print(f"dev {scores(results)}  (training {metrics['train_samples_per_s']:.1f} samples/s)")
        if cfg.metrics_out:
            atomic_write(cfg.metrics_out, json.dumps(metrics, indent=2) + "\n")  # makes missing folders
    monitor.close(metrics)
    return metrics


def replica_checksums(engine, model):
    """Per-parameter sums from every replica (rows), to show that replicas hold the same model."""
    params = list(engine.unwrap_model(model).parameters())
    sums = torch.stack([p.detach().float().sum() for p in params])
    (host,) = engine.to_host([engine.gather(sums[None])])
    return host


def evaluate_model(engine, model, eval_dl, metric, problem):
    """The task's metrics over every row of one evaluation split exactly once (`compute` empties
    `metric` for the next call), and `n`, the rows scored."""
    model.eval()
    with torch.no_grad():
        for batch in eval_dl:
            labels = batch.pop("labels")
            with engine.autocast():
                logits = model(**batch).logits
            if problem == "regression":
                preds, refs = engine.gather_for_metrics((logits[:, 0].float(), labels.float()))
            else:
                # int32 across replicas: 64-bit integer collectives may not lower on TPU (pytorch/xla#1952)
                preds, refs = engine.gather_for_metrics((logits.argmax(-1).int(), labels.int()))
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
