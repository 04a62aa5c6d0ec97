"""Errors a user can act on. Each renders as one line: where, what, and the fix."""

from __future__ import annotations


class SparkprovError(Exception):
    """Base for every error sparkprov reports to a user instead of a traceback."""

    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def line(self) -> str:
        return self.message + (f" (fix: {self.fix})" if self.fix else "")

    def __str__(self) -> str:
        return self.line()


class InputError(SparkprovError):
    """Bad input in a user file: inventory, playbook, recipe. Exit code 1, nothing touched."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 column: int | None = None, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.file = file
        self.lineno = line
        self.column = column

    def line(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.lineno:
                where += f":{self.lineno}"
                if self.column:
                    where += f":{self.column}"
            where += ": "
        return one_line(where + super().line())


def one_line(text: str) -> str:
    """Text with every non-printable character escaped (newlines, carriage returns, terminal
    escapes, Unicode line separators), so a message built from user values stays one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class HostKeyError(SparkprovError):
    """A host key that is unknown or changed: the connection is refused."""
