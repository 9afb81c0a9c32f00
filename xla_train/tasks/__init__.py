"""What is trained: a task object per kind of job, and the data sources that make one.

A kind is a `Task` subclass (base.py: the protocol) registered in `KINDS` (kinds.py) under its `--problem`
name: `classification` and `regression` (sequence.py), `causal-lm` (causal_lm.py). A source gives a
sequence task its splits, with columns `text1` [`text2`] and `label`: GLUE's nine tasks (glue.py) or
a user's own files (files.py); a causal-lm task reads own rows in one of its three forms.

    --task mrpc                      the bundled MRPC copy (the default)
    --task sst2 --data-dir DIR       a GLUE task's folder in GLUE's own layout (train.tsv, dev.tsv)
    --task rte --data-dir hub        load_dataset("glue", "rte"), where the hub is reachable
    --train-file F --validation-file F [--text-columns A[,B]] [--label-column L]   own files
    --problem causal-lm --train-file F [--validation-file F]   messages, prompt/completion or text rows
"""

from pathlib import Path

from ..core.errors import UserError, check_choice
from .base import MINIMISED, RECORD, Task, load_metric, read_config, read_record, scores
from .causal_lm import CausalLM, load_causal
from .files import FILE_FORMATS, load_files, read_source, read_table, text_columns_of
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
           "CausalLM", "Classification", "Regression", "Task", "check_choices", "from_folder", "glue_columns", "load_files",
           "load_glue_folder", "load_glue_hub", "load_metric", "load_mrpc", "load_task", "read_glue_tsv",
           "read_source", "read_table", "scores", "text_columns_of"]


def load_task(task=None, data_dir=None, train_file=None, validation_file=None, text_columns=None,
              label_column="label", problem=None, seed=0):
    """The `Task` for the command line's data options (see the module docstring)."""
    check_choices(task, problem)
    if problem == CausalLM.kind:
        if task or data_dir:
            raise UserError("--problem causal-lm trains on own rows (--train-file), not on a GLUE task: leave out "
                            "--task and --data-dir")
        if text_columns:
            raise UserError("--text-columns applies to classification and regression; causal-lm rows are told by "
                            "their columns (messages, prompt/completion or text)")
        if not train_file:
            raise UserError("--problem causal-lm needs --train-file (and optionally --validation-file)")
        return load_causal(train_file, validation_file, seed)
    if train_file or validation_file:
        if not (train_file and validation_file):
            raise UserError("own data needs both --train-file and --validation-file")
        if task or data_dir:
            raise UserError("give either --task/--data-dir or --train-file/--validation-file, not both")
        return load_files(train_file, validation_file, KINDS, text_columns, label_column, problem)
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
        raise UserError(f"--model {folder}: neither a fine-tuned sequence classifier nor a causal LM (architectures: "
                        f"{', '.join(config.architectures or ['none'])})")
    return kind.from_config(config, read_record(folder))
