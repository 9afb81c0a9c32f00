"""The prepared job: what the parent process reads, checks and loads once (the output folder's
run, the data, the shapes, the model), and hands to every worker and to the finish as one value."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
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
from .kernels import bnb
from .kernels.attention import row_length, row_lengths_line
from .models import (
    add_adapters,
    hold_frozen_in_bf16,
    load_base,
    load_pretrained,
    load_tokenizer,
    position_limit,
    quantize_skeleton,
)
from .parallel import sharded_load
from .parallel.launchers import pod_marker, watch_pod
from .run import checkpoint
from .run.folder import RunFolder
from .tasks import PredictSettings, Source, Task, load_task

if TYPE_CHECKING:
    from .core.roles import Roles, Strategy
    from .options import Section, TrainOptions

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


def open_output(cfg: TrainOptions, backend: Roles) -> tuple[RunFolder | None, checkpoint.Resume | None, str | None]:
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


@dataclass(frozen=True)
class ModelInfo:
    """What the model stage reads before any weight loads: the config, the tokenizer and the
    longest row the model takes."""

    config: Any
    tokenizer: Any
    limit: int  # position_limit: the model's longest row in tokens


def prepare(cfg: TrainOptions, backend: Roles, resume: checkpoint.Resume | None = None,
            startup: Startup | None = None) -> Job:
    """The job, in stages as a torchtune recipe's `_setup_*` (each given its part of the options):
    the task's data read and checked before the model loads, the model's config and tokenizer,
    the shapes, the rows tokenised once and their padding settled, the model loaded (with a
    resumed run's weights), then --test-file's and --eval-samples' rows fitted to it. `startup`
    (clock.Startup) times the data's parts and the model's."""
    startup = startup or Startup()
    task, splits = read_task(cfg.source(), cfg.metric_for_best)
    sample_rows = task.sample_rows(splits, cfg.eval_samples) if cfg.eval_samples else None
    startup.lap("data")
    info = read_model(cfg.section("model"), cfg.max_length, task, backend)
    startup.lap("model")
    settings = PredictSettings(cfg.model, cfg.max_length, cfg.buckets, max_new_tokens=cfg.max_new_tokens)
    test = task.prediction.read(cfg.test_file, info.tokenizer, settings) if cfg.test_file else None  # before the model
    shapes = plan_shapes(task, backend, cfg.section("optimizer"), len(splits["train"]))
    kind = backend.accelerator.kernel_kind()
    max_length = packed_length(task, cfg.attention, kind, info, cfg.max_length)
    entry = data_cache.key(cfg, max_length) if cfg.data_cache else None
    data, truncated = tokenize_task(cfg, task, splits, info.tokenizer, test, max_length, entry)
    del splits  # the workers get the tokenised copy only
    if resume:
        resume.check(cfg, len(data["train"]), backend)
    request = PaddingRequest(cfg.padding, cfg.buckets, cfg.max_length, cfg.epochs, cfg.max_steps, cfg.compile_seconds)
    # --test-file's rows padded like the batches count where the padding is chosen and checked
    sized = {**data, "test": test.data} if test and task.prediction.pads_like_training else data
    shapes.padding = settle_rows_padding(task, shapes, request, sized, backend, resume, max_length)
    shapes.padding = kernel_buckets(shapes.padding, cfg.attention, kind, info.config, cfg.max_length, sized["train"])
    startup.lap("data")
    model = load_model(cfg, backend, task, info.tokenizer, resume)
    data = model_inputs_only(data, model)
    startup.lap("model")
    if test:
        test = task.prediction.fit(test, model, backend.accelerator, settings, shapes.padding)
    samples = sample_rows and task.samples(sample_rows, info.tokenizer, model, cfg.batch_size)
    startup.lap("data")  # the --eval-samples and --test-file rows
    return Job(cfg, task, info.tokenizer, data, shapes, model, truncated=truncated, resume=resume, startup=startup,
               samples=samples, test=test)


def read_task(source: Source, metric_for_best: str | None = None) -> tuple[Task, Any]:
    """The data stage: the task and its splits, read and checked before any model loads, and
    described on the console; --metric-for-best checked against the task's metrics."""
    task, splits = load_task(source)
    if metric_for_best and metric_for_best not in task.metric_keys:
        raise UserError(f"--metric-for-best must be one of {task.name}'s metrics: {', '.join(task.metric_keys)}; "
                        f"not {metric_for_best!r}")
    print(task.describe(splits))
    return task, splits


def read_model(model: Section, max_length: int, task: Task, backend: Roles) -> ModelInfo:
    """The model stage's first part (the model section of the options): the config, checked by
    the task and the strategy, and the tokenizer; --max-length checked against the model's
    positions. No weights yet."""
    config = load_pretrained(AutoConfig, model.model)
    task.model.check(config, model.model)
    backend.strategy.check_model(config, model.lora)  # --tensor-parallel: the heads split, the family has a plan
    tokenizer = load_tokenizer(model.model)
    limit = position_limit(config, tokenizer)
    if max_length > limit:
        raise UserError(f"--max-length {max_length} is longer than model {model.model} takes ({limit} tokens)")
    return ModelInfo(config, tokenizer, limit)


def plan_shapes(task: Task, backend: Roles, optimizer: Section, train_rows: int) -> Shapes:
    """The shapes stage (the optimizer section: the batch and its accumulation): a micro-batch's
    rows, the devices in data parallel, the steps an epoch runs; checked to hold a step."""
    shapes = Shapes(task.rows.batch_rows(optimizer.batch_size), backend.planned_data_parallel_size(),
                    optimizer.grad_accum, repeats=task.objective.updates_per_batch)
    check_steps(shapes, train_rows)
    return shapes


def packed_length(task: Task, attention: str, kind: str, info: ModelInfo, max_length: int) -> int:
    """The rows' length: --max-length, or for packed rows a length the device's attention kernel
    serves where cheaper (within the model's positions), said on the console."""
    if not task.rows.packed:
        return max_length
    served = row_length(attention, kind, info.config, max_length, packed=True)
    served = served if served <= info.limit else max_length
    _say(row_lengths_line(attention, kind, [max_length], [served]))
    return served


def settle_rows_padding(task: Task, shapes: Shapes, request: PaddingRequest, sized: Any, backend: Roles,
                        resume: checkpoint.Resume | None, max_length: int) -> Padding:
    """The padding stage: the task's padding of the tokenised rows (`sized`), settled from the
    request (a resumed run's buckets: its data order depends on them)."""
    resumed = resume.state["buckets"] if resume else None
    return task.rows.padding(
        lambda: settle_padding(request, shapes, sized, task.eval_splits, backend.accelerator, resumed),
        max_length, sized)


def kernel_buckets(padding: Padding, attention: str, kind: str, config: Any, max_length: int, train: Any) -> Padding:
    """Padded rows: the buckets rounded up to lengths the device's attention kernel serves, where
    cheaper than the mask path, said on the console with the padding's share before and after."""
    buckets = padding.bucket_list
    if not buckets:
        return padding
    rounded = [row_length(attention, kind, config, b, packed=False) for b in buckets]
    served = sorted(set(rounded))
    if served == buckets:
        return padding
    kept = Padding("buckets", served, max(served[-1], max_length))
    line = row_lengths_line(attention, kind, buckets, rounded)
    assert line is not None  # served != buckets (sorted, distinct): some were rounded up
    _say(line + f"; padding {padding_share(padding, lengths(train)):.1%} of the training tokens, now "
         f"{padding_share(kept, lengths(train)):.1%}")
    return kept


def load_model(cfg: TrainOptions, backend: Roles, task: Task, tokenizer: Any,
               resume: checkpoint.Resume | None) -> Any:
    """The model stage's second part: the pretrained model as the task loads it, its adapters
    (--lora), a resumed run's weights, a LoRA base held in bf16."""
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    bnb.check_roles(cfg.quantization(), backend)  # a bitsandbytes base where it cannot run
    model = pretrained(backend.strategy, cfg, task, tokenizer, whole=weights is not None)
    if cfg.lora:
        model = add_adapters(model, cfg.section("model"), task.model.peft_task_type)
    if weights is not None:
        assert resume is not None  # weights come from it
        resume.load_model(model, weights)
        del weights
    if cfg.lora and cfg.precision == "bf16":
        hold_frozen_in_bf16(model)  # here, once: forked replicas share these pages
    return model


def pretrained(strategy: Strategy, cfg: TrainOptions, task: Task, tokenizer: Any, whole: bool = False) -> Any:
    """Model `cfg.model` as the task loads it. Under a strategy that `loads_shards` (FSDPv2 on XLA)
    it is built without the checkpoint's weights, which `wrap_model` reads into their shards on the
    devices, never whole on this host (parallel.sharded_load), LoRA's base too (a quantized one: each
    host quantizes its devices' rows); loaded `whole` where asked (a resumed run's whole weights) or
    where the folder does not allow it. A quantized base loads whole, quantized as it is read
    (`load_base`), where bitsandbytes holds it (CUDA, the CPU) or transformers converts the
    model's tensors as it loads them (a mixture's stacked experts: `skeleton` would load them whole
    in full precision first)."""
    load = functools.partial(task.model.load, cfg.model, cfg.seed, tokenizer.pad_token_id)
    quant = cfg.quantization()
    if quant is not None and not whole:
        whole = strategy.accelerator.name in bnb.BACKENDS or \
            sharded_load.converts(load_pretrained(AutoConfig, cfg.model).model_type)
    model = sharded_load.skeleton(load, cfg.model) if strategy.loads_shards and not whole else None
    if model is None:
        return load_base(load, quant, strategy.accelerator.name, cfg.precision, cfg.model)
    return quantize_skeleton(model, quant) if quant else model


def _say(line: str | None) -> None:
    if line:
        print(line)


def padding_share(padding: Padding, lengths: list[int]) -> float:
    """The share of padding in rows of these `lengths`, each padded as `padding` pads its batch."""
    real = sum(lengths)
    padded = sum(padding.pad_to(n) for n in lengths)
    return (padded - real) / padded if padded else 0.0


def tokenize_task(cfg: TrainOptions, task: Task, splits: Any, tokenizer: Any, test: Any = None,
                  max_length: int | None = None, entry: str | None = None) -> tuple[Any, dict[str, int]]:
    """Every split tokenised once; the workers get this copy. `test`: --test-file's rows, read
    (and tokenised) by the task's prediction part, counted here. `max_length`: the rows' length
    (default --max-length). `entry`: the data cache's entry for these rows (data_cache.key), read
    where it exists, written where not."""
    max_length = max_length or cfg.max_length
    data, truncated, cached = data_cache.tokenised(entry, lambda: task.rows.tokenize(splits, tokenizer, max_length))
    if cached:
        assert entry is not None  # rows come from the cache only where they have an entry
        print(f"data: the tokenised rows from the cache ({data_cache.folder() / entry}; --no-data-cache "
              "tokenises again)")
    units = dict.fromkeys(truncated, task.rows.unit)
    if test is not None:
        truncated["test"], units["test"] = test.truncated, task.prediction.unit
    if any(truncated.values()):
        print(f"truncated to --max-length {max_length} tokens: "
              + ", ".join(f"{n} {split} {units[split]}" for split, n in truncated.items()))
    return data, truncated


def launch(roles: Roles, job: Job, worker: Callable[[Job], Any]) -> None:
    """`worker(job)` on every local worker. Workers get the tokenised data and the model from here:
    forked replicas (XLA) share these pages instead of each loading a copy; spawned ones (gloo,
    NCCL) receive them pickled. A launcher passes SIGTERM on to its workers, which save and stop;
    on several hosts they inherit the pod's failure marker, unset again afterwards."""
    with StopRequest(), watch_pod(job.pod_marker):
        roles.launch(worker, (job,))
