"""A user's own files: .csv, .tsv, .json, .jsonl or .parquet rows with text columns and a label
column (or, for causal-lm, rows of one of its forms: causal_lm.py).

    --train-file F --validation-file F [--text-columns A[,B]] [--label-column L] [--problem P]
"""

import math
import re
from pathlib import Path

from ..core.errors import UserError, first_line
from .base import row_name

FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}  # predict writes these too
DATA_FORMATS = {**FILE_FORMATS, ".parquet": "parquet"}  # what training reads
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name


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


def read_table(path):
    """A user's .csv, .tsv, .json or .jsonl file as a `datasets.Dataset`, through datasets' own
    loaders (CSV quoting as pandas and Python's csv module write it; JSON: one object per line,
    or a list of objects)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    path = Path(path)
    kind = DATA_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"{path}: unknown file type {path.suffix or '(none)'!r}; use "
                        f"{', '.join(DATA_FORMATS)}")
    if not path.is_file():
        raise UserError(f"missing data file: {path}")
    if path.stat().st_size == 0:
        raise UserError(f"empty data file: {path}")
    if kind != "parquet":
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


def read_source(spec, split):
    """Rows from a file (read_table), a folder written by `datasets`' `save_to_disk` (a Dataset,
    or a DatasetDict's `split`), or, where the hub is reachable, a hub data set's `split` by name."""
    import datasets

    path = Path(spec)
    if path.is_dir():
        try:
            return split_of(datasets.load_from_disk(str(path)), split, spec)
        except FileNotFoundError as e:
            raise UserError(f"{spec}: a folder, but not one that datasets' save_to_disk wrote ({first_line(e)})")
    if path.exists() or path.suffix.lower() in DATA_FORMATS or not HUB_NAME.fullmatch(str(spec)):
        return read_table(path)
    try:
        loaded = datasets.load_dataset(str(spec))
    except Exception as e:  # offline, no such data set, or one datasets cannot build: all one line
        raise UserError(f"{spec}: no such file, and no hub data set of that name could be loaded ({first_line(e)})")
    return split_of(loaded, split, spec)


def split_of(loaded, split, spec):
    """A Dataset as it is, or a DatasetDict's `split` (one line naming the splits it has)."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        ds = loaded
    elif split in loaded:
        ds = loaded[split]
    else:
        raise UserError(f"{spec}: no {split!r} split (splits: {', '.join(loaded)}); save the split you mean, or give "
                        "a file")
    if len(ds) == 0:
        raise UserError(f"{spec}: no rows (empty split)")
    return ds


def load_files(train_file, validation_file, kinds, text_columns=None, label_column="label", problem=None,
               max_length=128):
    """Own training and validation files: text columns, labels and problem type (of `kinds`, the
    sequence kinds by name, each with `encode_labels`, `own_metric` and `own_main`) settled here;
    returns (the task, its splits)."""
    import datasets

    files = {"train": Path(train_file), "validation": Path(validation_file)}
    raw = {split: read_table(path) for split, path in files.items()}
    for split, ds in raw.items():
        if label_column not in ds.column_names:
            raise UserError(f"{files[split]}: no label column {label_column!r} (columns: "
                            f"{', '.join(ds.column_names)}); name it with --label-column")
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
            raise UserError(f"{files[split]}: {row_name(files[split], bad)} has an empty label")
    guess = "regression" if any(isinstance(v, float) for v in values["train"]) else "classification"
    kind = kinds[problem or guess]
    labels, targets = kind.encode_labels(values, files)
    splits = {}
    for split, ds in raw.items():
        cols = {f"text{i + 1}": [_text(v) for v in ds[c]] for i, c in enumerate(texts)}
        splits[split] = datasets.Dataset.from_dict({**cols, "label": targets[split]})
    return (kind("custom", labels, list(texts), kind.own_metric, kind.own_main, max_length=max_length),
            datasets.DatasetDict(splits))


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


def _root(e):
    while e.__cause__ or e.__context__:
        e = e.__cause__ or e.__context__
    return e
