"""The one exception type that reaches users as a one-line message and exit code 2."""

from __future__ import annotations


class CompressError(Exception):
    """Bad input: a file, key or layer the user can fix. `hint` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message
