"""The NumPy backend: every form of every program as generated Python that reads like hand-written NumPy.

    backend.py    the generated modules of recurrences: which emitter writes each form; source as a module
    statements.py the recurrent form, the statements as written (the definition the other forms must match)
    derived.py    the derived forms: the decomposition as per-token arrays, handed to the scans of scan.py
    sequence.py   the generated modules of programs that read the sequence (softmax attention and relatives)
    adjoint.py    the recurrent backward: the adjoint of the statements (compiler.adjoint) as a reverse sweep
    adjoint_derived.py  the parallel and chunkwise backward, from the decomposition (adjoint_scan.py runs it)
    adjoint_attention.py  the parallel backward of softmax attention, over the masked score matrix (and the
                  chunkwise one of lsh_attention: the same module, lsh_attention bucketed)
    adjoint_flash.py  the chunkwise backward of softmax attention: flash attention's, by blocks
    emitter.py    what every generated module shares: names, printers, prologue, the template and its imports
    printer.py    IR expressions as NumPy code
    runtime.py, scan.py, attention.py, vjp.py, adjoint_scan.py   what the generated code calls: builtins, the scans of the
                  derived forms, masks and softmax, the builtins' vector–Jacobian products, the adjoint scans
                  (adjoint_elementwise.py: their elementwise-decay case; adjoint_frames.py: value-side
                  corrections and systems per column, by a change of frame; adjoint_arrays.py: their helpers)
"""
from __future__ import annotations

from ..compiler import Compiled
from ..compiler.adjoint import why_no_adjoint, why_no_gradient
from ..interface import DEFINITION, INTERPRETED, Capabilities, Refusal, no_such_form
from . import backend as recurrences
from . import sequence
from .adjoint import emit_backward
from .adjoint_attention import (emit_bucketed_lsh_backward, emit_parallel_attention_backward,
                                 why_no_parallel_attention_backward)
from .adjoint_derived import emit_decomposed_backward
from .adjoint_flash import emit_flash_attention_backward, why_no_flash_attention_backward


class NumpyBackend:
    """linrec.interface.Backend for NumPy: it builds every form the program has (and the definition)."""

    name = "numpy"
    compiles_sizes = False  # (its modules take the sizes when they run)

    def why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if form == DEFINITION:
            d = compiled.decomposition
            if "recurrent" in d.forms and d.sequence is None:
                return None
            return Refusal(f"'{compiled.name}' has no recurrence to run as written")
        return no_such_form(compiled, form)

    def emit(self, compiled: Compiled, form: str) -> str:
        if compiled.decomposition.sequence is not None:
            return sequence.emit(compiled, form)
        return recurrences.emit(compiled, form)

    def load(self, compiled: Compiled, form: str):
        module = recurrences.module_from_source(self.emit(compiled, form), compiled, form)
        module.form = form
        # the token loop and every check are Python's: nothing for the driver to skip; a program that
        # reads the sequence decodes by running its recurrent form over the KV cache (forward(first=…))
        module.capabilities = Capabilities(decodes_over_cache=compiled.decomposition.sequence is not None)
        return module

    def recurrent_kernel(self, compiled: Compiled) -> str:
        return INTERPRETED

    # ---- gradients (docs/gradients.md) ----
    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        reason = why_no_gradient(compiled, form)
        if reason and _attention_in_parallel(compiled, form) and form in compiled.decomposition.forms \
                and why_no_adjoint(compiled.program, compiled.decomposition.sequence) is None:
            # (attention differentiated, with that forward form: the compiler's reason is every other backend's)
            reason = why_no_parallel_attention_backward(compiled) if form == "parallel" or _lsh(compiled) else \
                why_no_flash_attention_backward(compiled)
        return None if reason is None else Refusal(reason)

    def emit_gradient(self, compiled: Compiled, form: str) -> str:
        if form == "recurrent":
            return emit_backward(compiled)
        if _attention_in_parallel(compiled, form):
            if form == "parallel":
                return emit_parallel_attention_backward(compiled)
            return emit_bucketed_lsh_backward(compiled) if _lsh(compiled) else emit_flash_attention_backward(compiled)
        return emit_decomposed_backward(compiled, form)

    def load_gradient(self, compiled: Compiled, form: str):
        module = recurrences.module_from_source(self.emit_gradient(compiled, form), compiled, form, "backward")
        module.form = form
        return module


def _lsh(compiled: Compiled) -> bool:
    """Whether the program reads the sequence through lsh_attention: its chunkwise forward and backward are the
    parallel ones with lsh_attention bucketed (adjoint_attention.BucketedLshEmitter)."""
    return compiled.decomposition.sequence.kind == "lsh"


def _attention_in_parallel(compiled: Compiled, form: str) -> bool:
    """The parallel or chunkwise backward of a program that reads the sequence: adjoint_attention's, or
    adjoint_flash's."""
    return form in ("parallel", "chunkwise") and compiled.decomposition.sequence is not None


BACKEND = NumpyBackend()
