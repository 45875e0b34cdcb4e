"""One error type for every problem in a program, printed as FILE:LINE:COL with the line and a caret."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A place in the source: 1-based line and column of the first character, and where it ends."""

    line: int
    column: int
    end_line: int
    end_column: int


class LinrecError(Exception):
    """A user-facing error. `span` points at the offending source text when there is one."""

    kind = "error"  # the word after FILE:LINE:COL

    def __init__(self, message: str, span: Span | None = None, *, source: str | None = None,
                 filename: str | None = None):
        super().__init__(message)
        self.message = message
        self.span = span
        self.source = source
        self.filename = filename

    def located(self, source: str, filename: str) -> "LinrecError":
        """Attach the program text so the error can quote it (keeps information already attached)."""
        if self.source is None:
            self.source = source
        if self.filename is None:
            self.filename = filename
        return self

    def __str__(self) -> str:
        if self.span is None:
            prefix = f"{self.filename}: " if self.filename else ""
            return f"{prefix}{self.kind}: {self.message}"
        where = f"{self.filename or '<source>'}:{self.span.line}:{self.span.column}"
        text = f"{where}: {self.kind}: {self.message}"
        if self.source is not None:
            lines = self.source.splitlines()
            if 0 < self.span.line <= len(lines):
                line = lines[self.span.line - 1]
                width = (self.span.end_column - self.span.column
                         if self.span.end_line == self.span.line else len(line) - self.span.column + 1)
                # (the line's own tabs kept before the caret, so that it lines up under the line however
                # wide the terminal shows a tab)
                lead = "".join(c if c == "\t" else " " for c in line[:self.span.column - 1])
                caret = lead + "^" * max(1, width)
                text += f"\n  {line}\n  {caret}"
        return text


class LinrecWarning(LinrecError):
    """Something in a program that is legal but almost certainly not meant (a declared name never used).
    Printed like an error, with its place; never raised."""

    kind = "warning"


class RuntimeInputError(LinrecError):
    """Bad arrays at call time: missing, unknown, wrong shape or dtype."""
