"""The backward of softmax attention on the C backend, in each form: `Recurrence.vjp(..., backend="c")` for a
program that reads the sequence through softmax(K·q)·V (the programs of the NumPy chunkwise and parallel
backward: sequence.kernel_support).

    recurrent, chunkwise   the NumPy flash backward's module (linrec.numpy.adjoint_flash) with
                           flash_attention and flash_attention_backward from linrec.c.attention_grad: each
                           query over the keys it sees with its log-sum-exp kept (O(T) beside the inputs),
                           then per query and key the probability recomputed. The recurrent (KV-cache)
                           backward is this computation — the kernels already go query by query, blocks
                           only grouping the forward's online softmax — so the two forms share it.
    parallel               the same module around parallel_attention and parallel_attention_backward: the
                           C parallel forward (dense rows of scores), and the backward from the score matrix
                           (P from the scores, ∂S = P ⊙ (∂P − rowsum(P ⊙ ∂P))), keys of any length
                           (Linformer's E·seq(k): kproj rows). A program whose only use of the sequence is
                           lsh_attention (Reformer): the NumPy parallel backward's module with
                           lsh_attention_dense from linrec.c.attention and vjp_lsh_attention from
                           linrec.c.attention_grad (the buckets held fixed); its chunkwise backward the same
                           with lsh_attention_bucketed and vjp_lsh_attention_bucketed (each query's
                           candidates from its chunk of the sorted order and the previous one).

The attention and its backward — the O(T²·d) work — run in C; the chain rule around them (the outputs into
the readouts, ∂q, ∂K, ∂V into the inputs and params: O(T·d)) stays NumPy.

    why_not(compiled, form)   None when the C backend builds that backward of a program that reads the
                              sequence, else a Refusal
    emit(compiled, form)      the generated module's source
    load(compiled, form)      the module: backward(inputs, params, initial_state, dims, grad_outputs, …)
"""
from __future__ import annotations

from ..compiler import Compiled
from ..dsl.errors import LinrecError
from ..interface import Refusal
from ..numpy import BACKEND as NUMPY
from ..numpy import backend as numpy_backend
from ..numpy.adjoint import MODULES
from ..numpy.adjoint_attention import BucketedLshEmitter, ParallelAttentionEmitter
from ..numpy.adjoint_flash import FlashAttentionEmitter
from ..numpy.sequence import kernel_support
from . import attention, attention_grad

FORMS = ("recurrent", "parallel", "chunkwise")


def why_not(compiled: Compiled, form: str) -> Refusal | None:
    """Why the C backend does not build the `form` backward of a program that reads the sequence, or None."""
    numpy_refusal = NUMPY.gradient_why_not(compiled, form)
    if numpy_refusal or form not in FORMS:  # (the modules are NumPy's: what they do not take, these do not)
        return numpy_refusal
    plan = compiled.decomposition.sequence
    if plan.kind == "lsh":  # (lsh_attention's backward in C; the rest of the program NumPy's)
        reason = ("lsh_attention sits beside a softmax over the sequence, whose backward is NumPy's there"
                  if plan.softmax_readouts else None)
    else:
        reason = kernel_support(compiled)
    if reason:
        return Refusal(f"the program reads the sequence (attention): the C backend builds the backward of "
                       f"softmax(K·q)·V over the sequence, or of lsh_attention alone; here {reason}",
                       f"the NumPy backend runs the {form} backward (backend='numpy')")
    return None


class _FlashEmitter(FlashAttentionEmitter):
    """The NumPy flash backward's module, flash attention and its backward from the C kernels."""

    modules = {attention_grad.__name__: frozenset(FlashAttentionEmitter.kernels)} | MODULES  # (a helper comes
    # from the first module listing it)


class _ParallelEmitter(FlashAttentionEmitter):
    """The same module around the parallel forward and the backward from the score matrix."""

    kernels = ("parallel_attention", "parallel_attention_backward")
    modules = {attention_grad.__name__: frozenset(kernels)} | MODULES
    backward_comment = "# each readout's backward from its score matrix: P recomputed from the scores"

    def block_lines(self) -> list[str]:
        return []

    def attend(self, a: dict, readout: str) -> str:
        return (f"{readout} = parallel_attention({a['query']}, {a['keys']}, {a['values']}, causal, "
                f"{self.plan.window})")

    def attend_backward(self, index: int, a: dict) -> str:
        return (f"parallel_attention_backward({a['query']}, {a['keys']}, {a['values']}, "
                f"{self.d[('readout', str(index))]}, causal, {self.plan.window})")


class _LshEmitter(ParallelAttentionEmitter):
    """The NumPy parallel backward's module of a program that reads the sequence through lsh_attention: the
    forward's lsh_attention_dense and its vector–Jacobian product from the C kernels."""

    modules = {attention_grad.__name__: frozenset({"vjp_lsh_attention", "vjp_lsh_attention_bucketed"}),
               attention.__name__: frozenset({"lsh_attention_dense", "lsh_attention_bucketed"})} | MODULES


class _BucketedLshEmitter(_LshEmitter):
    """The chunkwise one: lsh_attention bucketed, forward and backward (NumPy's BucketedLshEmitter's names)."""

    lsh, lsh_vjp = BucketedLshEmitter.lsh, BucketedLshEmitter.lsh_vjp


def emit(compiled: Compiled, form: str) -> str:
    refusal = why_not(compiled, form)
    if refusal:
        raise LinrecError(f"the C backend does not build the {form} backward of '{compiled.name}': {refusal}")
    if compiled.decomposition.sequence.kind == "lsh":
        emitter = (_LshEmitter if form == "parallel" else _BucketedLshEmitter)(compiled)
    else:
        emitter = (_ParallelEmitter if form == "parallel" else _FlashEmitter)(compiled)
    emitter.form = form  # (the flash kernels serve the recurrent form too: the module says which it is)
    return emitter.render()


def load(compiled: Compiled, form: str):
    module = numpy_backend.module_from_source(emit(compiled, form), compiled, form, "C backward")
    module.form = form
    return module
