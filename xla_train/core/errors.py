"""How a run ends early on purpose: a user's mistake (`UserError`) or a stop (`Stopped`).

Both are `ExitError`s: the CLI prints their message on one line and exits with `exit_code`,
never a traceback. They carry everything in `args`, so they pickle across worker processes.
"""

import os
from pathlib import Path

from ..io.files import atomic_write

_shown = None  # how the command line shows the core's parameter names (`show_parameters`); None: as written


def show_parameters(shown):
    """Every ExitError's line from now on passes through `shown`: the command line shows the
    backticked parameter names of the core's messages (`num_processes`) as its flags. A line
    printed anywhere in the process (a pod's failure told by another host too) reads the same."""
    global _shown
    _shown = shown


def _say(message):
    return _shown(message) if _shown else message


class ExitError(Exception):
    """Ends the run with one line on stderr and `exit_code` (an empty message prints nothing)."""

    def __init__(self, message, exit_code=2):
        super().__init__(message, exit_code)  # both in args, so the error pickles across processes

    def __str__(self):
        return self.args[0]

    @property
    def exit_code(self):
        return self.args[1]

    def line(self):
        return f"xla-train: error: {_say(str(self))}"


class UserError(ExitError):
    """Raised for inputs the user controls (exit 2 unless said otherwise)."""


class Stopped(ExitError):
    """The run stopped early: a signal (exit 128 + signal number) or a non-finite loss (exit 3).
    Every replica raises it at the same step, after the checkpoint was saved. Not a mistake of
    the user's: a preemption is part of a run's life."""

    def line(self):
        return f"xla-train: {_say(str(self))}"


def check_choice(option, value, allowed):
    """An option's value is one of `allowed`, else one line naming them (None: not given)."""
    if value is not None and value not in allowed:
        raise UserError(f"{option} must be one of {', '.join(allowed)}, not {value!r}")


def check_number(option, value, allowed, what):
    """An option's number is finite and `allowed(value)`, else one line saying it must be `what`
    (None: not given)."""
    import math

    if value is not None and not (math.isfinite(value) and allowed(value)):
        raise UserError(f"{option} must be {what}, not {value}")


def first_line(e):
    """An exception's message in one line (its type's name if it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def describe(e):
    """An unexpected exception in one line: its type and its message's first line."""
    return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__


def tell(folder, rank, error):
    """A worker's last word, left in its launcher's `folder`: the launcher prints it, because a
    worker may be stopped by the launcher (when another one failed) before it could print."""
    # whole or not at all: the worker may be killed while it writes; the launcher reads it at
    # once from the page cache, so no fsync
    atomic_write(Path(folder, f"rank-{rank:05d}"), f"{error.exit_code} {error}", fsync=False)


def told(folder):
    """The failure the lowest-ranked worker told in `folder`, as a UserError; None if none did."""
    for name in sorted(n for n in os.listdir(folder) if n.startswith("rank-")):
        code, _, line = Path(folder, name).read_text(encoding="utf-8").partition(" ")
        return UserError(line, int(code))
    return None
