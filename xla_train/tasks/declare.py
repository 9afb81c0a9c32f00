"""How an option is declared, once: a dataclass field that is also a command-line flag. Training's
shared options (options.TrainOptions) and each kind's own (a kind's `Options` dataclass, the
recipe section named after the kind) are declared with `option`."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, choices: tuple[str, ...] | None = None, required: bool = False,
           section: str | None = None, repeat: bool = False) -> Any:
    """A dataclass field that is also a command-line option (`--name-with-dashes`); `section`:
    where a recipe holds a shared training option (one of options.SECTIONS; a kind's own options
    are in the kind's section); `repeat`: the flag may be given several times (its values joined
    with commas, as a recipe's list is)."""
    return field(default=default, metadata={"help": help, "choices": choices, "required": required,
                                            "section": section, "repeat": repeat})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")
