"""The one exception type for mistakes a user can make (bad path, bad option, bad data)."""


class UserError(Exception):
    """Raised for inputs the user controls. The CLI prints its message on one line and exits 2."""
