"""The C backend: SIMD C kernels generated for one dtype and one assignment of sizes, built through cffi and
cached on disk.

    backend.py     the backend's entry points (why_not, emit, load) and the recurrent form's runtime
    grad.py        the recurrent backward (Recurrence.vjp): its generated module, whose adjoint recurrence
                   runs in grad_kernels.py's kernels (c_grad.c.j2), grad_elementwise.py's (elementwise decays,
                   vector states read as values) or grad_value_side.py's (the value side), as grad_scans.py picks;
                   its forward, where the program fits, the fused kernel keeping each segment's state (grad_forward.py);
                   scaled_keys.py and normalized_rows.py: the key-side vectors and queries as its kernels take them
                   (factored, and normalized by the kernel with corrections)
    grad_chunk.py  the parallel and chunkwise backward: the same module with grad_chunk_kernels.py's kernels
                   (c_grad_chunk.c.j2), its forward the fused kernel keeping each chunk's state (grad_forward.py)
    rows.py        l2norm, rmsnorm, groupnorm and their vector–Jacobian products in one pass (c_rows.c.j2), for the
                   backward modules
    chain_rows.py  the recurrent backward's chain rule: runs of arithmetic on the tokens' rows in one pass
                   (c_chain_rows.c.j2), NumPy's statements where it does not take them
    fused.py       the fused recurrent kernel and decode step of a factorable recurrence (c_fused.c.j2),
                   planned by state_terms.py, block_region.py, step_region.py and passes.py as the records
                   of fused_plan.py; kernel_source.py: what it shares with statements.py
    statements.py  every other recurrence, its statements one by one (c_statements.c.j2)
    support.py     which of the two takes a program, from its structure (no code generated to find out)
    printer.py     per-token IR expressions as C; stabilize.py: exponential feature maps a token at a time
    step.py        the decode step from Python; buffers.py: arrays checked and aligned at the boundary
    scan.py, values.py   the parallel and chunkwise forms: scans over per-token arrays NumPy prepares
    attention.py   softmax attention and Reformer's LSH attention
    attention_backward.py   the backward of softmax attention in each form: the NumPy flash backward's module,
                   its attention and backward in attention_grad.py's kernels (c_attention_grad.c.j2)
    build.py, cache.py   cffi, the compiler's flags, the on-disk cache and `linrec cache`

The host side of the scans and of attention — the per-token arrays before a kernel runs — is the NumPy
backend's generated code, with its scan or attention calls pointed at these kernels.
"""
from __future__ import annotations

from ..compiler import Compiled
from ..compiler.adjoint import why_no_gradient
from ..interface import Refusal
from . import attention_backward, backend, grad, grad_chunk, staged_recurrent


class CBackend:
    """linrec.interface.Backend for C."""

    name = "c"
    compiles_sizes = True  # (emit takes dims: the kernels are compiled at the sizes they run at)
    # the backwards derived from the decomposition, which a program derived in stages has per stage: they run
    # stage by stage (linrec.stages.Staged), the recurrent one too
    staged_gradient_forms = ("recurrent", "parallel", "chunkwise")

    def why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        reason = backend.why_not(compiled, form)
        return None if reason is None else Refusal(reason, backend.NUMPY_RUNS_IT)

    def emit(self, compiled: Compiled, form: str, **options) -> str:
        return backend.emit(compiled, form, **options)

    def load(self, compiled: Compiled, form: str):
        return backend.load(compiled, form)

    def recurrent_kernel(self, compiled: Compiled) -> str:
        return backend.recurrent_kernel(compiled)

    def sequences_in_stages(self, compiled: Compiled) -> bool:
        """Whether the recurrent form's sequences run stage by stage, a fused kernel each, while its decode
        step runs the program as written (c.staged_recurrent)."""
        return staged_recurrent.sequence_stages(compiled) is not None

    # ---- gradients (docs/gradients.md): the adjoint recurrences in C (c.grad, c.grad_chunk) ----
    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if _reads_sequence(compiled):  # (attention: c.attention_backward)
            return attention_backward.why_not(compiled, form)
        reason = why_no_gradient(compiled, form)  # (none derived at all: no backend builds it)
        if reason:
            return Refusal(reason)
        numpy_runs_it = f"the NumPy backend runs the {form} backward (backend='numpy')"
        reason = grad.why_not(compiled) if form == "recurrent" else grad_chunk.why_not(compiled, form)
        return None if reason is None else Refusal(reason, numpy_runs_it)

    def emit_gradient(self, compiled: Compiled, form: str) -> str:
        if _reads_sequence(compiled):
            return attention_backward.emit(compiled, form)
        return grad.emit(compiled) if form == "recurrent" else grad_chunk.emit(compiled, form)

    def load_gradient(self, compiled: Compiled, form: str):
        if _reads_sequence(compiled):
            return attention_backward.load(compiled, form)
        return grad.load(compiled) if form == "recurrent" else grad_chunk.load(compiled, form)


def _reads_sequence(compiled: Compiled) -> bool:
    """Whether the program reads the sequence (attention): its backward is c.attention_backward's."""
    return compiled.decomposition.sequence is not None


BACKEND = CBackend()
