"""The parallel and chunkwise backward on the C backend (docs/gradients.md, The C backward): the NumPy
decomposed backward's module (linrec.numpy.adjoint_derived) with each state's two scans in C — the C
chunkwise forward keeping the state before each chunk, and the adjoint recurrence chunk by chunk from the
last (c.grad_chunk_kernels, templates/c_grad_chunk.c.j2) — on the state as it is, or on the state in a
change of frame that gives it the kernels' structure (c.grad_chunk_scans: an elementwise decay, a decay of the
value axis, value-side corrections, a vector state read as a value). The parallel backward is one chunk of
the whole sequence. It takes the programs the recurrent C backward takes (c.grad.why_not), and the chain rule
around the scans stays NumPy.

    why_not(compiled, form)    None when the C backend builds the form's backward, else why not
    emit(compiled, form)       the generated backward module's source
    load(compiled, form)       the module: backward(inputs, params, initial_state, dims, grad_outputs, …)
"""
from __future__ import annotations

from ..compiler import Compiled
from ..compiler.adjoint import why_no_gradient
from ..dsl.errors import LinrecError
from ..numpy import backend as numpy_backend
from ..numpy.adjoint import MODULES
from ..numpy.adjoint_derived import DecomposedEmitter
from . import chain_rows, grad, grad_chunk_scans, grad_forward, rows

FORMS = ("parallel", "chunkwise")
SCANS = frozenset({"chunk_checkpoints", "adjoint_chunkwise"})


def why_not(compiled: Compiled, form: str) -> str | None:
    """Why the C backend does not build the form's backward (a sentence about the program), or None."""
    if form not in FORMS:
        return f"the C chunk kernels build the parallel and chunkwise backward, not the {form} one"
    # (every structure the recurrent C backward takes, the chunk kernels take as it is or in another frame:
    # c.grad_chunk_scans)
    return why_no_gradient(compiled, form) or grad.why_not(compiled)


class _ChunkEmitter(DecomposedEmitter):
    """The decomposed backward's module, its scans the C kernels' (c.grad_chunk_scans, which take the NumPy
    scans' arguments and give their results)."""

    modules = {rows.__name__: rows.HELPERS, chain_rows.__name__: chain_rows.HELPERS} | MODULES | \
        {grad_chunk_scans.__name__: SCANS | {"scaled"}}  # (rows: first)
    scans = SCANS
    forward_scan, backward_scan = "chunk_checkpoints", "adjoint_chunkwise"
    backward_comment = "the transposed recurrence in C, from the last chunk"
    no_decay = "None  # no decay"  # (the kernels skip it, rather than decay by exp(0))
    scan_grads_owned = True  # (adjoint_chunkwise's gradients: arrays of their own, grad_calls.gradient_arrays)
    fused_forward = True  # (load() gives the module its fused_forward: c.grad_forward)

    def fused_fits(self) -> bool:
        return super().fused_fits() and grad_forward.fits(self.c)

    def body(self) -> list[str]:  # (the chain rule's runs of arithmetic on the rows in one pass of C each)
        return chain_rows.fused_body(self, super().body())

    def key_factors(self, t):  # (the chunk kernels take them factored: c.grad.factored_keys)
        return grad.factored_keys(self.c, t)

    def readout_query(self, r):  # (the chunk kernels apply a query's constant factor: c.grad.split_readout)
        return grad.split_readout(self.c, r)[1]

    def readout_scale(self, r):
        return grad.split_readout(self.c, r)[0]


def emit(compiled: Compiled, form: str) -> str:
    why = why_not(compiled, form)
    if why:
        raise LinrecError(f"the C backend does not build the {form} backward of '{compiled.name}': {why}")
    return _ChunkEmitter(compiled, form).render()


def load(compiled: Compiled, form: str):
    module = numpy_backend.module_from_source(emit(compiled, form), compiled, form, "C backward")
    module.form = form
    grad_forward.attach(module, compiled)
    return module
