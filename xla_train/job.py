"""The prepared job: what the parent process reads, checks and loads once (the output folder's
run, the data, the shapes, the model), and hands to every worker and to the finish as one value."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import AutoConfig

from . import data_cache
from .core.batching import model_inputs_only
from .core.clock import Startup
from .core.errors import UserError
from .core.shapes import Padding, PaddingRequest, Shapes, check_steps, lengths, settle_padding
from .core.signals import StopRequest
from .io.storage import is_remote, open_store
from .kernels.attention import row_length, row_lengths_line
from .models import (
    add_adapters,
    hold_frozen_in_bf16,
    load_pretrained,
    load_tokenizer,
    position_limit,
)
from .parallel import sharded_load
from .parallel.launchers import pod_marker, watch_pod
from .run import checkpoint
from .run.folder import RunFolder
from .tasks import PredictSettings, Task, load_task

if TYPE_CHECKING:
    from .options import TrainOptions

LAUNCH_ID = "XLA_TRAIN_LAUNCH_ID"  # one start of the job on every host of a pod (scripts/tpu_pod.py)


@dataclass
class Job:
    cfg: TrainOptions  # the run's options
    task: Task  # labels, metric, evaluation splits, prediction
    tokenizer: Any
    data: Any  # the tokenised DatasetDict: train and the evaluation splits
    shapes: Shapes  # padding, global batch, steps per epoch
    model: Any  # the pretrained model with its new head (and a resumed run's weights)
    run_id: str | None = None  # the output folder's run
    truncated: dict[str, int] | None = None  # rows cut to --max-length, per split
    resume: checkpoint.Resume | None = None
    pod_marker: str | None = None  # on several hosts: where a failing host tells the others (launchers.pod_marker)
    startup: Startup | None = None  # the launching process's start and start-up's parts (goodput)
    samples: Any = None  # --eval-samples: what the task's `samples` made (tasks.completion.Samples)
    test: Any = None  # --test-file's rows, as the task's prediction part read them

    def report(self) -> dict[str, Any]:
        """What the metrics JSON says of the job's preparation."""
        return {"run_id": self.run_id, "truncated": self.truncated, "buckets_auto": self.shapes.estimate}


def open_output(cfg, backend):
    """The output folder's run and the checkpoint to resume, checked before any work. Returns
    (RunFolder or None, checkpoint.Resume or None, the line to print if the run has finished)."""
    if not cfg.output_dir:
        return None, None, None
    store = open_store(cfg.output_dir)
    host, hosts = backend.host_position()
    if hosts > 1 and not is_remote(store.url):
        # only global ordinal 0 writes; every host decides on its own whether to resume
        raise UserError(f"--output-dir {cfg.output_dir}: a run on {hosts} hosts needs a gs:// output, which every "
                        "host reads alike (a local folder holds host 0's checkpoints only)")
    store.check_writable()
    folder = RunFolder(store, cfg, writer=host == 0)  # one run per folder
    if hosts > 1 and os.environ.get(LAUNCH_ID):  # scripts/tpu_pod.py gives every host one launch id
        folder.pod_marker = pod_marker(store.url, os.environ[LAUNCH_ID])  # a failing host tells the others there
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


def prepare(cfg, backend, resume=None, startup=None):
    """The job: the task's data read and checked before the model loads, tokenised once, the
    shapes settled, the model loaded (with a resumed run's weights). `startup` (clock.Startup)
    times the data's parts and the model's."""
    startup = startup or Startup()
    task, splits = load_task(cfg.task, cfg.data_dir, cfg.train_file, cfg.validation_file, cfg.text_columns,
                     cfg.label_column, cfg.problem, cfg.seed, cfg.max_length, cfg.packing, cfg.attention,
                     options=cfg)
    if cfg.metric_for_best and cfg.metric_for_best not in task.metric_keys:
        raise UserError(f"--metric-for-best must be one of {task.name}'s metrics: {', '.join(task.metric_keys)}; "
                        f"not {cfg.metric_for_best!r}")
    print(task.describe(splits))
    sample_rows = task.sample_rows(splits, cfg.eval_samples) if cfg.eval_samples else None
    startup.lap("data")
    config = load_pretrained(AutoConfig, cfg.model)
    task.model.check(config, cfg.model)
    backend.strategy.check_model(config, cfg.lora)  # --tensor-parallel: the heads split, the family has a plan
    tokenizer = load_tokenizer(cfg.model)
    limit = position_limit(config, tokenizer)
    if cfg.max_length > limit:
        raise UserError(f"--max-length {cfg.max_length} is longer than model {cfg.model} takes ({limit} tokens)")
    startup.lap("model")
    settings = PredictSettings(cfg.model, cfg.max_length, cfg.buckets, max_new_tokens=cfg.max_new_tokens)
    test = task.prediction.read(cfg.test_file, tokenizer, settings) if cfg.test_file else None  # before the model
    shapes = Shapes(task.rows.batch_rows(cfg.batch_size), backend.planned_data_parallel_size(), cfg.grad_accum,
                    repeats=task.objective.updates_per_batch)
    check_steps(shapes, len(splits["train"]))
    kind = backend.accelerator.kernel_kind()
    max_length = cfg.max_length  # packed rows: of a length the device's attention kernel serves, where cheaper
    if task.rows.packed:
        max_length = row_length(cfg.attention, kind, config, cfg.max_length, packed=True)
        max_length = max_length if max_length <= limit else cfg.max_length
        _say(row_lengths_line(cfg.attention, kind, [cfg.max_length], [max_length]))
    entry = data_cache.key(cfg, max_length) if cfg.data_cache else None
    data, truncated = tokenize_task(cfg, task, splits, tokenizer, test, max_length, entry)
    del splits  # the workers get the tokenised copy only
    if resume:
        resume.check(cfg, len(data["train"]), backend)
    request = PaddingRequest(cfg.padding, cfg.buckets, cfg.max_length, cfg.epochs, cfg.max_steps, cfg.compile_seconds)
    resumed = resume.state["buckets"] if resume else None
    # --test-file's rows padded like the batches count where the padding is chosen and checked
    sized = {**data, "test": test.data} if test and task.prediction.pads_like_training else data
    shapes.padding = task.rows.padding(
        lambda: settle_padding(request, shapes, sized, task.eval_splits, backend.accelerator, resumed),
        max_length, sized)
    if shapes.padding.bucket_list:  # padded rows: buckets the kernel serves, where cheaper than the mask path
        buckets = shapes.padding.bucket_list
        rounded = [row_length(cfg.attention, kind, config, b, packed=False) for b in buckets]
        served = sorted(set(rounded))
        if served != buckets:
            before = padding_share(shapes.padding, lengths(sized["train"]))
            shapes.padding = Padding("buckets", served, max(served[-1], cfg.max_length))
            line = row_lengths_line(cfg.attention, kind, buckets, rounded)
            assert line is not None  # served != buckets (sorted, distinct): some were rounded up
            _say(line
                 + f"; padding {before:.1%} of the training tokens, now "
                 f"{padding_share(shapes.padding, lengths(sized['train'])):.1%}")
    startup.lap("data")
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    model = pretrained(backend.strategy, cfg, task, tokenizer, whole=cfg.lora or weights is not None)
    if cfg.lora:
        model = add_adapters(model, cfg.section("model"), task.model.peft_task_type)
    if weights is not None:
        resume.load_model(model, weights)
        del weights
    if cfg.lora and cfg.precision == "bf16":
        hold_frozen_in_bf16(model)  # here, once: forked replicas share these pages
    data = model_inputs_only(data, model)
    startup.lap("model")
    if test:
        test = task.prediction.fit(test, model, backend.accelerator, settings, shapes.padding)
    samples = sample_rows and task.samples(sample_rows, tokenizer, model, cfg.batch_size)
    startup.lap("data")  # the --eval-samples and --test-file rows
    return Job(cfg, task, tokenizer, data, shapes, model, truncated=truncated, resume=resume, startup=startup,
               samples=samples, test=test)


def pretrained(strategy, cfg, task, tokenizer, whole=False):
    """Model `cfg.model` as the task loads it. Under a strategy that `loads_shards` (FSDPv2 on XLA)
    it is built without the checkpoint's weights, which `wrap_model` reads into their shards on the
    devices, never whole on this host (parallel.sharded_load); loaded `whole` where asked (LoRA's base,
    a resumed run's whole weights) or where the folder does not allow it."""
    load = functools.partial(task.model.load, cfg.model, cfg.seed, tokenizer.pad_token_id)
    model = sharded_load.skeleton(load, cfg.model) if strategy.loads_shards and not whole else None
    return model if model is not None else load()


def _say(line):
    if line:
        print(line)


def padding_share(padding, lengths):
    """The share of padding in rows of these `lengths`, each padded as `padding` pads its batch."""
    real = sum(lengths)
    padded = sum(padding.pad_to(n) for n in lengths)
    return (padded - real) / padded if padded else 0.0


def tokenize_task(cfg, task, splits, tokenizer, test=None, max_length=None, entry=None):
    """Every split tokenised once; the workers get this copy. `test`: --test-file's rows, read
    (and tokenised) by the task's prediction part, counted here. `max_length`: the rows' length
    (default --max-length). `entry`: the data cache's entry for these rows (data_cache.key), read
    where it exists, written where not."""
    max_length = max_length or cfg.max_length
    data, truncated, cached = data_cache.tokenised(entry, lambda: task.rows.tokenize(splits, tokenizer, max_length))
    if cached:
        print(f"data: the tokenised rows from the cache ({data_cache.folder() / entry}; --no-data-cache "
              "tokenises again)")
    units = dict.fromkeys(truncated, task.rows.unit)
    if test is not None:
        truncated["test"], units["test"] = test.truncated, task.prediction.unit
    if any(truncated.values()):
        print(f"truncated to --max-length {max_length} tokens: "
              + ", ".join(f"{n} {split} {units[split]}" for split, n in truncated.items()))
    return data, truncated


def launch(roles, job, worker):
    """`worker(job)` on every local worker. Workers get the tokenised data and the model from here:
    forked replicas (XLA) share these pages instead of each loading a copy; spawned ones (gloo,
    NCCL) receive them pickled. A launcher passes SIGTERM on to its workers, which save and stop;
    on several hosts they inherit the pod's failure marker, unset again afterwards."""
    with StopRequest(), watch_pod(job.pod_marker):
        roles.launch(worker, (job,))
