"""NumPy's floating-point warnings from a program's generated code, told at the program's own place.

A program that takes the log of a negative value gets NumPy's RuntimeWarning, "invalid value encountered in
log". NumPy names the Python line that called the ufunc: a line of the generated module, which the user never
wrote (`<linrec w.lin recurrent>:38`). Inside a call of Recurrence.run or .step, the warnings NumPy would show
are asked for through its "log" mode instead (numpy.errstate: context-local, so threads and other code are
left alone), and each is warned again at the builtin of the .lin file it comes from:

    w.lin:4: RuntimeWarning: invalid value encountered in log, at column 13: log(v)
      S = S + k⊗log(v)

The builtin is found from what called the ufunc: the generated code itself (np.log → the program's log(…);
a division → its '/'; a power → its '^'), or a runtime helper named after a builtin (softplus, l2norm, …:
its calls). Where several places of the program fit, the first is named and the others counted; where none
does (an overflow in a product, say), the warning stays at the generated line, as NumPy would give it.
Modes other than "warn" (ignore, raise, a caller's own errstate) are left as they are.
"""
from __future__ import annotations

import re
import sys
import warnings
from contextlib import contextmanager

import numpy as np

from .compiler import Compiled, ir
from .compiler.analysis import walk
from .compiler.constants import program_expressions
from .dsl.errors import source_lines

# NumPy's ufunc → which IR nodes of the program call it directly from generated code
_DIRECT = {
    "log": lambda e: isinstance(e, ir.Apply) and e.function == "log",
    "sqrt": lambda e: isinstance(e, ir.Apply) and e.function == "sqrt",
    "exp": lambda e: isinstance(e, ir.Apply) and e.function == "exp",
    "divide": lambda e: isinstance(e, ir.Arith) and e.op == "div",
    "power": lambda e: isinstance(e, ir.Arith) and e.op == "pow",
}
_MESSAGE = re.compile(r"(?:Warning: )?(.*) encountered in (\w+)")
_GENERATED = "<linrec "  # (the file name every generated module is compiled under: numpy.backend)
_RUNTIME = "linrec.numpy.runtime"  # (the helpers of builtins, each named after its builtin)


class _AtProgram:
    """NumPy's `call` object in "log" mode: write() gets "Warning: invalid value encountered in log"."""

    def __init__(self, compiled: Compiled, registry: dict):
        self.compiled = compiled
        self.registry = registry

    def write(self, message: str) -> None:
        found = _MESSAGE.search(message.strip())
        what, ufunc = (found.group(1), found.group(2)) if found else (message.strip(), "")
        caller = sys._getframe(1)  # (the Python code that called the ufunc: NumPy's C code has no frame)
        places = self._places(ufunc, caller)
        if places:
            first = places[0].span
            more = f" (and {len(places) - 1} more place(s) of the program)" if len(places) > 1 else ""
            warnings.warn_explicit(f"{what} encountered in {ufunc}, at column {first.column}: "
                                   f"{_excerpt(self.compiled.source, first)}{more}", RuntimeWarning,
                                   self.compiled.filename, first.line, registry=self.registry)
            return
        frame = caller
        while frame is not None and not frame.f_code.co_filename.startswith(_GENERATED):
            frame = frame.f_back
        frame = frame or caller
        warnings.warn_explicit(f"{what} encountered in {ufunc}", RuntimeWarning, frame.f_code.co_filename,
                               frame.f_lineno, registry=self.registry)

    def _places(self, ufunc: str, caller) -> list[ir.Expr]:
        """The program's nodes (with a place in its text) that this ufunc call comes from, in source order."""
        if caller.f_code.co_filename.startswith(_GENERATED):
            fits = _DIRECT.get(ufunc)
        elif caller.f_globals.get("__name__") == _RUNTIME:
            helper = caller.f_code.co_name
            fits = lambda e: isinstance(e, ir.Apply) and e.function == helper  # noqa: E731
        else:
            fits = None
        if fits is None:
            return []
        nodes = {(e.span.line, e.span.column): e for expr in program_expressions(self.compiled.program)
                 for e in walk(expr) if e.span is not None and fits(e)}
        return [nodes[k] for k in sorted(nodes)]


def _excerpt(source: str, span) -> str:
    """The text of a span (its first line when it spans several), from the lines as the parser counts them."""
    lines = [line.removesuffix("\r") for line in source_lines(source)]
    if not 0 < span.line <= len(lines):
        return ""
    line = lines[span.line - 1]
    end = span.end_column - 1 if span.end_line == span.line else len(line)
    return line[span.column - 1:end]


@contextmanager
def at_program(compiled: Compiled, registry: dict):
    """Within: NumPy's floating-point warnings (where its mode is "warn") told at the program's place.
    `registry`: where each warning is remembered, so that it shows once per place (as Python's own)."""
    modes = np.geterr()
    asked = {kind: "log" for kind, mode in modes.items() if mode == "warn"}
    if not asked:
        yield
        return
    with np.errstate(call=_AtProgram(compiled, registry), **asked):
        yield
