"""The task protocol: what one kind of training job says about its options, its data, its model,
its batches and loss, its evaluation, its predictions and its output folder.

The job, the loop, evaluation, predict, LoRA and the memory plan ask a `Task` and never branch on
its kind or read its flags. A kind is one module with a `Task` subclass and one registration
(`tasks.kinds.register`). A task is immutable; it holds what the kind says of one job (name,
labels, metric, evaluation splits, length) and assembles its parts from it, each a small object:

    rows        `Rows`: tokenize (splits to token ids), collator, padding
    objective   `Objective`: forward, loss, eval_columns, load_metric, score, metric_keys
    model       `ModelPart`: check, load, load_trained, peft_task_type
    prediction  `Prediction`: read, fit, predict, write (table.Scores, completion.Completions),
                which `xla-train predict` and a training run's --test-file both use

and, on the kind itself: check_options (its own flags, checked with the rest of the options),
load (a source to the task and its splits), claims and from_config (a saved folder read back),
record, describe, and sample_rows/samples (--eval-samples, kinds that generate).

Kinds today: `sequence.Classification`, `sequence.Regression` and `causal_lm.CausalLM`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ..core.errors import UserError, first_line
from ..io.files import atomic_write

METRICS = Path(__file__).resolve().parent / "task_metric"  # the `evaluate` module, shipped in the package
RECORD = "xla_train_task.json"  # what training saves beside the model, read back by `xla-train predict`
MINIMISED = ("mse", "mae", "loss", "perplexity")  # metrics where lower is better


@dataclass(frozen=True)
class Source:
    """Where a kind's rows come from and how they are cut: the data options, as a kind's `load`
    takes them (the command line's names: --task, --data-dir, --train-file, ...)."""

    task: str | None = None  # a GLUE task
    data_dir: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    text_columns: str | None = None
    label_column: str = "label"
    problem: str | None = None
    seed: int = 0  # the held-out split's draw
    max_length: int = 128
    packing: bool | None = None  # None: the kind's default
    attention: str = "auto"  # how packed documents are kept apart (kernels.attention.PATHS)
    options: Any = None  # training's options (options.TrainOptions), where a kind reads its own flags; None: defaults


@dataclass(frozen=True)
class PredictSettings:
    """How rows are predicted: `xla-train predict`'s options, or a training run's for --test-file."""

    model: str  # the model's name, for messages
    max_length: int
    buckets: object = "auto"  # "auto" or bucket lengths
    max_new_tokens: int | None = None  # a generating kind's options (None: not given)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text_columns: str | None = None  # a scoring kind's options
    glue_task: str | None = None


class Prediction(Protocol):
    """A kind's prediction part: rows of a file read in the launching process, predicted on every
    replica (each its share, put back in input order), written by the main process."""

    unit: str  # what `read` may truncate, in console lines
    pads_like_training: bool  # a training run's --test-file rows take its batches' padding (and count in it)

    def check(self, settings: PredictSettings) -> None:
        """Stops with one line if `settings` ask what this kind's model cannot do."""

    def load(self, folder: str, accelerator: str = "cpu") -> Any:
        """The model a folder holds, as it predicts on `accelerator` (its name)."""

    def read(self, path: str, tokenizer: Any, settings: PredictSettings) -> Any:
        """The rows of `path`, read, checked and tokenised (`.data` with a `length` column,
        `.truncated`), before any model loads."""

    def fit(self, rows: Any, model: Any, accelerator: Any, settings: PredictSettings,
            training_padding: Any = None) -> Any:
        """The rows fitted to `model` (unwrapped, on the CPU) and padded (`.padding`): a training
        run's padding where `pads_like_training`, else buckets of their own."""

    def predict(self, engine: Any, model: Any, rows: Any, batch_size: int) -> Any:
        """Every row's result, in input order, on every replica."""

    def output_name(self, test_file: str) -> str:
        """The file a training run's --test-file writes into its output folder."""

    def write(self, path: str | Path, rows: Any, result: Any, seconds: float) -> tuple[str, dict[str, Any]]:
        """Writes the rows' results; returns (what was written, for a console line; its metrics)."""


class Rows:
    """A kind's rows: its splits tokenised, how a planned batch of them is padded (collated), and
    the batches' padding."""

    unit = "rows"  # what --max-length truncates, in console lines

    @property
    def packed(self) -> bool:
        """Whether rows are filled with documents to exactly the maximum length rather than padded
        (job.prepare then chooses that length for the device's attention kernel before packing)."""
        return False

    def batch_rows(self, batch_size: int) -> int:
        """The rows a micro-batch of --batch-size takes (GRPO: the prompts of batch_size completions)."""
        return batch_size

    def tokenize(self, splits: Any, tokenizer: Any, max_length: int) -> tuple[Any, dict[str, int]]:
        """The splits (a DatasetDict) as token ids; returns (data, rows truncated per split)."""
        raise NotImplementedError

    def collator(self, tokenizer: Any) -> Callable[[list], dict]:
        """What pads a planned batch of this kind's rows (core.batching.make_loader)."""
        from ..core.batching import PadCollator

        return PadCollator(tokenizer)

    def padding(self, settle: Callable[[], Any], max_length: int, data: Any) -> Any:
        """The batches' padding (shapes.Padding) of the tokenised `data`: `settle()` chooses it
        from the padding options (lengths in buckets)."""
        return settle()


@dataclass(frozen=True)
class PassInputs:
    """The step the memory plan counts (memory.plan), typed. The kind's part (Objective.memory_inputs):
    the `attention` implementation that runs (transformers' names: sdpa, eager, flash_attention_2, ...; the
    kernels' xla_flash, flex_attention) and whether a `dense_mask` is passed to it; `logits` per
    token, "whole" or "chunked" (None: none per token); a `reference` pass without gradients, its
    output "whole" or "chunked" (None: none); the rows' `length` in the step where the kind makes
    them longer than its loaded rows (GRPO: a prompt bucket and a completion; None: the loaded
    rows'); `cache_tokens`, a generation's key/value cache per row in the step (GRPO's rollouts; 0:
    none); `reference_copy`, a frozen copy of the weights beside the trained ones (GRPO's reference
    without adapters); and a `note` for the console. The run's part, which the trainer (or
    memory.plan_on_paper) fills in: the `rows` a device trains on at once (a tensor and context
    group's: --batch-size), the `precision`, whether the blocks are `checkpointed`, the chunked
    head's `chunk_tokens` (None: kernels.lm_loss.CHUNK_TOKENS), the implementation a mixture's
    `experts` run (kernels.experts.planned_experts; None: the model's own) and whether only
    `adapters` train (--lora)."""

    attention: str = "eager"
    dense_mask: bool = True
    logits: str | None = None
    reference: str | None = None
    length: int | None = None
    cache_tokens: int = 0
    reference_copy: bool = False
    note: str | None = None
    rows: int = 1
    precision: str = "fp32"
    checkpointed: bool = False
    chunk_tokens: int | None = None
    experts: str | None = None
    adapters: bool = False


@dataclass(frozen=True)
class Objective:
    """A kind's objective: the forward call, the loss, what evaluation gathers and how it scores.
    `metric_name` is the task_metric config; `eval_splits` the splits evaluation scores."""

    metric_name: str | None = None
    eval_splits: tuple[str, ...] = ("validation",)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps each step's loaded batches are trained on in a row (shapes.Shapes.repeats;
        GRPO's --num-iterations: several updates on one rollout)."""
        return 1

    def memory_inputs(self, model: Any, device_kind: str, length: int) -> PassInputs:
        """What the memory plan needs of this objective's step with `model` (not yet prepared) on
        a `device_kind` device (kernels.attention.kind_of's names) for loaded rows of `length` tokens
        (`PassInputs`: the attention path and its mask, the logits, a reference pass, a generation's
        cache, a note for the console where the path taken is not the device's kernel)."""
        return PassInputs(getattr(model.config, "_attn_implementation", None) or "eager")

    def batch_source(self, engine: Any, tokenizer: Any, data: Any, model: Any, total_steps: int,
                     initial: Callable[[], Any] | None = None) -> Callable[..., Any]:
        """What turns a loaded batch into the step's (`source(model, batch, split=, step=, epoch=)`),
        made once per worker after `before_training`: the batch as loaded by default; a kind that
        generates its own rows returns its rollouts (grpo.Rollouts: prompts to completions, rewards
        and advantages). Evaluation batches go through it too (`split` is their split's name).
        `initial()`: a frozen copy of the model as training began, prepared (a reference model)."""
        return as_loaded

    def forward(self, model: Any, inputs: dict[str, Any]) -> Any:
        """The model on a batch's inputs (labels taken out)."""
        return model(**inputs)

    def loss(self, output: Any, labels: Any) -> Any:
        """The training loss of a batch from the model's output."""
        raise NotImplementedError

    def step_metrics(self, output: Any, labels: Any) -> dict[str, Any] | None:
        """Training metrics of a micro-batch besides the loss, called after `loss` on the same
        output: {name: a 0-d device tensor}, averaged on the device over each log interval and read
        with the loss at log points; None (the default): none."""
        return None

    def before_training(self, engine: Any, model: Any, data: Any, make_loader: Callable[[Any, str], Any],
                        initial: Callable[[], Any]) -> Any:
        """The tokenised splits training and evaluation read (`data`, a DatasetDict), once the
        model is prepared and before the loaders are made: a kind may add columns computed with
        the model (`make_loader(dataset, split)`: a prepared loader over its rows in order, padded
        as training pads; `initial()`: the model as training begins from it, which is `model`
        unless a resumed run loaded its checkpoint's weights). The default returns `data`."""
        return data

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        """What evaluation gathers of a batch: 1-D device tensors of one dtype, a value per row."""
        raise NotImplementedError

    def load_metric(self) -> Any:
        """The `evaluate` metric that scores this kind (the module inside the package: no hub)."""
        return load_metric(self.metric_name)

    def score(self, metric: Any, columns: tuple) -> dict[str, float]:
        """The metrics over every gathered row (`columns`: eval_columns' host tensors)."""
        predictions, references = columns
        metric.add_batch(predictions=predictions, references=references)
        n = len(metric)
        return {**metric.compute(), "n": n}

    def keys(self) -> list[str]:
        """The keys `score` reports (besides the row counts), the main one first."""
        from .task_metric.task_metric import keys

        return keys(self.metric_name)

    @property
    def metric_keys(self) -> list[str]:
        """Every key an evaluation reports (besides the row counts), over every evaluation split."""
        return [k + self.eval_suffix(split) for split in self.eval_splits for k in self.keys()]

    def eval_suffix(self, split: str) -> str:
        """The metrics' key suffix of an evaluation split ("" for the first, "_mm" for MNLI's second)."""
        return "" if split == self.eval_splits[0] else "_mm"


class ModelPart:
    """A kind's model: the pretrained model with what the kind trains on top, a fine-tuned one read
    back from its folder, and peft's task type for --lora. (Which kind claims a saved folder's
    config is the kind's `claims`, asked before any task exists.)"""

    peft_task_type: str | None = None

    def check(self, config: Any, name: str) -> None:
        """Stops with one line if the model `name` (its transformers `config`) cannot do this kind's work."""

    def load(self, name: str, seed: int, pad_token_id: int | None = None, **loading: Any) -> Any:
        """The pretrained model with what this kind trains on top (a new head), from `seed`;
        `loading`: more of `from_pretrained`'s arguments (a bitsandbytes `quantization_config`)."""
        raise NotImplementedError

    def load_trained(self, folder: str, accelerator: str = "cpu") -> Any:
        """A model this kind fine-tuned, from its output folder (whole, or an adapter's), for
        `accelerator` (its name: a quantized base is quantized again by its backend's rule)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Task:
    """What to train on and how it is scored: what a kind says of one job (its name, labels,
    metric, evaluation splits and length) and the parts it assembles from them (`rows`,
    `objective`, `model`, `prediction`). Immutable: `load` returns the task and its splits apart;
    a task read back from a model folder (`from_config`) has no splits."""

    name: str | None  # a GLUE task, "custom", or None (a folder not trained by xla-train)
    labels: list[str] | None  # label names in id order; None where there are none
    text_columns: list[str] | None = None  # the source's own names of the texts the model reads
    metric_name: str | None = None  # the task_metric config
    main: str | None = None  # the main metric's key
    eval_splits: tuple[str, ...] = ("validation",)
    max_length: int = 128  # the rows' length in training (a folder's record says it to predict)

    kind: ClassVar[str | None] = None  # the --problem name of the subclass (its registration in tasks.kinds)
    # the kind's own options: a dataclass of `declare.option` fields with a `check()` of their values (TRL's
    # per-algorithm config), the recipe section named after the kind; None: the kind has none
    Options: ClassVar[type | None] = None

    @property
    def problem(self) -> str | None:
        return self.kind

    @property
    def num_labels(self) -> int:
        return len(self.labels) if self.labels else 1

    # --- options ----------------------------------------------------------------------------
    @classmethod
    def check_options(cls, opts: Any) -> None:
        """Stops with one line if training's options (`opts`, options.TrainOptions) ask this kind
        for what it does not do. These kinds pack, generate and sample nothing."""
        if opts.packing is not None:
            raise UserError(f"--{'' if opts.packing else 'no-'}packing applies to --problem causal-lm")
        if opts.max_new_tokens:
            raise UserError("--max-new-tokens applies to a causal LM's --test-file (--problem causal-lm)")
        if opts.eval_samples:
            raise UserError("--eval-samples generates text from evaluation prompts: it needs --problem causal-lm, "
                            "dpo or grpo")
        if opts.attention != "auto":
            raise UserError("--attention keeps a causal LM's packed documents apart: it applies to --problem causal-lm")
        if opts.router_aux_loss_coef is not None:
            raise UserError("--router-aux-loss-coef weighs a mixture-of-experts decoder's routers' loss: it applies to "
                            "--problem causal-lm, dpo or grpo")

    @classmethod
    def load(cls, source: Source) -> tuple[Task, Any]:
        """The task of `source` (a `Source`) and its splits (a DatasetDict: train and the
        evaluation splits), read and checked."""
        raise NotImplementedError

    # --- the parts (built once, on first use) -------------------------------------------------
    @cached_property
    def rows(self) -> Rows:
        raise NotImplementedError

    @cached_property
    def objective(self) -> Objective:
        raise NotImplementedError

    @cached_property
    def model(self) -> ModelPart:
        raise NotImplementedError

    @cached_property
    def prediction(self) -> Prediction:
        """The part that predicts rows of a file with a model of this kind (table.Scores: a
        prediction and a score per row; completion.Completions: a completion per prompt)."""
        raise UserError(f"a {self.kind} model predicts nothing: --test-file and xla-train predict do not apply")

    @property
    def metric_keys(self) -> list[str]:
        """Every key an evaluation reports (besides the row counts), the main one first."""
        return self.objective.metric_keys

    # --- --eval-samples ---------------------------------------------------------------------
    def sample_rows(self, splits: Any, n: int) -> list:
        """--eval-samples: up to `n` rows of the first evaluation split to generate from."""
        raise NotImplementedError  # check_options refused --eval-samples

    def samples(self, rows: list, tokenizer: Any, model: Any, batch_size: int) -> Any:
        """What every evaluation generates from `sample_rows`' rows (completion.Samples)."""
        raise NotImplementedError

    # --- what the output folder records ---------------------------------------------------
    @classmethod
    def claims(cls, config: Any) -> bool:
        """Whether a saved model's config is one this kind fine-tuned (predict reads it back)."""
        return False

    def record(self) -> dict[str, Any]:
        """What the output folder's record says of the task (read back by `from_config`)."""
        return {"task": self.name, "problem": self.problem, "labels": self.labels, "text_columns": self.text_columns,
                "max_length": self.max_length}

    def write_record(self, folder: str | Path) -> None:
        atomic_write(Path(folder) / RECORD, json.dumps(self.record(), indent=1) + "\n")

    @classmethod
    def from_config(cls, config: Any, saved: dict[str, Any]) -> Task:
        """The task of a saved model: its config and its record (`saved`, {} if there is none)."""
        raise NotImplementedError

    def describe(self, splits: Any) -> str:
        """The console line that says what trains on `splits`."""
        raise NotImplementedError


def as_loaded(model: Any, batch: dict[str, Any], **where: Any) -> dict[str, Any]:
    """The batch source of kinds that train on their rows as loaded."""
    return batch


def read_config(folder):
    """A model folder's transformers config; one line if it is not a model folder."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:  # no or unreadable config.json (OSError), no or unknown model_type
        raise UserError(f"--model {folder}: not a transformers model folder ({first_line(e)})")


def read_record(folder):
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def load_metric(name="mrpc"):
    """The `evaluate` metric of a GLUE task, "classification" or "regression"."""
    import evaluate

    return evaluate.load(str(METRICS), config_name=name)


def scores(results):
    """The metrics of an evaluation on one line: `accuracy 0.8064  f1 0.8663  (n=408)`."""
    counted = [k for k in results if k == "n" or k.startswith("n_")]
    values = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k not in counted)
    counts = ", ".join(f"{k}={results[k]}" for k in counted)
    return f"{values}  ({counts})"


def number(value, path, where):
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not math.isfinite(number):
        raise UserError(f"{path}:{where}: a regression needs a number, found {value!r}" if isinstance(where, int)
                        else f"{path}: {where}: a regression needs a number, found {value!r}")
    return number


def row_name(path, index):
    """How a user finds row `index` (0-based) of an own file: its line."""
    return f"line {index + 2}" if Path(path).suffix.lower() in (".csv", ".tsv") else f"row {index + 1}"
