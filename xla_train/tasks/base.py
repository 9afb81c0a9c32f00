"""The task protocol: what one kind of training job says about its model, its batches, its loss,
its evaluation, its predictions and its output folder.

The loop, evaluation, predict, LoRA and the memory plan ask a `Task` and never branch on its kind.
A new kind is one module with a `Task` subclass and one line in `tasks.KINDS`. Kinds today:
`sequence.Classification`, `sequence.Regression` and `causal_lm.CausalLM`.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import UserError, first_line
from ..core.files import atomic_write

METRICS = Path(__file__).resolve().parent / "task_metric"  # the `evaluate` module, shipped in the package
RECORD = "xla_train_task.json"  # what training saves beside the model, read back by `xla-train predict`
MINIMISED = ("mse", "loss", "perplexity")  # metrics where lower is better
GENERATION = ("max_new_tokens", "temperature", "top_p", "seed")  # predict's options for a model that generates


@dataclass
class Task:
    """What to train on and how it is scored. A task read back from a model folder
    (`from_folder`) has no splits; one made from data (tasks.load_task) has them."""

    name: str  # a GLUE task, "custom", or None (a folder not trained by xla-train)
    labels: list  # label names in id order; None where there are none
    splits: object = None  # datasets.DatasetDict: train and the evaluation splits
    text_columns: list = None  # the source's own names of the texts the model reads
    metric_name: str = None  # the task_metric config
    main: str = None  # the main metric's key
    eval_splits: list = field(default_factory=lambda: ["validation"])
    test: object = None  # predict.Table of --test-file's rows, if any
    max_length: int = 128  # the rows' length in training (a folder's record says it to predict)

    kind = None  # the --problem name of the subclass (its registration in tasks.KINDS)
    peft_task_type = None  # peft's task type for --lora
    per_token_logits = False  # logits per token (vocabulary-wide), which the memory plan counts
    unit = "rows"  # what --max-length truncates, in console lines
    packing = False  # rows of several documents, each exactly --max-length tokens long (causal-lm's)

    @property
    def problem(self):
        return self.kind

    @property
    def num_labels(self):
        return len(self.labels) if self.labels else 1

    # --- the model ------------------------------------------------------------------------
    def check_model(self, config, name):
        """Stops with one line if the model `name` (its transformers `config`) cannot do this task."""

    def load_model(self, name, seed, pad_token_id=None):
        """The pretrained model with what this task trains on top (a new head), from `seed`."""
        raise NotImplementedError

    def load_trained(self, folder):
        """A model this task fine-tuned, from its output folder (whole, or an adapter's)."""
        raise NotImplementedError

    @classmethod
    def claims(cls, config):
        """Whether a saved model's config is one this kind fine-tuned (predict reads it back)."""
        return False

    # --- batches and the loss -------------------------------------------------------------
    def tokenize(self, splits, tokenizer, max_length):
        """The splits (a DatasetDict) as token ids; returns (data, rows truncated per split)."""
        raise NotImplementedError

    def set_packing(self, packing):
        """--packing / --no-packing (None: not given): this kind packs no rows."""
        if packing is not None:
            raise UserError(f"--{'' if packing else 'no-'}packing applies to --problem causal-lm")

    def collator(self, tokenizer):
        """What pads a planned batch of this task's rows (core.batching.make_loader)."""
        from ..core.batching import PadCollator

        return PadCollator(tokenizer)

    def forward(self, model, inputs):
        """The model on a batch's inputs (labels taken out)."""
        return model(**inputs)

    def loss(self, output, labels):
        """The training loss of a batch from the model's output."""
        raise NotImplementedError

    # --- evaluation -----------------------------------------------------------------------
    def eval_columns(self, batch, output):
        """What evaluation gathers of a batch: 1-D device tensors of one dtype, a value per row."""
        raise NotImplementedError

    def load_metric(self):
        """The `evaluate` metric that scores this task (the module inside the package: no hub)."""
        return load_metric(self.metric_name)

    def score(self, metric, columns):
        """The metrics over every gathered row (`columns`: eval_columns' host tensors)."""
        predictions, references = columns
        metric.add_batch(predictions=predictions, references=references)
        n = len(metric)
        return {**metric.compute(), "n": n}

    @property
    def metric_keys(self):
        """Every key an evaluation reports (besides the row counts), the main one first."""
        from .task_metric.task_metric import keys

        return [k + self.eval_suffix(split) for split in self.eval_splits for k in keys(self.metric_name)]

    def eval_suffix(self, split):
        """The metrics' key suffix of an evaluation split ("" for the first, "_mm" for MNLI's second)."""
        return "" if split == self.eval_splits[0] else "_mm"

    def sample_rows(self, n):
        """--eval-samples: up to `n` evaluation rows to generate from, as (the row's prompt, its
        form for generation.prompt_ids, the reference answer, the row as training reads it)."""
        raise UserError("--eval-samples generates text from evaluation prompts: it needs --problem causal-lm")

    # --- predictions ----------------------------------------------------------------------
    generates = False  # predict writes completions (text), not a prediction and a score per row

    def check_predict(self, cfg):
        """Stops with one line if `xla-train predict`'s options (`cfg`) do not fit this task's model."""
        given = [name for name in GENERATION if getattr(cfg, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(f"{flag} applies to a causal LM's folder (predict generates text there); --model "
                            f"{cfg.model} is a {self.kind or 'classification'} model")

    def predict_columns(self, output):
        """A batch's predictions as 1-D float device tensors (rows' scores)."""
        raise NotImplementedError

    def predictions(self, scores):
        """(each row's prediction, its score) from predict_columns' rows in input order."""
        raise NotImplementedError

    def glue_predictions(self, scores, file_labels):
        """Each row's prediction as GLUE's submission file writes it."""
        raise NotImplementedError

    # --- what the output folder records ---------------------------------------------------
    def record(self):
        """What the output folder's record says of the task (read back by `from_config`)."""
        return {"task": self.name, "problem": self.problem, "labels": self.labels, "text_columns": self.text_columns,
                "max_length": self.max_length}

    def write_record(self, folder):
        atomic_write(Path(folder) / RECORD, json.dumps(self.record(), indent=1) + "\n")

    @classmethod
    def from_config(cls, config, saved):
        """The task of a saved model: its config and its record (`saved`, {} if there is none)."""
        raise NotImplementedError

    def describe(self):
        raise NotImplementedError


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
