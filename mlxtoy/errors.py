"""User-facing errors: the CLI prints `error: <message>` and exits 2, with no traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a dataset). Message names the culprit."""
