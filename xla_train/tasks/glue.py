"""GLUE's nine tasks: their files' layouts, labels and metrics, read from GLUE's own TSV files or
from the hub. Each becomes a `Classification` or, for STS-B, a `Regression` task.

    --task mrpc                      the bundled MRPC copy (the default)
    --task sst2 --data-dir DIR       a GLUE task's folder in GLUE's own layout (train.tsv, dev.tsv)
    --task rte --data-dir hub        load_dataset("glue", "rte"), where the hub is reachable
"""

import csv
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError, describe
from .base import number
from .files import check_text

BUNDLED_MRPC = Path(__file__).resolve().parents[1] / "data" / "mrpc"


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


def submission(name, scores):
    """Each row's prediction as GLUE's submission file for task `name` writes it (`scores`: the
    rows' predict columns): the label as GLUE's files spell it, or STS-B's score to 3 places."""
    spec = GLUE[name]
    outputs = len(spec.labels) or 1
    if scores.shape[1] != outputs:
        raise UserError(f"{name}'s submission takes {outputs} output(s) a row ({', '.join(spec.labels) or 'a score'}); "
                        f"the model gives {scores.shape[1]}")
    if spec.labels:
        return [spec.file_labels[i] for i in scores.max(1).indices.tolist()]
    return [f"{v:.3f}" for v in scores[:, 0].tolist()]


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
    out: dict[str, list] = {f"text{i + 1}": [] for i in range(len(cols))}
    out["label"] = []
    for lineno, row in enumerate(rows[first - 1:], start=first):
        value = row[label_col].strip()
        if spec.labels:
            if value not in spec.file_labels:
                choices = ", ".join(spec.file_labels[:-1]) + " or " + spec.file_labels[-1]
                raise UserError(f"{path}:{lineno}: label must be {choices}, found {value!r}")
            out["label"].append(spec.file_labels.index(value))
        else:
            out["label"].append(number(value, path, lineno))
        for i, c in enumerate(cols):
            out[f"text{i + 1}"].append(row[c])
    if not out["label"]:
        raise UserError(f"{path}: no rows (empty split)")
    return out


def glue_folder_splits(task, folder):
    """The splits of a GLUE task's folder in GLUE's own layout: train.tsv and dev.tsv (MNLI:
    dev_matched.tsv and dev_mismatched.tsv, both scored)."""
    import datasets

    if not folder.is_dir():
        raise UserError(f"data folder not found: {folder}")
    spec = GLUE[task]
    files = {"train": "train.tsv", "validation": spec.dev_files[0]}
    if len(spec.dev_files) > 1:
        files["validation_mismatched"] = spec.dev_files[1]
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(read_glue_tsv(folder / name, task)) for split, name in files.items()})


def load_mrpc(data_dir=None):
    """MRPC's `train` and `validation` splits with the columns `load_dataset("glue", "mrpc")` has
    (sentence1, sentence2, label, idx), for loops written like the course's: the bundled copy, a
    GLUE folder, or "hub" for the hub's own."""
    import datasets

    if data_dir == "hub":
        ds = _hub("mrpc")
        return datasets.DatasetDict(train=ds["train"], validation=ds["validation"])
    splits = glue_folder_splits("mrpc", Path(data_dir) if data_dir else BUNDLED_MRPC)
    return datasets.DatasetDict({
        name: split.rename_columns({"text1": "sentence1", "text2": "sentence2"}).add_column(
            "idx", list(range(len(split)))) for name, split in splits.items()})


def glue_hub_splits(task):
    """The splits of `load_dataset("glue", task)`, where the Hugging Face hub is reachable."""
    import datasets

    ds = _hub(task)
    spec = GLUE[task]
    names = ["train", "validation"] if task != "mnli" else ["train", "validation_matched", "validation_mismatched"]
    splits = {}
    for name in names:
        split = ds[name].rename_columns({c: f"text{i + 1}" for i, c in enumerate(spec.texts)})
        keep = [c for c in split.column_names if c.startswith("text") or c == "label"]
        splits["validation" if name == "validation_matched" else name] = split.select_columns(keep)
    return datasets.DatasetDict(splits)


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
