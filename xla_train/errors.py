"""How a run ends early on purpose: a user's mistake (`UserError`) or a stop (`Stopped`).

Both are `ExitError`s: the CLI prints their message on one line and exits with `exit_code`,
never a traceback. They carry everything in `args`, so they pickle across worker processes.
"""


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
        return f"xla-train: error: {self}"


class UserError(ExitError):
    """Raised for inputs the user controls (exit 2 unless said otherwise)."""


class Stopped(ExitError):
    """The run stopped early: a signal (exit 128 + signal number) or a non-finite loss (exit 3).
    Every replica raises it at the same step, after the checkpoint was saved. Not a mistake of
    the user's: a preemption is part of a run's life."""

    def line(self):
        return f"xla-train: {self}"
