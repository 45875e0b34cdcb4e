"""The recurrent backward on the C backend (docs/gradients.md): the gradient form "recurrent" of
`Recurrence.vjp(..., backend="c")`.

Its generated module is the NumPy parallel and chunkwise backward's (linrec.numpy.adjoint_derived) with the
scans replaced: each state's per-token arrays of the decomposition — log-decay, rank-one corrections (u, w)
or value-side ones (a, b), writes (key, value), readout queries — go to C kernels (c.grad_scans picks them:
c.grad_kernels, c.grad_elementwise or c.grad_value_side) that run the forward token by token, keeping a
checkpoint every `chunk_size` tokens (default √T), and then the adjoint recurrence in reverse, segment by
segment, each segment's states recomputed from its checkpoint. Where the program fits the fused recurrent kernel
(c.grad_forward) the forward is that kernel's, keeping every state's checkpoints at the same tokens: one segment
for all the states (c.grad_scans.common_segment). A non-causal program's readouts are taken of
the final state by the module itself (as the NumPy one does); a program derived in stages runs each stage's such module, from the last
(linrec.stages.Staged: CBackend.staged_gradient_forms). The chain
rule from the outputs to the readouts and from the per-token arrays to the inputs and params
(compiler.adjoint.derive_decomposed) is the NumPy module's, O(T·d) work beside the kernels' O(T·dk·dv); its runs
of arithmetic on the tokens' rows go to C in one pass each (c.chain_rows).

    why_not(compiled)          None when the C backend builds the recurrent backward, else why not
    emit(compiled)             the generated backward module's source
    load(compiled)             the module: backward(inputs, params, initial_state, dims, grad_outputs, …)
"""
from __future__ import annotations

import dataclasses

from ..compiler import Compiled
from ..compiler.adjoint import constant_factor, why_no_gradient
from ..compiler.decay_factors import decay_factors
from ..compiler.key_factors import key_factors, spares_arrays
from ..dsl.errors import LinrecError
from ..numpy import backend as numpy_backend
from ..numpy.adjoint import MODULES
from ..numpy.adjoint_derived import DecomposedEmitter
from . import chain_rows, grad_forward, grad_scans, rows
from .normalized_rows import l2norm_argument

SCANS = frozenset({"adjoint_checkpoints", "adjoint_recurrent"})
SEGMENT = "common_segment"  # (the one segment of every state, where the forward is the fused kernel's)


def why_not(compiled: Compiled) -> str | None:
    """Why the C backend does not build the recurrent backward of the program (a sentence about the program),
    or None: it needs every state's update decomposed (a decay of its rows or of its elements, or of both axes,
    plus rank-one corrections on one side and writes), read through readouts q·S or as a vector state's
    value, in a program that does not read the sequence (and is not derived in stages: those run stage by
    stage, each stage a program of its own)."""
    reason = why_no_gradient(compiled, "recurrent")
    if reason:
        return reason
    d = compiled.decomposition
    if d.stages:  # (the decomposition is each stage's: linrec.stages.Staged runs the backward stage by stage)
        return ("it is derived in stages (a state reads another's values): its C backward runs stage by stage, "
                "through the backend as the registry wraps it (linrec.stages.Staged)")
    if d.sequence is not None:
        return "the program reads the sequence (attention): its C backward is not derived"
    why = d.why_not("chunkwise")
    if why:
        return f"the C backward runs the decomposition of the updates, and there is none: {why}"
    values = {r.state for r in d.readouts if r.is_value}
    for t in d.transitions:
        if t.elementwise and (t.corrections or t.value_corrections):
            return (f"'{t.state}' decays elementwise (`X*{t.state}`) with rank-one corrections: the C backward does "
                    f"not take it")
        if t.state in values and t.log_decay is None and not t.writes:
            return (f"an output reads vector state '{t.state}' as a value, and it neither decays nor is written (it "
                    f"stays its initial state): the C backward does not take it")
        if t.state in values and t.corrections:
            return (f"an output reads vector state '{t.state}' as a value, and its update has rank-one corrections: "
                    f"the C backward does not take it")
    return None


# The kernels multiply a readout's upstream gradient by its query's constant factor as they read it (`dk^(−1/2)`
# of `dk^(−1/2)·q`): q itself is the query array, and its gradient is the kernel's — two passes over [B, T, H, dk]
# less than scaling q before the kernel and its gradient after (GLA's backward alone at dk = dv = 64, T = 4096:
# 13.9 → 12.5 ms, timed alternately; docs/benchmarks.md). The chunk kernels do the same (c.grad_chunk).
def split_readout(compiled: Compiled, r):
    """(constant factor, rest) of readout r's query, where the kernels take them apart: a causal program's (a
    non-causal one's readouts are the module's own products with the final state), and not a vector state
    read as it is (no query)."""
    return constant_factor(r.query) if compiled.program.causal and not r.is_value else (None, r.query)


def factored_keys(compiled: Compiled, t):
    """The state's key-side vectors factored (compiler.key_factors) where the C kernels that run its backward as
    it is take them so, else None. Each vector is read once with the scalars of the slots that use it, and its
    gradient given summed, with the scalars': gated DeltaNet's u = −(e^g·(β·k̂)), w = k̂ and key = β·k̂ are then
    one array k̂ and two of scalars, and the chain rule makes no [B, T, H, dk] array of ∂u, ∂w and ∂key to reduce.
    Not for a state the kernels take in another frame or with signs (a decay of the value axis, an elementwise
    one, value-side corrections, a decay of either sign, a vector read as a value), nor for a decay whose
    gradient divides by its value (c.small_decays): those take each slot's own array."""
    reads_as_value = any(r.is_value for r in compiled.decomposition.readouts if r.state == t.state)
    if t.elementwise or t.signed or t.value_signed or t.value_log_decay is not None or t.value_corrections \
            or t.decays_as_values or reads_as_value:
        return None
    return key_factors(t)


class _CEmitter(DecomposedEmitter):
    """The recurrent backward's module on C: the decomposed backward's, with each state's scans the C kernels'
    (which take the NumPy scans' arguments and give their results)."""

    # (rows' helpers first; `scaled`: factored key-side slots, c.scaled_keys)
    modules = {rows.__name__: rows.HELPERS, chain_rows.__name__: chain_rows.HELPERS} | MODULES | \
        {grad_scans.__name__: SCANS | {SEGMENT, "scaled", "normalized", "factored_decay"}}
    scans = SCANS
    forward_scan, backward_scan = "adjoint_checkpoints", "adjoint_recurrent"  # (each state's kernel: c.grad_scans)
    backward_comment = "the transposed recurrence in C, from the last segment"
    no_decay = "None  # no decay"  # (the kernel skips it, rather than decay by exp(0))
    scan_grads_owned = True  # (adjoint_recurrent's gradients: arrays of their own, numpy.vjp.hand_over)
    # the forward may be the fused recurrent kernel's (load() gives the module its fused_forward: c.grad_forward),
    # which keeps the state before every `chunk` tokens in the layout all three kernels of c.grad_scans read
    # ([B, H, ⌈T/chunk⌉, K, V], each state in its declared layout: fused_fits)
    fused_forward = True

    def __init__(self, compiled: Compiled):
        super().__init__(compiled, "recurrent")

    def body(self) -> list[str]:  # (the chain rule's runs of arithmetic on the rows in one pass of C each)
        return chain_rows.fused_body(self, super().body())

    def readout_query(self, r):
        found = self._normalized_query(r)
        return split_readout(self.c, r)[1] if found is None else found[0]

    def readout_scale(self, r):
        return split_readout(self.c, r)[0]

    def fused_fits(self) -> bool:
        return super().fused_fits() and grad_forward.fits(self.c)

    # c.grad_kernels' backward takes the key-side vectors factored (factored_keys): with corrections (its stored
    # way) and without (its two passes: Mamba-2's key dt·B read as B and dt, its gradients ∂B and ∂dt given) where
    # that gains something — a scalar that varies by token, or writes that share a vector. A lone key times a
    # constant (Performer's exp(…)/√m) stays one array: factored, the kernel would give the constant's gradient for
    # nothing, and the chain rule would take the exp of the features a second time.
    def key_factors(self, t):
        factors = factored_keys(self.c, t)
        if factors is not None and self.normalizes(t):  # (an l2norm(x) base: x, normalized by the kernel)
            return dataclasses.replace(factors, bases=tuple(_unwrapped(b) for b in factors.bases))
        if factors is None or t.corrections or spares_arrays(factors, self.c.program.lets):
            return factors
        return None

    # The backward with corrections normalizes a factored vector or a query that is l2norm(x) itself
    # (c.normalized_rows): the module gives it x as `normalized(x, eps)`, and the derivation takes its gradient as
    # x's — no array of l2norm(x) made for the kernel, nor of its gradient after it.
    def normalizes(self, t) -> bool:
        """Whether the state's backward takes its l2norm(x) vectors and queries as x (the kernel with corrections,
        its key-side vectors factored, in a causal program: a non-causal one's module reads the queries itself)."""
        return bool(t.corrections) and self.c.program.causal and factored_keys(self.c, t) is not None

    def base_array(self, t, i, code):
        found = l2norm_argument(factored_keys(self.c, t).bases[i]) if self.normalizes(t) else None
        return self._normalized(code, found)

    def query_array(self, r, code):
        return self._normalized(code, self._normalized_query(r))

    def _normalized(self, code: str, found) -> str:
        if found is None:
            return code
        self.helpers.add("normalized")
        return f"normalized({code}, eps={found[1]!r})"

    def _normalized_query(self, r):
        """(x, eps) where readout r's query (its constant factor apart) is l2norm(x) and the kernel normalizes it."""
        if r.is_value or not self.normalizes(self.c.decomposition.transition(r.state)):
            return None
        return l2norm_argument(split_readout(self.c, r)[1])

    # An elementwise log-decay that is a token-free rate times a step per token (Mamba-1's A·diag(Δ)) goes to
    # c.grad_elementwise's kernels as its two factors (c.factored_decay), which make no [B, T, H, K, V] array.
    def decay_factors(self, t):
        return decay_factors(t, self.c.program.lets)

    def chunk_code(self) -> str:
        if not self.forward_fused():  # (each state's kernel picks its own segment)
            return "chunk_size  # tokens per checkpoint (None: about √T, linrec.c.grad_calls.default_segment)"
        # the fused forward keeps every state's checkpoints at the same tokens, so one segment for all the states,
        # by default_segment's rule for the largest (within its bound of a segment's states, as each is alone)
        self.helpers.add(SEGMENT)
        states = ", ".join(f"initial_state[\"{st.name}\"]" for st in self.p.states)
        return f"chunk_size or {SEGMENT}(tokens, [{states}])  # tokens per checkpoint, the same for every state"


def _unwrapped(base):
    """A factored base as the backward that normalizes takes it: x for l2norm(x)."""
    found = l2norm_argument(base)
    return base if found is None else found[0]


def emit(compiled: Compiled) -> str:
    """The recurrent backward's module on C (see why_not)."""
    why = why_not(compiled)
    if why:
        raise LinrecError(f"the C backend does not build the recurrent backward of '{compiled.name}': {why}")
    return _CEmitter(compiled).render()


def load(compiled: Compiled):
    module = numpy_backend.module_from_source(emit(compiled), compiled, "recurrent", "C backward")
    module.form = "recurrent"
    grad_forward.attach(module, compiled)
    return module
