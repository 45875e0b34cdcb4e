"""The NumPy modules of recurrences: which emitter writes each form, and generated source as a module object.

    statements.py   the recurrent form, statement by statement as written (the definition)
    derived.py      the parallel and chunkwise forms, and the stabilized recurrent form, over the scans
    emitter.py      what every generated module shares: names, printers, prologue, the module template
"""
from __future__ import annotations

import linecache
import types

from ..compiler import Compiled
from ..compiler.stabilize import stabilized_states
from ..interface import DEFINITION
from .derived import emit_derived
from .statements import emit_statements


def emit_recurrent_form(compiled: Compiled) -> str:
    """Statement by statement; programs with exponential feature maps use the stabilized decomposition."""
    if stabilized_states(compiled):
        return emit_derived(compiled, "recurrent")
    return emit_statements(compiled)


def emit(compiled: Compiled, form: str) -> str:
    """The module of a form of a recurrence (programs that read the sequence are sequence.py's)."""
    if form == DEFINITION:
        return emit_statements(compiled)
    if form == "recurrent":
        return emit_recurrent_form(compiled)
    return emit_derived(compiled, form)


def module_from_source(source: str, compiled: Compiled, form: str, what: str = "") -> types.ModuleType:
    """Generated source as a module object (no files written); its source at `__source__`. `what` tells
    tracebacks which code it is (say, "C scan": the NumPy glue of C kernels)."""
    module = types.ModuleType(f"linrec_generated_{compiled.name}_{form}")
    module.__dict__["__source__"] = source
    where = f"<linrec {compiled.filename} {form}" + (f" ({what})>" if what else ">")
    # (its lines for tracebacks and warnings, which quote the line they name: a name in <…> is no file to read
    # them from; mtime None keeps them through linecache.checkcache)
    linecache.cache[where] = (len(source), None, source.splitlines(keepends=True), where)
    exec(compile(source, where, "exec"), module.__dict__)
    return module
