"""The reward functions a GRPO run names (`--reward`, `--reward-weights`): found, then called as
TRL's GRPOTrainer calls them, their answers checked.

    --reward my_rewards.py:correct          a function in a file (a path, relative to where the command runs)
    --reward mypackage.rewards:correct      a function in an importable module
    --reward xla_train.rewards:think_format the package's own (xla_train/rewards.py); trl.rewards' too
    --reward runs/reward-model             a sequence-classification folder: its first logit of the
                                           prompt and completion (TRL's reward models)

A function is called `f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...,
log_extra=..., log_metric=...)`, TRL 1.16's keyword arguments (trainer/grpo_trainer.py,
`_calculate_rewards`): the prompts and completions of the batch (text, or chat turns for chat
prompts), each completion's token ids, every other column of the rows (a list each, one value per
completion), where training stands (`global_step`, `max_steps`, `epoch`), and two callbacks: extra
columns for the samples table and extra scalars for the log. It returns a number (or None) per
completion; an async function is awaited. Anything else stops the run with one line naming the
function and the row.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import UserError, first_line


@dataclass(frozen=True)
class Reward:
    name: str  # the function's name, as TRL names it (its __name__), in the metrics' keys
    spec: str  # as --reward gave it
    weight: float = 1.0
    label: str = ""  # how messages name it (default: --reward SPEC)
    owner: str = ""  # an --environment's get_reward: its class (the function's `owner`)

    def __str__(self) -> str:
        return self.label or f"--reward {self.spec}"

    @property
    def function(self) -> Callable[..., Any]:
        return functools.partial(find(self.spec), owner=self.owner) if self.owner else find(self.spec)


@dataclass
class TrainerState:
    """What TRL's `trainer_state` gives a reward function that shapes its reward by progress."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class Logged:
    """What reward functions logged through `log_extra` and `log_metric` in one call."""

    extra: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)


def rewards_of(specs: str | None, weights: str | None, required: bool = True) -> tuple[Reward, ...]:
    """The --reward functions (comma-separated, or repeated flags) with their --reward-weights
    (default 1 each), each found now: a mistake stops the run before any model loads. `required`:
    no other reward source (an --environment's get_reward) is there."""
    names = [s.strip() for s in (specs or "").split(",") if s.strip()]
    if not names and required:
        raise UserError("--problem grpo needs --reward: a function that scores completions (module:function or "
                        "path/file.py:function; xla_train.rewards has exact_match, number_match, think_format), "
                        "or an --environment with a get_reward method")
    if weights is None:
        values = [1.0] * len(names)
    else:
        try:
            values = [float(w) for w in str(weights).split(",")]
        except ValueError:
            raise UserError(f"--reward-weights must be numbers, comma-separated, not {weights!r}") from None
        if len(values) != len(names) or not all(math.isfinite(v) for v in values):
            raise UserError(f"--reward-weights gives {len(values)} weight(s) for {len(names)} --reward function(s); "
                            "give one finite number for each")
    out: list[Reward] = []
    for spec, weight in zip(names, values):
        name = getattr(find(spec), "__name__", spec.rpartition(":")[2])
        taken = [r.name for r in out]
        name = name if name not in taken else f"{name}_{len(taken) + 1}"  # its metrics' keys stay apart
        out.append(Reward(name, spec, weight))
    return tuple(out)


_FOUND: dict[str, Callable[..., Any]] = {}


def find(spec: str, flag: str = "--reward") -> Callable[..., Any]:
    """The function `spec` names: `module:function` (importable) or `path/file.py:function`, or
    (`--reward`) a reward model's folder; `flag` names the option in messages (--tools finds its
    functions here too)."""
    if spec in _FOUND:
        return _FOUND[spec]
    if flag == "--reward" and (Path(spec).expanduser() / "config.json").is_file():
        _FOUND[spec] = RewardModel.checked(spec)
        return _FOUND[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        what = "a class" if flag == "--environment" else "a function"
        raise UserError(f"{flag} {spec}: name {what} as module:{what[2:]} or path/file.py:{what[2:]}"
                        + (", or a reward model's folder (a sequence classifier)" if flag == "--reward" else ""))
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise UserError(f"{flag} {spec}: no such file {where}")
            module_name = f"xla_train_reward_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            assert loader is not None and loader.loader is not None
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # pickled by name in spawned workers' imports
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # the user's module: any error of its import
        raise UserError(f"{flag} {spec}: {where} cannot be imported ({type(e).__name__}: {first_line(e)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{flag} {spec}: {where} has no {'class' if flag == '--environment' else 'function'} "
                        f"{name!r}")
    _FOUND[spec] = function
    return function


class RewardModel:
    """A sequence classifier as a reward function, as TRL calls one: each prompt and completion
    (text joined, or chat turns rendered by the classifier's chat template) scored by its first
    logit. It runs on the host's CPU in each worker, loaded at its first call, in fp32."""

    def __init__(self, folder: str) -> None:
        self.folder, self.__name__ = folder, Path(folder).expanduser().resolve().name
        self._model: Any = None
        self._tokenizer: Any = None

    @classmethod
    def checked(cls, folder: str) -> RewardModel:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
            raise UserError(f"--reward {folder}: not a reward model (a sequence classifier); its architectures: "
                            f"{', '.join(config.architectures or ['none'])}")
        return cls(folder)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self._model is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.folder)
            self._model = AutoModelForSequenceClassification.from_pretrained(self.folder,
                                                                              dtype=torch.float32).eval()
        if isinstance(prompts[0], list):  # chat turns (TRL: apply_chat_template of prompt + completion)
            texts = [self._tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self._tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                 add_special_tokens=False)
        with torch.inference_mode():
            return self._model(**inputs).logits[:, 0].float().tolist()


def completions_of(prompts: list, texts: list[str]) -> list:
    """The completions as TRL hands them to reward functions: text, or for chat prompts a list
    holding the assistant's turn."""
    return texts if not isinstance(prompts[0], list) else [[{"role": "assistant", "content": t}] for t in texts]


def total(rewards: tuple[Reward, ...], values: Any) -> Any:
    """Each completion's reward: its functions' values ([completions, functions], NaN for none)
    weighted and summed, NaN skipped (TRL's nansum): a tensor of the values' precision (Python
    floats: float64)."""
    import torch

    values = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    return (values * torch.tensor([r.weight for r in rewards], dtype=values.dtype)).nansum(1)


def score(rewards: tuple[Reward, ...], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], state: TrainerState, rows: list[str]) -> tuple[list[list[float]], Logged]:
    """Every function's rewards of every completion ([completion][function], NaN for None), as
    TRL calls them; `rows`: where each completion's row is, for messages."""
    logged = Logged()

    def log_extra(column: str, values: list) -> None:
        logged.extra[column] = list(values)

    def log_metric(name: str, value: float) -> None:
        logged.metrics.setdefault(name, []).append(float(value))

    kwargs = {**columns, "trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}
    table = []
    for reward in rewards:
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            if inspect.isawaitable(values):
                values = asyncio.run(_awaited(values))
        except UserError:
            raise
        except Exception as e:  # the user's function: whatever it raises stops the run with one line
            raise UserError(f"{reward} raised {type(e).__name__}: {first_line(e)} (scoring {rows[0]}"
                            f"{' and others' if len(rows) > 1 else ''})") from None
        table.append(_checked(reward, values, len(completions), rows))
    return [list(r) for r in zip(*table)], logged


async def _awaited(values: Any) -> Any:
    return await values


def _checked(reward: Reward, values: Any, n: int, rows: list[str]) -> list[float]:
    try:
        values = list(values)
    except TypeError:
        raise UserError(f"{reward} returned {type(values).__name__}, not a list of numbers") from None
    if len(values) != n:
        raise UserError(f"{reward} returned {len(values)} rewards for {n} completions; it must return "
                        "one per completion")
    out = []
    for value, row in zip(values, rows):
        if value is None:
            out.append(math.nan)
            continue
        try:
            if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
                raise TypeError
            number = float(value)  # a Python or NumPy number, a one-element tensor
        except (TypeError, ValueError, RuntimeError):  # text, an array or a tensor of several values
            raise UserError(f"{reward} returned {str(value)[:60]!r} for {row}: a number or None is needed") from None
        if not math.isfinite(number):
            raise UserError(f"{reward} returned {number} for {row}: a finite number or None is needed")
        out.append(number)
    return out
