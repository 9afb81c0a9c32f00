"""Sequence-level tasks: a text, or a pair of texts, to one label (`Classification`) or one number
(`Regression`), read by a transformers `...ForSequenceClassification` model with a new head.

Models, torch and transformers are imported inside the methods: `xla-train --help` reads the
task registry and must start at once.
"""

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from ..core.errors import UserError
from .base import ModelPart, Objective, Rows, Task
from .files import load_files
from .glue import BUNDLED_MRPC, GLUE, glue_folder_splits, glue_hub_splits
from .kinds import register
from .table import Scores


def _classifier():
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification


def is_classifier_config(config):
    """Whether a transformers config is a fine-tuned sequence classifier (or regressor)."""
    return any(a.endswith("ForSequenceClassification") for a in config.architectures or ())


def _regression(config):
    return config.problem_type == "regression" or config.num_labels == 1


class SequenceRows(Rows):
    """`text1` [`text2`] tokenised and truncated to the maximum length; batches padded to buckets."""

    def tokenize(self, splits: Any, tokenizer: Any, max_length: int) -> tuple[Any, dict[str, int]]:
        return tokenize(splits, tokenizer, max_length)


@dataclass(frozen=True)
class SequenceModel(ModelPart):
    """A pretrained encoder (or decoder) with a new head of `num_labels` outputs (`head`: the
    head's config, its label names too, so pipelines print them)."""

    head: dict = field(default_factory=dict)
    num_labels: int = 1
    peft_task_type = "SEQ_CLS"  # peft keeps the head ("classifier", "score") trainable in full

    def load(self, name: str, seed: int, pad_token_id: int | None = None, **loading: Any) -> Any:
        """The pretrained model with a new head for the task, initialised from `seed`."""
        import torch
        from transformers import AutoConfig

        from ..models import load_pretrained, no_cache, seed_host, shown_name

        seed_host(seed)
        options = dict(self.head)
        config = load_pretrained(AutoConfig, name)
        if config.pad_token_id is None and pad_token_id is not None:
            options["pad_token_id"] = pad_token_id  # decoder classifiers find each row's last token by it
        if is_classifier_config(config) and config.num_labels != self.num_labels:
            # a classifier fine-tuned for another label set: its head is replaced, as run_glue's
            # --ignore_mismatched_sizes does
            options["ignore_mismatched_sizes"] = True
        # fp32 weights whatever the checkpoint holds (transformers' dtype "auto" would keep a bf16
        # checkpoint's bf16, and AdamW would then update bf16 weights); --precision bf16 is autocast
        model, info = load_pretrained(_classifier(), name, output_loading_info=True, dtype=torch.float32,
                                      **options, **loading)
        no_cache(model)
        # transformers' load report would list the new head as a problem: say it here
        new = sorted({*info["missing_keys"], *(k[0] if isinstance(k, tuple) else k for k in info["mismatched_keys"])})
        if new:
            print(f"model {shown_name(name)}: new classification head for {self.num_labels} output(s) "
                  f"({', '.join(new)}), initialised with --seed {seed}")
        return model

    def load_trained(self, folder: str, accelerator: str = "cpu") -> Any:
        from ..models import load_trained

        return load_trained(_classifier(), folder, accelerator)


@dataclass(frozen=True)
class ClassifierObjective(Objective):
    """Cross-entropy over `labels`; evaluation gathers the argmax; predict writes the label's name
    and its probability."""

    labels: tuple[str, ...] = ()

    def loss(self, output: Any, labels: Any) -> Any:
        # Computed here rather than by the model, whose head may build it with data-dependent shapes
        # (DeBERTa-v2's `(labels >= 0).nonzero()`): on XLA a device-to-host read and a second graph
        # in every step. The value transformers' head computes for this problem.
        import torch.nn.functional as F

        logits = output.logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        # int32 across replicas: 64-bit integer collectives may not lower on TPU (pytorch/xla#1952)
        return output.logits.argmax(-1).int(), batch["labels"].int()

    def predict_columns(self, output: Any) -> tuple:
        """A batch's predictions as 1-D float device tensors: each label's probability."""
        return tuple(output.logits.float().softmax(-1).T)

    def predictions(self, scores: Any) -> tuple[list, list[float]]:
        """(each row's label, its probability) from predict_columns' rows in input order."""
        best = scores.max(1)
        return [self.labels[i] for i in best.indices.tolist()], best.values.tolist()


@dataclass(frozen=True)
class RegressionObjective(Objective):
    """Mean squared error; evaluation gathers the value; predict writes it."""

    def loss(self, output: Any, labels: Any) -> Any:
        import torch.nn.functional as F

        return F.mse_loss(output.logits.squeeze(), labels.squeeze())

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        return output.logits[:, 0].float(), batch["labels"].float()

    def predict_columns(self, output: Any) -> tuple:
        return (output.logits.float()[:, 0],)

    def predictions(self, scores: Any) -> tuple[list, list[float]]:
        values = scores[:, 0].tolist()
        return [round(v, 6) for v in values], values


@dataclass(frozen=True)
class SequenceTask(Task):
    """What classification and regression share: the rows (`text1` [`text2`]), the model with a new
    head, the prediction that scores rows, and how a saved classifier folder is read back."""

    own_metric: ClassVar[str | None] = None  # own data's task_metric config (a kind built on this one inherits it)
    own_main: ClassVar[str | None] = None  # own data's main metric

    @classmethod
    def load(cls, source):
        """GLUE's task (the bundled MRPC by default, a GLUE folder, or the hub's) or own files,
        whose labels say classification or regression unless --problem does."""
        if source.train_file or source.validation_file:
            if not (source.train_file and source.validation_file):
                raise UserError("own data needs both --train-file and --validation-file")
            if source.task or source.data_dir:
                raise UserError("give either --task/--data-dir or --train-file/--validation-file, not both")
            kinds = {k.kind: k for k in (Classification, Regression, cls) if k.kind}  # cls: a kind built on these
            return load_files(source.train_file, source.validation_file, kinds, source.text_columns,
                              source.label_column, source.problem, source.max_length)
        task = source.task or "mrpc"
        if source.text_columns or source.problem:
            raise UserError("--text-columns and --problem apply to own files; a GLUE task has its own")
        if source.data_dir == "hub":
            return glue_task(task, glue_hub_splits(task), source.max_length)
        if source.data_dir is None and task != "mrpc":
            raise UserError(f"the bundled data is MRPC only: give --data-dir, a folder of {task}'s GLUE files "
                            "(or 'hub' to download them)")
        return glue_task(task, glue_folder_splits(task, Path(source.data_dir) if source.data_dir else BUNDLED_MRPC),
                         source.max_length)

    @staticmethod
    def encode_labels(values, files):
        """Own files' label values per split (`values`), as the kind's targets: returns (label
        names or None, {split: targets})."""
        raise NotImplementedError

    @staticmethod
    def labels_of(config):
        """A saved model's label names (None for none), from its transformers config."""
        raise NotImplementedError

    def describe_target(self):
        """What the rows are scored as, in a few words (`describe`)."""
        raise NotImplementedError

    def head_options(self):
        """The config of the new head."""
        return {"num_labels": self.num_labels}

    @cached_property
    def rows(self):
        return SequenceRows()

    @cached_property
    def model(self):
        return SequenceModel(self.head_options(), self.num_labels)

    @cached_property
    def objective(self) -> ClassifierObjective | RegressionObjective:
        raise NotImplementedError

    @cached_property
    def prediction(self):
        return Scores(self)

    @classmethod
    def claims(cls, config):
        return is_classifier_config(config)

    @classmethod
    def from_config(cls, config, saved):
        return cls(saved.get("task"), cls.labels_of(config), text_columns=saved.get("text_columns"),
                   max_length=saved.get("max_length", 128))

    def describe(self, splits):
        texts = " + ".join(self.text_columns or ())
        sizes = ", ".join(f"{len(ds)} {split}" for split, ds in splits.items())
        return f"task {self.name}: {texts} -> {self.describe_target()}; {sizes} rows"


@register
@dataclass(frozen=True)
class Classification(SequenceTask):
    """One label of a few."""

    kind = "classification"
    own_metric = "classification"
    own_main = "accuracy"

    @classmethod
    def claims(cls, config):
        return super().claims(config) and not _regression(config)

    @staticmethod
    def labels_of(config):
        return [config.id2label[i] for i in range(config.num_labels)]

    def head_options(self):
        labels = self.labels or []
        return {"num_labels": self.num_labels, "problem_type": None,
                "id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}

    @cached_property
    def objective(self):
        return ClassifierObjective(self.metric_name, self.eval_splits, tuple(self.labels or ()))

    def describe_target(self):
        return f"{self.num_labels} labels ({', '.join(self.labels or ())})"

    @staticmethod
    def encode_labels(values, files):
        """Own files' label values per split as class ids, and the label names (sorted, numbers first)."""
        labels = sorted(set(values["train"]), key=lambda v: (isinstance(v, str), v))
        if len(labels) < 2:
            raise UserError(f"{files['train']}: every row has label {labels[0]!r}; a classifier needs at "
                            "least two classes (or use --problem regression)")
        index = {v: i for i, v in enumerate(labels)}
        unseen = next((v for v in values["validation"] if v not in index), None)
        if unseen is not None:
            raise UserError(f"{files['validation']}: label {unseen!r} never occurs in {files['train']}")
        return [str(v) for v in labels], {split: [index[v] for v in column] for split, column in values.items()}


@register
@dataclass(frozen=True)
class Regression(SequenceTask):
    """One number."""

    kind = "regression"
    own_metric = "regression"
    own_main = "pearson"

    @classmethod
    def claims(cls, config):
        return super().claims(config) and _regression(config)

    @staticmethod
    def labels_of(config):
        return None

    def head_options(self):
        return {"num_labels": 1, "problem_type": "regression"}

    @cached_property
    def objective(self):
        return RegressionObjective(self.metric_name, self.eval_splits)

    def describe_target(self):
        return "a regression"

    @staticmethod
    def encode_labels(values, files):
        """Own files' label values per split as numbers (no label names)."""
        from .base import number, row_name

        return None, {split: [number(v, files[split], row_name(files[split], i)) for i, v in enumerate(column)]
                      for split, column in values.items()}


def glue_task(name, splits, max_length=128):
    """The task of GLUE's `name` and its `splits` (columns text1 [text2] and label)."""
    spec = GLUE[name]
    kind = Classification if spec.labels else Regression
    eval_splits = tuple(s for s in splits if s != "train")
    return kind(name, list(spec.labels) or None, list(spec.texts), name, spec.main, eval_splits, max_length), splits


def load_glue_folder(task, folder):
    """A GLUE task and its splits from its folder in GLUE's own layout (glue.glue_folder_splits)."""
    return glue_task(task, glue_folder_splits(task, Path(folder)))


def load_glue_hub(task):
    """A GLUE task and its splits from `load_dataset("glue", task)`, where the Hugging Face hub is reachable."""
    return glue_task(task, glue_hub_splits(task))


def tokenize(ds, tokenizer, max_length):
    """Tokenises `text1` (and `text2`, for sentence pairs), truncated to `max_length`, adding a
    `length` column.

    Returns the tokenised DatasetDict and the number of truncated rows per split.
    """

    def encode(batch):
        texts = (batch["text1"], batch["text2"]) if "text2" in batch else (batch["text1"],)
        enc = tokenizer(*texts)  # whole rows, tokenised once: their lengths say which ones are too long
        truncated = [len(ids) > max_length for ids in enc["input_ids"]]
        long = [i for i, cut in enumerate(truncated) if cut]
        if long:  # only those again, cut as the tokenizer cuts them (a pair: the longer text first)
            cut = tokenizer(*([text[i] for i in long] for text in texts), truncation=True, max_length=max_length)
            for key in enc:
                for j, i in enumerate(long):
                    enc[key][i] = cut[key][j]
        enc["length"] = [len(ids) for ids in enc["input_ids"]]
        enc["truncated"] = truncated
        return enc

    import datasets

    from ..core.batching import MODEL_INPUTS

    keep = set(MODEL_INPUTS) | {"label", "length", "truncated", "row"}  # row: a prediction's input position
    quiet = sum(len(split) for split in ds.values()) < 50_000  # MRPC takes about a second: no bar
    if quiet:
        datasets.disable_progress_bars()
    try:
        # in memory, under a fingerprint of its own: datasets would otherwise hash the tokenizer
        # (0.4 s for MiniLM's) to name a cache file; the data cache keeps the result (data_cache.py)
        out = datasets.DatasetDict({name: split.map(encode, batched=True, desc="Tokenising", keep_in_memory=True,
                                                    new_fingerprint=f"{split._fingerprint}-tokenised-{max_length}")
                                    for name, split in ds.items()})
    finally:
        if quiet:
            datasets.enable_progress_bars()
    out = out.remove_columns([c for c in next(iter(out.values())).column_names if c not in keep])
    truncated = {split: int(sum(out[split]["truncated"][:])) for split in out}
    return out.remove_columns("truncated"), truncated
