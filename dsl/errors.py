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


# the most characters of a source line an error quotes (a generated program may put thousands on one line)
EXCERPT = 160


def source_lines(source: str) -> list[str]:
    """A program's lines as the parser counts them: "\n" ends one. (str.splitlines() would also break at
    U+2028, \f, \v … inside a comment, and name or quote another line than the one meant — found by probing.)"""
    return source.split("\n")


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
            # (a CR left inside a line, shown as ␍: a terminal would return to the line's start)
            lines = [line.removesuffix("\r").replace("\r", "\u240d") for line in source_lines(self.source)]
            if 0 < self.span.line <= len(lines):
                line = lines[self.span.line - 1]
                start = self.span.column - 1
                width = (self.span.end_column - self.span.column
                         if self.span.end_line == self.span.line else len(line) - start)
                # a long line is shown around its place: EXCERPT characters, with … where it is cut
                first = 0 if len(line) <= EXCERPT else max(0, min(start - EXCERPT // 4, len(line) - EXCERPT))
                last = first + EXCERPT
                shown = ("…" if first else "") + line[first:last] + ("…" if last < len(line) else "")
                # (the line's own tabs kept before the caret, so that it lines up under the line however
                # wide the terminal shows a tab)
                lead = ("…" if first else "") + "".join(c if c == "\t" else " " for c in line[first:start])
                caret = lead.replace("…", " ") + "^" * max(1, min(width, last - start))
                text += f"\n  {shown}\n  {caret}"
        return text


class LinrecWarning(LinrecError):
    """Something in a program that is legal but almost certainly not meant (a declared name never used).
    Printed like an error, with its place; never raised."""

    kind = "warning"


class RuntimeInputError(LinrecError):
    """Bad arrays at call time: missing, unknown, wrong shape or dtype."""
