"""The registry of task kinds: a `--problem` name to its `Task` class. A kind is one module and one
`register` call; the package's own kinds are registered when `xla_train.tasks` is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .base import Task

KINDS: dict[str, type[Task]] = {}  # --problem name: the kind's Task class
T = TypeVar("T", bound="type[Task]")


def register(kind: T) -> T:
    """Makes `kind` (a Task subclass with a `kind` name) a `--problem` choice; returns it, so it
    can decorate the class."""
    assert kind.kind, f"{kind.__name__} has no `kind` name"
    KINDS[kind.kind] = kind
    return kind


def problems() -> tuple[str, ...]:
    """The --problem choices, in registration order."""
    return tuple(KINDS)
