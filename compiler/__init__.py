"""The linrec compiler: names and shapes, IR, the classification of transitions, and which forms exist.

    parse (dsl) → resolve (names, shapes → IR) → decompose (transitions, readouts, forms)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..dsl import LinrecError, parse
from ..dsl.errors import Span

from . import ir
from .decompose import FORMS, Decomposition, decompose
from .resolve import resolve
from .sequence import inline_sequence_lets
from .stages import Stage, derive


@dataclass(frozen=True)
class Compiled:
    """A checked program: its source, IR and decomposition."""

    source: str
    filename: str
    program: ir.Program
    decomposition: Decomposition
    warnings: tuple = field(default=(), compare=False)  # dsl.errors.LinrecWarning, located, in source order

    @property
    def name(self) -> str:
        return self.program.name


def compile_source(source: str, filename: str = "<source>") -> Compiled:
    """Parse, check and decompose. Raises LinrecError with FILE:LINE:COL, the line and a caret."""
    source = source.removeprefix("\ufeff")  # (the byte-order mark some editors write first is no character)
    try:
        program, warnings = resolve(parse(source, filename))
        program = inline_sequence_lets(program)
        return Compiled(source, filename, program, derive(program, decompose(program)),
                        tuple(w.located(source, filename) for w in warnings))
    except LinrecError as err:
        raise err.located(source, filename) from None


def stage_compiled(compiled: Compiled, stage: Stage) -> Compiled:
    """One stage of a program derived in stages (compiler.stages), as a program of its own for the backends
    (its errors located in the program's source)."""
    return Compiled(compiled.source, compiled.filename, stage.program, stage.decomposition)


def compile_file(path: str | Path) -> Compiled:
    path = Path(path)
    try:
        # (line ends as written, as compile_source takes a text: a bare CR is no line end to either — found by
        # probing, a file read with universal newlines took old Macs' line ends that the same text did not)
        with open(path, encoding="utf-8", newline="") as file:
            source = file.read()
    except OSError as err:
        raise LinrecError(f"cannot read the file: {err.strerror}", filename=str(path)) from None
    except UnicodeDecodeError as err:
        raise _not_utf8(path, err) from None
    return compile_source(source, str(path))


def _not_utf8(path: Path, err: UnicodeDecodeError) -> LinrecError:
    """The first byte that is not UTF-8, at its line and column (the line shown with � in its place)."""
    data = err.object
    line_start = data.rfind(b"\n", 0, err.start) + 1
    line = data.count(b"\n", 0, err.start) + 1
    column = len(data[line_start:err.start].decode("utf-8", errors="replace")) + 1
    return LinrecError(f"byte 0x{data[err.start]:02x} is not UTF-8 text (the file was saved in another encoding, "
                       f"such as Latin-1): save it as UTF-8", Span(line, column, line, column + 1),
                       source=data.decode("utf-8", errors="replace"), filename=str(path))


__all__ = ["Compiled", "FORMS", "LinrecError", "Stage", "compile_file", "compile_source", "ir", "stage_compiled"]
