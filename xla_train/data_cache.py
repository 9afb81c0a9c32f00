"""Tokenised data kept between runs: a second run of the same data starts from it.

An entry is the tokenised splits (datasets' `save_to_disk`, read back memory-mapped) and the rows
each split cut to the length, under a key that hashes everything the rows depend on: the data
files' bytes, the model folder's files other than its weights (tokenizer, chat template, config),
the options that shape rows (the data, shapes and model sections, and --seed), the rows' length as
the job settled it, the package's own source and the versions of the libraries that tokenise and
store rows (transformers, tokenizers, datasets, jinja2). A changed file, tokenizer or option is a new
entry; nothing is ever read from an entry of other inputs. Data from the hub or from gs:// is not
cached (its bytes are not read here to hash). `--no-data-cache` turns it off.

The entries live where datasets keeps its cache (`HF_DATASETS_CACHE`, else `HF_HOME/datasets`,
else ~/.cache/huggingface/datasets), under `xla_train/`. An entry is written to a temporary
folder and renamed into place, so a reader never sees half of one, and two runs writing the same
entry at once keep one of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from . import __version__

SECTIONS = ("data", "shapes", "model")  # the options that shape rows, with --seed
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
SOURCE = Path(__file__).resolve().parent
LIBRARIES = ("transformers", "tokenizers", "datasets", "jinja2")  # tokenising, chat templates, storing


def _hash_files(digest, root: Path, skip=()) -> None:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        if path.name.endswith(skip) or "__pycache__" in path.parts:
            continue
        digest.update(str(path.relative_to(root) if path != root else path.name).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")


def _named_files(own: dict) -> list[Path]:
    """The files the kind's own options name as path/file.py:name (a tool's, an environment's): a
    docstring edited there is a schema changed in the rendered prompts."""
    values = [x for v in own.values() for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)]
    # path/file.py:name, or NAME=path/file.py:name (several environments)
    wheres = [s.strip().rpartition(":")[0].rpartition("=")[2] for v in values for s in v.split(",")]
    return [Path(w).expanduser() for w in wheres if w.endswith(".py") and Path(w).expanduser().is_file()]


def data_inputs(cfg) -> list[Path] | None:
    """The local files and folders a run's rows are read from; None where one is not local."""
    from .tasks import BUNDLED_MRPC

    if cfg.train_file:
        named = [cfg.train_file, cfg.validation_file]
    elif cfg.data_dir == "hub":
        return None
    else:
        named = [cfg.data_dir or BUNDLED_MRPC]
    paths = [Path(p) for p in named if p]
    return paths if all(p.exists() for p in paths) else None


def model_folder(name: str) -> Path | None:
    """The local folder of model `name`: itself, or the hub cache's snapshot (its revision)."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(str(name), "config.json")
    except ValueError:  # not a hub name
        return None
    return Path(found).parent if isinstance(found, str) else None


def key(cfg, max_length: int) -> str | None:
    """The entry's name for this run's rows, or None where they are not cached."""
    inputs, model = data_inputs(cfg), model_folder(cfg.model)
    if inputs is None or model is None:
        return None
    digest = hashlib.sha256()
    options = {name: value for section in SECTIONS for name, value in cfg.section(section).items()}
    # the kind's own options too: GRPO's --tools and --environment render its prompts with their schemas
    digest.update(json.dumps({"version": __version__, "libraries": _library_versions(), "options": options,
                              "own": cfg.own, "seed": cfg.seed, "max_length": max_length},
                             sort_keys=True, default=str).encode())
    for path in [*inputs, *_named_files(cfg.own)]:
        _hash_files(digest, path)
    _hash_files(digest, model, skip=WEIGHTS)
    _hash_files(digest, SOURCE, skip=(".tsv", ".json", ".txt", ".md"))  # the package's code, not its data
    return digest.hexdigest()[:32]


def _library_versions() -> dict[str, str | None]:
    """The versions of the libraries that tokenise and store the rows: an upgrade is a new entry."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def folder() -> Path:
    """Where the entries live: datasets' own cache folder (it follows HF_DATASETS_CACHE and HF_HOME)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "xla_train"


def tokenised(name: str | None, make):
    """(the tokenised DatasetDict, rows cut per split): the entry `name` where it exists, else
    `make()`'s, written as that entry. `name` None: `make()`, nothing kept. Also returns whether
    the entry was read (True) or not."""
    if name is None:
        return (*make(), False)
    import datasets

    path = folder() / name
    if (path / "truncated.json").is_file():
        try:
            with _quiet(datasets):
                data = datasets.load_from_disk(str(path))
            return data, json.loads((path / "truncated.json").read_text()), True
        except (OSError, ValueError):  # unreadable: made again, and the entry replaced
            shutil.rmtree(path, ignore_errors=True)
    data, truncated = make()
    with _quiet(datasets):
        _write(path, data, truncated)
    return data, truncated, False


@contextmanager
def _quiet(datasets):
    """No progress bar for datasets' saving and loading: both take a moment, and the bar would
    be the run's first line."""
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _write(path: Path, data, truncated) -> None:
    """The entry, written beside its place and renamed into it; a cache that cannot be written
    (a read-only or full disk) leaves the run as it was."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        data.save_to_disk(str(temporary))
        (temporary / "truncated.json").write_text(json.dumps(truncated))
        os.rename(temporary, path)
    except OSError:  # written by another run at the same time (the target exists), or not writable
        pass
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
