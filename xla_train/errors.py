"""The exception type for mistakes a user can make, and for runs stopped on purpose."""


class UserError(Exception):
    """Raised for inputs the user controls. The CLI prints its message on one line and exits with
    `exit_code` (2 unless said otherwise; an empty message prints nothing)."""

    def __init__(self, message, exit_code=2):
        super().__init__(message, exit_code)  # both in args, so the error pickles across processes

    def __str__(self):
        return self.args[0]

    @property
    def exit_code(self):
        return self.args[1]

    def line(self):
        return f"xla-train: error: {self}"


class Stopped(UserError):
    """The run stopped early: a signal (exit 128 + signal number) or a non-finite loss (exit 3).
    Every replica raises it at the same step, after the checkpoint was saved."""

    def line(self):
        return f"xla-train: {self}"
