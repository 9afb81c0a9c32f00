"""What is trained: a task object per kind of job, and the data sources that make one.

A kind is a `Task` subclass (base.py: the protocol and its parts) registered in `KINDS` (kinds.py) under its `--problem`
name: `classification` and `regression` (sequence.py), `causal-lm` (causal_lm.py). A source gives a
sequence task its splits, with columns `text1` [`text2`] and `label`: GLUE's nine tasks (glue.py) or
a user's own files (files.py); a causal-lm task reads own rows in one of its three forms.

    --task mrpc                      the bundled MRPC copy (the default)
    --task sst2 --data-dir DIR       a GLUE task's folder in GLUE's own layout (train.tsv, dev.tsv)
    --task rte --data-dir hub        load_dataset("glue", "rte"), where the hub is reachable
    --train-file F --validation-file F [--text-columns A[,B]] [--label-column L]   own files
    --problem causal-lm --train-file F [--validation-file F]   messages, prompt/completion or text rows
"""

from typing import Any

from ..core.errors import UserError, check_choice
from .base import MINIMISED, RECORD, PredictSettings, Source, Task, load_metric, read_config, read_record, scores
from .causal_lm import CausalLM
from .dpo import DPO
from .files import FILE_FORMATS, read_source, read_table, text_columns_of
from .glue import BUNDLED_MRPC, GLUE, TASKS, glue_columns, load_mrpc, read_glue_tsv
from .grpo import GRPO
from .kinds import KINDS, problems, register
from .sequence import Classification, Regression, SequenceTask, load_glue_folder, load_glue_hub

PROBLEMS = problems()  # the package's own kinds (`problems()` adds any registered since)

__all__ = ["BUNDLED_MRPC", "FILE_FORMATS", "GLUE", "KINDS", "MINIMISED", "PROBLEMS", "RECORD", "TASKS",
           "DPO", "GRPO", "CausalLM", "Classification", "PredictSettings", "Regression", "Source", "Task",
           "check_choices",
           "from_folder", "glue_columns", "kind_of", "load_glue_folder", "load_glue_hub", "load_metric", "load_mrpc",
           "load_task", "problems", "read_glue_tsv", "read_source", "read_table", "register", "scores",
           "text_columns_of"]


def kind_of(problem=None):
    """The kind --problem names; without it, the sequence kinds (GLUE or own files, whose labels
    choose classification or regression)."""
    return KINDS[problem] if problem else SequenceTask


def load_task(source: Source) -> tuple[Task, Any]:
    """The `Task` for the data options `source` gives (see the module docstring: training's options
    give theirs, `TrainOptions.source`) and its splits."""
    check_choices(source.task, source.problem)
    return kind_of(source.problem).load(source)


def check_choices(task=None, problem=None):
    """--task names a GLUE task and --problem a kind of task (None: not given)."""
    check_choice("--task", task, TASKS)
    check_choice("--problem", problem, problems())


def from_folder(folder):
    """The task a fine-tuned model folder was trained for: the kind that claims its config, with
    what the folder's record says (labels, text columns, length)."""
    config = read_config(folder)
    saved = read_record(folder)
    kind = KINDS.get(saved.get("problem"))  # the kind that trained it, where it is registered
    if kind is None or not kind.claims(config):
        kind = next((k for k in KINDS.values() if k.claims(config)), None)
    if kind is None:
        raise UserError(f"--model {folder}: neither a fine-tuned sequence classifier nor a causal LM (architectures: "
                        f"{', '.join(config.architectures or ['none'])})")
    return kind.from_config(config, saved)
