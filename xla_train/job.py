"""The prepared job: what the parent process reads, checks and loads once (the output folder's
run, the data, the shapes, the model), and hands to every worker and to the finish as one value."""

import os
from dataclasses import dataclass

from transformers import AutoConfig

from . import checkpoint
from .core.batching import model_inputs_only
from .core.clock import Startup
from .core.errors import UserError
from .core.launchers import pod_marker, watch_pod
from .core.signals import StopRequest
from .core.shapes import Shapes, check_steps, padding_for, settle_padding
from .core.storage import is_remote, open_store
from .generation import MAX_NEW_TOKENS, eval_samples, prompts_to_complete
from .models import (
    add_adapters,
    hold_frozen_in_bf16,
    load_pretrained,
    load_tokenizer,
    position_limit,
)
from .predictions import read_input, tokenize_rows
from .run_folder import RunFolder
from .tasks import load_task

LAUNCH_ID = "XLA_TRAIN_LAUNCH_ID"  # one start of the job on every host of a pod (scripts/tpu_pod.py)


@dataclass
class Job:
    cfg: object  # the run's TrainOptions
    task: object  # tasks.Task: labels, metric, evaluation splits, test rows
    tokenizer: object
    data: object  # the tokenised DatasetDict: train, the evaluation splits, test
    shapes: object  # shapes.Shapes: padding, global batch, steps per epoch
    model: object  # the pretrained model with its new head (and a resumed run's weights)
    run_id: str = None  # the output folder's run
    truncated: dict = None  # rows cut to --max-length, per split
    resume: object = None  # checkpoint.Resume, or None
    pod_marker: str = None  # on several hosts: where a failing host tells the others (launchers.pod_marker)
    startup: object = None  # clock.Startup: the launching process's start and start-up's parts (goodput)
    samples: object = None  # --eval-samples: generation.Samples
    prompts: object = None  # a causal LM's --test-file: generation.Prompts

    def report(self):
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
    task = load_task(cfg.task, cfg.data_dir, cfg.train_file, cfg.validation_file, cfg.text_columns,
                     cfg.label_column, cfg.problem, cfg.seed)
    task.set_packing(cfg.packing)
    if cfg.metric_for_best and cfg.metric_for_best not in task.metric_keys:
        raise UserError(f"--metric-for-best must be one of {task.name}'s metrics: {', '.join(task.metric_keys)}; "
                        f"not {cfg.metric_for_best!r}")
    task.max_length = cfg.max_length  # what the model folder records for predict
    if cfg.test_file and not task.generates:  # a causal LM's prompts are read with its tokenizer, below
        task.test = read_input(cfg.test_file, task)
    if cfg.max_new_tokens and not (cfg.test_file and task.generates):
        raise UserError("--max-new-tokens applies to a causal LM's --test-file (--problem causal-lm)")
    print(task.describe())
    sample_rows = task.sample_rows(cfg.eval_samples) if cfg.eval_samples else None  # before tokenising drops the rows
    startup.lap("data")
    config = load_pretrained(AutoConfig, cfg.model)
    task.check_model(config, cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    limit = position_limit(config, tokenizer)
    if cfg.max_length > limit:
        raise UserError(f"--max-length {cfg.max_length} is longer than model {cfg.model} takes ({limit} tokens)")
    startup.lap("model")
    shapes = Shapes(cfg.batch_size, backend.planned_data_parallel_size(), cfg.grad_accum)
    check_steps(shapes, len(task.splits["train"]))
    data, truncated = tokenize_task(cfg, task, tokenizer)
    if resume:
        resume.check(cfg, len(data["train"]), backend)
    if task.packing:  # rows of exactly --max-length tokens: one shape
        if cfg.buckets != "auto" or cfg.padding != "buckets":
            raise UserError("--packing makes every row --max-length tokens long: --buckets and --padding apply to "
                            "--no-packing")
        shapes.padding = padding_for("max_length", None, cfg.max_length, [split["length"] for split in data.values()])
    else:
        settle_padding(cfg, shapes, data, task.eval_splits, backend.accelerator, resume)
    startup.lap("data")
    weights = resume.model_weights() if resume else None  # a corrupt file fails before any loading
    model = task.load_model(cfg.model, cfg.seed, tokenizer.pad_token_id)
    if cfg.lora:
        model = add_adapters(model, cfg, task)
    if weights is not None:
        resume.load_model(model, weights)
        del weights
    if cfg.lora and cfg.precision == "bf16":
        hold_frozen_in_bf16(model)  # here, once: forked replicas share these pages
    data = model_inputs_only(data, model)
    startup.lap("model")
    prompts = cfg.test_file and task.generates and prompts_to_complete(
        cfg.test_file, tokenizer, model, cfg.max_length, cfg.buckets, backend.accelerator,
        cfg.max_new_tokens or MAX_NEW_TOKENS)
    if prompts and prompts.truncated:
        print(f"truncated to their last --max-length {cfg.max_length} tokens: {prompts.truncated} --test-file prompts")
    samples = sample_rows and eval_samples(sample_rows, task.form, tokenizer, model, cfg.max_length,
                                           backend.accelerator.static_shapes, cfg.batch_size)
    startup.lap("data")  # the --eval-samples and --test-file prompts
    return Job(cfg, task, tokenizer, data, shapes, model, truncated=truncated, resume=resume, startup=startup,
               samples=samples, prompts=prompts or None)


def tokenize_task(cfg, task, tokenizer):
    """Every split (and the test rows) tokenised once; the workers get this copy."""
    data, truncated = task.tokenize(task.splits, tokenizer, cfg.max_length)
    if task.test is not None:
        data["test"], truncated["test"] = tokenize_rows(task.test, task, tokenizer, cfg.max_length)
    task.splits = None
    if any(truncated.values()):
        print(f"truncated to --max-length {cfg.max_length} tokens: "
              + ", ".join(f"{n} {split} {task.unit}" for split, n in truncated.items()))
    return data, truncated


def launch(roles, job, worker):
    """`worker(job)` on every local worker. Workers get the tokenised data and the model from here:
    forked replicas (XLA) share these pages instead of each loading a copy; spawned ones (gloo,
    NCCL) receive them pickled. A launcher passes SIGTERM on to its workers, which save and stop;
    on several hosts they inherit the pod's failure marker, unset again afterwards."""
    with StopRequest(), watch_pod(job.pod_marker):
        roles.launch(worker, (job,))
