"""The one exception type that reaches users as a one-line message and exit code 2."""

from __future__ import annotations


# The commands that write an output (and keep a stage cache), for what an interruption tells them:
# compress.cli._interrupted, and compress/__main__.py before the CLI has loaded.
WRITING_COMMANDS = frozenset({"quantize", "prune", "distill"})


class CompressError(Exception):
    """Bad input: a file, key or layer the user can fix. `hint` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of a library's exception, for a one-line message (its type when empty)."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
