"""Every option of `xla-train train` and `xla-train predict`, declared once: default, help, choices.

The CLI's parsers are built from these dataclasses (`cli.py`), and `validate()` is the one check
of a whole set of options. This module imports no torch, transformers, datasets or torch_xla, so
`--help` starts at once.
"""

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from .core.errors import UserError, check_choice
from .core.shapes import parse_buckets
from .models import BUNDLED_MODEL, bundled_model_path
from .tasks import FILE_FORMATS, PROBLEMS, TASKS, check_choices
from .trackers import TRACKERS, trackers

PADDING_MODES = ("buckets", "max_length", "dynamic")
PRECISIONS = ("fp32", "bf16")


def option(default, help, choices=None, required=False):
    """A dataclass field that is also a command-line option (`--name-with-dashes`)."""
    return field(default=default, metadata={"help": help, "choices": choices, "required": required})


def backend_option():
    """--backend, the same for train and predict (the names are checked where they are chosen:
    core/select.py)."""
    return option("auto", "auto | xla | tpu | cuda | cpu (xla: torch_xla; tpu: TorchTPU; auto: a TPU through "
                  "whichever of the two is installed, then CUDA, then CPU)")


def strategy_option():
    return option("ddp", "ddp (a replica per device), spmd (XLA: one process shards each batch over all devices) or "
                  "fsdp (the model's weights, gradients and AdamW state sharded over all devices too: FSDPv2 on XLA, "
                  "FSDP2 on CUDA and the CPU)")


def flag_name(name):
    return "--" + name.replace("_", "-")


@dataclass
class TrainOptions:
    """`xla-train train`: what to train on, the course's hyperparameters, shapes and the system."""

    # what to train on
    model: str = option(None, f"model folder or hub name (default: {BUNDLED_MODEL})")
    task: str = option(None, f"GLUE task: {', '.join(TASKS)} (default: mrpc; with own files: custom)")
    data_dir: str = option(None, "the task's folder in GLUE's layout (train.tsv, dev.tsv; MNLI: dev_matched.tsv, "
                           "dev_mismatched.tsv); 'hub' for load_dataset('glue', TASK); default: the MRPC copy "
                           "bundled with the package")
    train_file: str = option(None, "own training data: .csv, .tsv, .json, .jsonl or .parquet (causal-lm also a "
                             "save_to_disk folder or a hub data set's name)")
    validation_file: str = option(None, "own validation data, same columns (causal-lm: optional, else one in 20 of the "
                                  "training rows are held out)")
    text_columns: str = option(None, "own data: A or A,B (default: sentence1,sentence2 if present, else the first "
                               "two text columns, else the first)")
    label_column: str = option("label", "own data: the label's column (default: label)")
    problem: str = option(None, f"own data: {' | '.join(PROBLEMS)} (default: float labels make a regression, "
                          "others a classification; causal-lm: instruction fine-tuning of a decoder on messages, "
                          "prompt/completion or text rows)")
    test_file: str = option(None, "rows to predict with the final (or best) model, written to "
                            "OUTPUT_DIR/predictions.EXT (a GLUE test.tsv: GLUE's submission format); causal-lm: "
                            "prompt or messages rows, completed greedily as xla-train predict does (in the run's "
                            "--precision, the adapters unmerged), into OUTPUT_DIR/predictions.jsonl")
    max_new_tokens: int = option(None, "causal-lm, --test-file: tokens to generate per row at most (default: 64)")
    # system
    backend: str = backend_option()
    num_processes: int = option(None, "workers on this host (default: one per TPU core or GPU; 1 on the CPU and "
                                "on XLA:CPU)")
    strategy: str = strategy_option()
    compile: bool = option(False, "compile the model with torch.compile on the torch-native backends (cuda: with CUDA "
                           "graphs; tpu: TorchTPU's compiler; cpu), one graph per bucket length; xla compiles every "
                           "step already")
    # hyperparameters (the course's: AdamW, linear schedule, 3 epochs, batch 8)
    epochs: int = option(3, "passes over the training data")
    batch_size: int = option(8, "per replica")
    lr: float = option(5e-5, "AdamW's peak learning rate (linear decay to 0)")
    weight_decay: float = option(0.0, "AdamW's weight decay")
    warmup_ratio: float = option(0.0, "fraction of the steps with a rising learning rate, in [0, 1)")
    seed: int = option(42, "the new head's weights, dropout and the data order")
    max_steps: int = option(None, "stop after this many optimizer steps (default: all epochs)")
    # shapes
    padding: str = option("buckets", " | ".join(PADDING_MODES) + " (dynamic: a new graph per batch length on XLA)",
                          PADDING_MODES)
    buckets: str = option("auto", "auto, or lengths like 32,64,96,128")
    max_length: int = option(128, "truncate rows to this length (causal-lm: documents; packed rows are this long)")
    packing: bool = option(None, "causal-lm: whole documents packed into rows of exactly --max-length tokens, each "
                           "attending to itself only (the default); --no-packing: a row per document, padded to "
                           "--buckets")
    compile_seconds: float = option(None, "cost of one compilation for --buckets auto (default: the backend's "
                                    "estimate)")
    precision: str = option("fp32", " | ".join(PRECISIONS), PRECISIONS)
    grad_accum: int = option(1, "micro-batches per optimizer step")
    gradient_checkpointing: bool = option(False, "recompute each transformer block's activations in the backward "
                                          "pass instead of keeping them: less memory, about a third more compute "
                                          "(XLA: torch_xla's checkpoint)")
    max_grad_norm: float = option(None, "clip gradients to this norm (default: no clipping)")
    # adapters
    lora: bool = option(False, "train LoRA adapters (peft) and the classification head instead of every weight; "
                        "OUTPUT_DIR holds the adapter")
    lora_r: int = option(8, "--lora: the adapters' rank")
    lora_alpha: float = option(16.0, "--lora: the adapters' scale numerator (scale alpha / r)")
    lora_dropout: float = option(0.05, "--lora: dropout on the adapters' input")
    lora_targets: str = option(None, "--lora: module names to adapt, comma-separated (default: the attention "
                               "projections peft knows for the architecture)")
    merge_lora: bool = option(False, "--lora: write the merged whole model to OUTPUT_DIR instead of the adapter "
                              "(plain transformers loads it)")
    log_every: int = option(10, "steps between reads of the loss from the device")
    # the output folder
    output_dir: str = option(None, "local folder or gs://bucket/prefix for checkpoints and the fine-tuned model and "
                             "tokenizer; locally also TensorBoard events (tensorboard/), metrics.json, "
                             "compilations.json and report/")
    save_every: int = option(None, "steps between checkpoints (default: every epoch)")
    keep_last: int = option(2, "complete checkpoints to keep")
    resume: bool = option(False, "continue from the latest complete checkpoint in --output-dir (starts from the "
                          "beginning when there is none)")
    overwrite: bool = option(False, "replace the run --output-dir holds: its checkpoints, model and logs are removed "
                             "once this run's checks pass (without it, a folder holding a run stops a new one)")
    resume_from: str = option(None, "continue from this checkpoint (OUTPUT_DIR/checkpoints/step-N)")
    compile_cache: str = option(None, "persistent XLA compilation cache folder (default: none)")
    metrics_out: str = option(None, "write the run's metrics JSON here; missing folders are made (default: none; "
                              "OUTPUT_DIR/metrics.json is written in any case)")
    # where the time goes
    profile_steps: str = option(None, "capture a profile of optimizer steps A to B (A:B, e.g. 12:16) into "
                                "OUTPUT_DIR/profile/ (a local folder or gs://) for TensorBoard's profile plugin, "
                                "one per host")
    report_to: str = option("tensorboard", f"where the run's scalars go besides TensorBoard: {', '.join(TRACKERS)} "
                            "or none, comma-separated. TensorBoard's events are written to a local output folder "
                            "whatever this says (the report reads them): 'tensorboard' adds nothing, 'none' no "
                            "other tracker")
    # model selection
    eval_every: int = option(None, "evaluate every N optimizer steps (default: at the end of each epoch)")
    eval_samples: int = option(None, "causal-lm: at every evaluation, complete the first N validation prompts "
                               "greedily, up to their reference's length, into OUTPUT_DIR/samples/step-K.jsonl, "
                               "TensorBoard's text tab and the trackers")
    metric_for_best: str = option(None, "the evaluation metric that ranks models (default: the task's main metric, "
                                  "causal-lm's loss; mse, loss and perplexity are minimised, the others maximised)")
    save_best: bool = option(False, "keep the best evaluation's weights: the final model (and --test-file's "
                             "predictions) are the best one's")
    early_stopping_patience: int = option(None, "stop after this many evaluations without improvement")

    def __post_init__(self):
        self.model = self.model or bundled_model_path()

    def validate(self):
        """Every check of the options alone (files and data are checked when they are read)."""
        _check_choices(self, {"padding": PADDING_MODES, "precision": PRECISIONS})
        _at_least_one(self, ("epochs", "batch_size", "grad_accum", "log_every", "max_length"),
                      ("max_steps", "save_every", "keep_last", "eval_every", "eval_samples", "early_stopping_patience",
                       "max_new_tokens"))
        _check_numbers(self, {  # name: (allowed, what the message says)
            "lr": (lambda x: x > 0, "a positive number"),
            "weight_decay": (lambda x: x >= 0, "a number >= 0"),
            "warmup_ratio": (lambda x: 0 <= x < 1, "in [0, 1)"),
            "max_grad_norm": (lambda x: x > 0, "a positive number"),
            "compile_seconds": (lambda x: x >= 0, "a number of seconds >= 0"),
            "lora_alpha": (lambda x: x > 0, "a positive number"),
            "lora_dropout": (lambda x: 0 <= x < 1, "in [0, 1)"),
        })
        self._check_lora()
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32), not {self.seed}")
        check_choices(self.task, self.problem)
        if self.test_file and not self.output_dir:
            raise UserError("--test-file needs --output-dir, where predictions.EXT is written")
        if self.resume and not self.output_dir:
            raise UserError("--resume needs --output-dir, the folder that holds the checkpoints")
        parse_buckets(self.buckets, self.max_length)
        if self.compile and self.padding == "dynamic":
            raise UserError("--compile needs static shapes: --padding buckets or max_length, not dynamic (a graph "
                            "for every batch length)")
        self._check_observers()
        check_model_path(self.model)
        if self.metrics_out:
            check_output_file(self.metrics_out, "--metrics-out")


    def _check_lora(self):
        given = [name for name in ("lora_targets", "merge_lora") if getattr(self, name)]
        if given and not self.lora:
            raise UserError(f"{flag_name(given[0])} needs --lora")
        if self.lora_r < 1:
            raise UserError(f"--lora-r must be at least 1, not {self.lora_r}")

    def _check_observers(self):
        if self.profile_steps:
            from .profile import parse_steps

            parse_steps(self.profile_steps)
            if not self.output_dir:
                raise UserError("--profile-steps needs an --output-dir, where profile/ is written")
        unknown = [name for name in trackers(self.report_to) if name not in TRACKERS]
        if unknown:
            raise UserError(f"--report-to takes {', '.join(TRACKERS)} or none, comma-separated; not {unknown[0]!r}")


@dataclass
class PredictOptions:
    """`xla-train predict`: a fine-tuned classifier's predictions, or a causal LM's completions,
    for a file."""

    model: str = option(None, "a folder written by xla-train train (or any fine-tuned sequence-classification "
                        "or causal-LM folder; a --lora run's adapter folder too)", required=True)
    input: str = option(None, ".csv, .tsv, .json, .jsonl, or a GLUE .tsv file (test.tsv); for a causal LM, rows "
                        "with a 'prompt' column or a 'messages' column (chat turns)", required=True)
    output: str = option(None, "file to write (missing folders are made): GLUE's index<TAB>prediction for a GLUE "
                         "file, else the input's columns plus prediction and score (a causal LM: plus "
                         "completion), in the format of its extension", required=True)
    backend: str = backend_option()
    strategy: str = strategy_option()
    num_processes: int = option(None, "workers on this host (default: one per TPU core or GPU; 1 on the CPU)")
    batch_size: int = option(8, "rows per replica and batch")
    text_columns: str = option(None, "A or A,B (default: the columns the model was trained on)")
    task: str = option(None, "the GLUE task whose file layout --input has (default: the model's own task)")
    max_length: int = option(None, "truncate rows; a causal LM's prompts keep their last tokens (default: training's, "
                             "else 128)")
    buckets: str = option("auto", "auto, or lengths like 32,64,96,128")
    # a causal LM's generation
    max_new_tokens: int = option(None, "causal LM: tokens to generate per row at most; a row ends at its "
                                 "end-of-sequence token (default: 64)")
    temperature: float = option(None, "causal LM: 0 picks the likeliest token (greedy, the default); above 0 "
                                "samples from the logits divided by it")
    top_p: float = option(None, "causal LM, with --temperature above 0: sample from the likeliest tokens whose "
                          "probability reaches this share, in (0, 1] (default: 1, all)")
    seed: int = option(None, "causal LM: the sampling's random seed (default: 0)")
    metrics_out: str = option(None, "write the rows, the time taken (a causal LM: tokens generated and tokens/s) "
                              "and, on XLA, the compilations as JSON here")

    def validate(self):
        _at_least_one(self, ("batch_size",), ("max_length", "max_new_tokens"))
        _check_numbers(self, {
            "temperature": (lambda x: x >= 0, "a number >= 0"),
            "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
        })
        if self.top_p is not None and not self.temperature:
            raise UserError("--top-p applies to sampling: give --temperature above 0 too")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32), not {self.seed}")
        if self.metrics_out:
            check_output_file(self.metrics_out, "--metrics-out")
        check_choices(self.task)
        check_output_file(self.output, "--output", formats=FILE_FORMATS)
        check_model_path(self.model, need=True)
        if self.max_length:
            parse_buckets(self.buckets, self.max_length)


def _check_choices(opts, choices):
    for name, allowed in choices.items():
        check_choice(flag_name(name), getattr(opts, name), allowed)


def _at_least_one(opts, always, when_given):
    for name in (*always, *(n for n in when_given if getattr(opts, n) is not None)):
        if getattr(opts, name) < 1:
            raise UserError(f"{flag_name(name)} must be at least 1")


def _check_numbers(opts, rules):
    for name, (ok, what) in rules.items():
        value = getattr(opts, name)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise UserError(f"{flag_name(name)} must be {what}, not {value}")


def check_model_path(name, need=False):
    """A --model that names a local path (or, with `need`, any --model) must be a model folder;
    anything else is a hub name."""
    path = Path(name).expanduser()
    if not (need or path.exists() or str(name).startswith(("/", ".", "~"))):
        return
    if not path.exists():
        raise UserError(f"--model {name}: no such folder")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {name}: not a model folder (no config.json in it)")


def check_output_file(name, option, formats=None):
    """A file the run writes at its end can be written: no folder, of a known format (`formats`),
    under a folder or a path where one can be made (missing folders are made when it is written)."""
    from .core.storage import nearest_existing

    path = Path(name)
    if formats and path.suffix.lower() not in formats:
        raise UserError(f"{option} {path}: unknown file type {path.suffix or '(none)'!r}; use {', '.join(formats)}")
    if path.is_dir():
        raise UserError(f"{option} {name} is a folder; name a file")
    parent = nearest_existing(path.parent)
    if not parent.is_dir():
        raise UserError(f"{option} {name}: {parent} is a file, not a folder")


def option_fields(cls):
    """(flag, field) of every option of `cls`, in declaration order."""
    return [(flag_name(f.name), f) for f in fields(cls)]
