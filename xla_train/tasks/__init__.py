"""What is trained: a task object per kind of job, and the data sources that make one.

A kind is a `Task` subclass (base.py: the protocol) registered in `KINDS` (kinds.py) under its `--problem`
name: `classification` and `regression` (sequence.py). A source gives a task its splits, with
columns `text1` [`text2`] and `label`: GLUE's nine tasks (glue.py) or a user's own files (files.py).

    --task mrpc                      the bundled MRPC copy (the default)
    --task sst2 --data-dir DIR       a GLUE task's folder in GLUE's own layout (train.tsv, dev.tsv)
    --task rte --data-dir hub        load_dataset("glue", "rte"), where the hub is reachable
    --train-file F --validation-file F [--text-columns A[,B]] [--label-column L]   own files
"""

from pathlib import Path

from ..core.errors import UserError, check_choice
from .base import MINIMISED, RECORD, Task, load_metric, read_config, read_record, scores
from .files import FILE_FORMATS, load_files, read_table, text_columns_of
from .glue import (
    BUNDLED_MRPC,
    GLUE,
    TASKS,
    glue_columns,
    load_glue_folder,
    load_glue_hub,
    load_mrpc,
    read_glue_tsv,
)
from .kinds import KINDS, PROBLEMS
from .sequence import Classification, Regression

__all__ = ["BUNDLED_MRPC", "FILE_FORMATS", "GLUE", "KINDS", "MINIMISED", "PROBLEMS", "RECORD", "TASKS",
           "Classification", "Regression", "Task", "check_choices", "from_folder", "glue_columns", "load_files",
           "load_glue_folder", "load_glue_hub", "load_metric", "load_mrpc", "load_task", "read_glue_tsv",
           "read_table", "scores", "text_columns_of"]


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
    """--task names a GLUE task and --problem a kind of task (None: not given)."""
    check_choice("--task", task, TASKS)
    check_choice("--problem", problem, PROBLEMS)


def from_folder(folder):
    """The task a fine-tuned model folder was trained for: the kind that claims its config, with
    what the folder's record says (labels, text columns, length)."""
    config = read_config(folder)
    kind = next((k for k in KINDS.values() if k.claims(config)), None)
    if kind is None:
        raise UserError(f"--model {folder}: not a fine-tuned sequence classifier (architectures: "
                        f"{', '.join(config.architectures or ['none'])})")
    return kind.from_config(config, read_record(folder))
