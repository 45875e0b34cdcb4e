"""The chunkwise (flash-attention) backward of softmax attention on the C backend (docs/gradients.md): the
gradient form "chunkwise" of `Recurrence.vjp(..., backend="c")` for a program that reads the sequence.

Its generated module is the NumPy one's (linrec.numpy.adjoint_flash) with flash_attention and
flash_attention_backward imported from linrec.c.attention_grad, whose kernels take the same arguments and give
the same results: the attention and its backward — the O(T²·d) work — run in C; the chain rule around them
(the outputs into the readouts, ∂q, ∂K, ∂V into the inputs and params: O(T·d)) stays NumPy. It takes exactly
the programs the NumPy chunkwise backward takes (softmax(K·q)·V over the sequence, causal, windowed or not).
The recurrent and parallel backward of such a program are NumPy's only.

    why_not(compiled, form)   None when the C backend builds that backward of a program that reads the
                              sequence, else a Refusal
    emit(compiled)            the generated module's source
    load(compiled)            the module: backward(inputs, params, initial_state, dims, grad_outputs, …)
"""
from __future__ import annotations

from ..compiler import Compiled
from ..dsl.errors import LinrecError
from ..interface import Refusal
from ..numpy import BACKEND as NUMPY
from ..numpy import backend as numpy_backend
from ..numpy.adjoint import MODULES
from ..numpy.adjoint_flash import FlashAttentionEmitter
from . import attention_grad

FORM = "chunkwise"
KERNELS = frozenset({"flash_attention", "flash_attention_backward"})


def why_not(compiled: Compiled, form: str) -> Refusal | None:
    """Why the C backend does not build the `form` backward of a program that reads the sequence, or None."""
    numpy_refusal = NUMPY.gradient_why_not(compiled, form)
    if form == FORM or numpy_refusal:  # (the chunkwise module is NumPy's: what it takes, this takes)
        return numpy_refusal
    why = NUMPY.gradient_why_not(compiled, FORM)
    instead = "the chunkwise one (form='chunkwise')" if why is None else "none"
    return Refusal(f"the program reads the sequence (attention): of its backwards the C backend builds {instead}, "
                   f"not the {form} one", f"the NumPy backend runs the {form} backward (backend='numpy')")


class _CEmitter(FlashAttentionEmitter):
    """The NumPy flash backward's module, flash attention and its backward from the C kernels."""

    modules = {attention_grad.__name__: KERNELS} | MODULES  # (a helper comes from the first module listing it)


def emit(compiled: Compiled) -> str:
    refusal = why_not(compiled, FORM)
    if refusal:
        raise LinrecError(f"the C backend does not build the chunkwise backward of '{compiled.name}': {refusal}")
    return _CEmitter(compiled).render()


def load(compiled: Compiled):
    module = numpy_backend.module_from_source(emit(compiled), compiled, FORM, "C backward")
    module.form = FORM
    return module
