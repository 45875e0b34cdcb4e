"""The parallel and chunkwise forms in C: drop-in replacements for numpy_scan's parallel_scan and
chunkwise_scan (same arguments, same results), running a kernel generated from templates/c_scan.c.j2.

The generated NumPy module of a form computes every state's canonical per-token arrays (log-decay,
corrections (u, w), writes (κ, x), readout queries) and hands them to `parallel_scan` or `chunkwise_scan`;
here those run in C. A kernel is specialized per structure — decay (none, one per token, one per row), the
number of corrections and writes, the readouts (before or after the update), causal or not — per size
(dk and dv are compile-time constants) and per dtype (float32 or float64), built once through c_build
(cffi, cached on disk) and memoized here. One kernel holds both forms: lr_chunkwise (chunks of `chunk`
tokens, an argument: one kernel for every chunk size, its scratch sized per call) and lr_parallel (the whole
sequence as one segment). A vector state read as it is (a readout with no query) runs in c_values' kernels,
through the same scan functions; an elementwise decay in c_elementwise's, its corrections first through
these kernels with one column of the state per head (_elementwise_corrections).

Arrays are read in place: [B, T, H, n] with any strides whose last axis is contiguous (np.broadcast_to
views included: a per-head or constant value is never materialized per token); others are copied first.
(batch row, head) pairs run in parallel on OpenMP threads: `num_threads`, else $LINREC_NUM_THREADS, else
every core this process may use.

    from . import scan as c_scan
    outs, final = c_scan.chunkwise_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=64)
    module = c_scan.load(compiled, "chunkwise")     # the generated NumPy module, scanning in C
    text = c_scan.emit(compiled, "chunkwise")       # the C source of its kernels (default sizes)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compiler import Compiled
from ..compiler.stabilize import stabilized_states
from ..interface import Capabilities
from ..numpy import backend as numpy_backend
from ..numpy.derived import emit_derived
from ..dsl.errors import LinrecError, RuntimeInputError

from . import build as c_build
from . import elementwise as c_elementwise
from . import values as c_values
from .scan_kernels import FORMS, cached_kernel, call, chunk_of, operand
from .buffers import C_INT_MAX
from .build import CTYPE_BYTES, CTYPES
from ..version import VERSION
from ..templating import c_comment_text, comment_lines, environment

SUB_BLOCK = 16  # query panels and diagonal-decay sub-blocks (a multiple of every register width)
# The fast scores scale queries and keys by exp(±(b − b_L)) over a whole segment: allowed while the
# log-decays of the segment span at most this much (float: e^40 ≈ 2e17, far from overflow and from the
# subnormals); wider segments take the stable sub-block way.
SPAN_MAX = {"float": 40.0, "double": 300.0}
# a vector state read as it is whose update has rank-one corrections (the delta rule on a vector): its
# reads need the pseudo-values of the contraction kernels, which these kernels do not hand out
VALUE_DECAY_WITH_CORRECTIONS = ("a decay of the value axis beside a rank-one correction of the rows: its pseudo-values "
                                "solve a triangular system per value column")
VALUE_CORRECTIONS_UNDER_A_DECAY = ("a rank-one correction on the value side under a decay of the rows: its pseudo-keys "
                                   "solve a triangular system per row")
VALUES_WITH_CORRECTIONS = ("the C scan kernels read a vector state as it is (elementwise) only when its update "
                           "has no rank-one correction (delta-rule term)")
DECAYS = ("none", "token", "row")

# the generator's own files: a change to any of them rebuilds its cached kernels


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    decay: str                 # "none", "token" (one log-decay per token) or "row" (one per state row)
    corrections: int           # rank-one corrections (u, w)
    writes: int                # writes (κ, x)
    before: tuple[bool, ...]   # per readout: reads the state before the update
    causal: bool
    dk: int
    dv: int
    ctype: str                 # "float" or "double"
    vector_bytes: int          # SIMD register width the kernel is written for

    @property
    def lanes(self) -> int:
        return self.vector_bytes // CTYPE_BYTES[self.ctype]

    def describe(self) -> str:
        decay = {"none": "no decay", "token": "one log-decay per token", "row": "one log-decay per row"}
        reads = ", ".join("before" if b else "after" for b in self.before) or "none"
        return (f"{decay[self.decay]}; {self.corrections} correction(s); {self.writes} write(s); readouts: "
                f"{reads}; {'causal' if self.causal else 'non-causal'}; dk = {self.dk}, dv = {self.dv}, {self.ctype}")


# ---- the C source -------------------------------------------------------------------------------------
def tile_registers(vector_bytes: int) -> int:
    """Column registers of the widest GEMM tile (NB): 4 with AVX-512's 32 registers, else 2 (16). With 16, a
    6 × 2 tile keeps its 12 accumulators, its 2 operands and a broadcast in registers; a 4 × 3 tile's 12
    accumulators left its operands none, and GCC read them from memory at every multiply-add — 16 loads per 12
    multiply-adds against 8 — which made the chunkwise forms 5–10% slower on a Zen 2 core (gated DeltaNet at
    dk = dv = 128: the chunkwise forward 81 → 72 ms, its backward 161 → 149 ms)."""
    return 4 if vector_bytes >= 64 else 2


def tile_rows(vector_bytes: int) -> list[int]:
    """Rows of a GEMM register tile for nb = 1 … NB column registers: rows × nb accumulators, nb operands and
    a broadcast within the register file (32 vector registers with AVX-512, 16 with AVX2), at most SUB_BLOCK
    rows (a panel). A narrow tile takes more rows, so that each row of B is loaded once or twice per panel
    instead of once per 6 rows."""
    return [16, 12, 8, 6] if vector_bytes >= 64 else [8, 6]


def render(s: Structure, form: str | None = None) -> str:
    """The C source of one kernel."""
    lanes = s.lanes
    qprev = [1] * s.corrections + [1 if b else 0 for b in s.before]
    return environment(__package__).get_template("c_scan.c.j2").render(
        version=VERSION, title=f"the {form} form" if form else "the parallel and chunkwise forms",
        description=s.describe(), ctype=s.ctype, vector_bytes=s.vector_bytes,
        lanes=lanes, dk=s.dk, dv=s.dv, dvp=-(-s.dv // lanes) * lanes, sb=SUB_BLOCK,
        decay=DECAYS.index(s.decay), db=s.dk if s.decay == "row" else 1, corrections=s.corrections,
        writes=s.writes, readouts=len(s.before), causal=s.causal,
        nb=tile_registers(s.vector_bytes), tile_rows=tile_rows(s.vector_bytes), qprev=", ".join(map(str, qprev)),
        widths=", ".join(map(str, ([s.dk if s.decay == "row" else 1] if s.decay != "none" else [])
                             + [s.dk] * 2 * s.corrections + [s.dk, s.dv] * s.writes + [s.dk] * len(s.before))),
        n_inputs=(s.decay != "none") + 2 * s.corrections + 2 * s.writes + len(s.before))


def cdef(s: Structure) -> str:
    t = s.ctype
    args = f"(const {t} *s0, {t} *sT, {t} **in, const int64_t *st, {t} **out, int B, int ntok, int H, int nthreads, " \
           f"double span_max"
    return f"int lr_chunkwise{args}, int chunk);\nint lr_parallel{args});\n"


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure."""
    return cached_kernel(s, "scan", f"scan_{s.decay}_r{s.corrections}_w{s.writes}_{s.ctype}", lambda: render(s),
                         cdef(s))


def scan(form: str, s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None,
         num_threads=None, span_max=None, value_log_decay=None, value_corrections=()):
    """parallel_scan or chunkwise_scan (form "parallel" or "chunkwise"), with a thread count. span_max: the
    widest log-decay range of a segment for the fast scores (default SPAN_MAX; 0 forces the stable way).
    Readouts with no query (a vector state read as it is) run in c_values' kernels; a decay of the value axis
    or value-side corrections in two passes (_on_the_value_axis)."""
    if form not in FORMS:
        raise LinrecError(f"unknown scan form {form!r}; choose parallel or chunkwise")
    corrections = [tuple(c) for c in corrections]
    writes = [tuple(w) for w in writes]
    readouts = [(q, bool(before)) for q, before in readouts]
    if log_decay is not None and np.ndim(log_decay) == 5:  # a log-decay per element: c_elementwise's kernels
        if value_log_decay is not None:
            raise LinrecError("an elementwise decay beside a decay of the value axis has no derived form (write both "
                              "into the elementwise one)")
        writes = writes + _elementwise_corrections(form, s0, log_decay, corrections, writes, value_corrections,
                                                   chunk_size, num_threads, span_max)
        return c_elementwise.scan(form, s0, log_decay, writes, readouts, causal, chunk_size, num_threads)
    if value_log_decay is not None or value_corrections:
        return _on_the_value_axis(form, s0, log_decay, corrections, writes, readouts, causal, chunk_size, num_threads,
                                  span_max, value_log_decay, [tuple(c) for c in value_corrections])
    if any(q is None for q, _ in readouts):
        return _with_values(form, s0, log_decay, corrections, writes, readouts, causal, chunk_size, num_threads,
                            span_max)
    if not (readouts or writes or corrections):  # a state nothing reads or writes: it only decays
        return [], _only_decayed(s0, log_decay)
    per_token = [a for pair in corrections + writes for a in pair] + [q for q, _ in readouts]
    if log_decay is not None:
        per_token.append(log_decay)
    per_token = [np.asarray(a) for a in per_token]
    # the working dtype is the values' (a stabilized program's log-decay arrives in float64 whatever it is)
    values = per_token[:-1] if log_decay is not None else per_token
    dtype = np.dtype(np.float32) if np.result_type(*values) == np.float32 else np.dtype(np.float64)
    first = per_token[0]
    if first.ndim != 4:
        raise RuntimeInputError(f"per-token arrays should have shape [B, T, H, n], got {list(first.shape)}")
    batch, tokens, heads = first.shape[:3]
    s0 = np.asarray(s0)
    if s0.ndim != 4 or s0.shape[:2] != (batch, heads):
        raise RuntimeInputError(f"the initial state should have shape [B, H, dk, dv] = [{batch}, {heads}, …], got "
                                f"{list(s0.shape)}")
    dk, dv = int(s0.shape[2]), int(s0.shape[3])
    state = np.ascontiguousarray(s0, dtype=dtype)
    lead = (batch, tokens, heads)
    if log_decay is None:
        decay = "none"
    else:
        width = np.shape(log_decay)[-1]
        if width not in (1, dk):
            raise RuntimeInputError(f"the log-decay should have shape [B, T, H, 1 or dk = {dk}], got "
                                    f"{list(np.shape(log_decay))}")
        decay = "token" if width == 1 else "row"
    ops = []
    if decay != "none":
        ops.append(operand(log_decay, dtype, lead + (np.shape(log_decay)[-1],), "the log-decay"))
    for i, (u, w) in enumerate(corrections):
        ops += [operand(u, dtype, lead + (dk,), f"correction {i}: u"),
                operand(w, dtype, lead + (dk,), f"correction {i}: w")]
    for i, (kappa, x) in enumerate(writes):
        ops += [operand(kappa, dtype, lead + (dk,), f"write {i}: key"),
                operand(x, dtype, lead + (dv,), f"write {i}: value")]
    ops += [operand(q, dtype, lead + (dk,), f"readout {i}: query") for i, (q, _) in enumerate(readouts)]
    outs = [np.empty(lead + (dv,), dtype) for _ in readouts]
    if batch * heads == 0 or tokens == 0:
        return outs, state.copy()
    ctype = CTYPES[dtype]
    s = Structure(decay, len(corrections), len(writes), tuple(b for _, b in readouts), bool(causal), dk, dv,
                  ctype, c_build.vector_bytes())
    work = batch * heads * tokens * dk * max(dv, 16) * (len(readouts) + len(writes) + 2 * len(corrections) + 1)
    span = SPAN_MAX[ctype] if span_max is None else float(span_max)
    if form == "parallel":
        return outs, call(kernel(s), "lr_parallel", state, ops, outs, work, num_threads, span)
    return outs, call(kernel(s), "lr_chunkwise", state, ops, outs, work, num_threads, span,
                      chunk_of(chunk_size, tokens))


def _only_decayed(s0, log_decay) -> np.ndarray:
    """The final state of a state that only decays (no kernel to run): diag(exp(Σ_t log_decay_t))·S_0."""
    s0 = np.asarray(s0)
    if log_decay is None:
        return s0.copy()
    total = np.sum(np.asarray(log_decay, dtype=np.float64), axis=1)  # [B, H, 1 | dk]
    return (np.exp(total)[..., :, None] * s0).astype(s0.dtype)


def _with_values(form, s0, log_decay, corrections, writes, readouts, causal, chunk_size, num_threads, span_max):
    """scan() for a vector state some of whose readouts read it as it is (query None): those run in
    c_values' kernels, which also give the final state; the readouts q·S, if any, in this module's."""
    if corrections:
        raise LinrecError(VALUES_WITH_CORRECTIONS)
    values, final = c_values.scan(form, s0, log_decay, writes, [b for q, b in readouts if q is None], causal,
                                  chunk_size, num_threads)
    queried = [r for r in readouts if r[0] is not None]
    contractions = scan(form, s0, log_decay, corrections, writes, queried, causal, chunk_size, num_threads,
                        span_max)[0] if queried else []
    outs = iter(values), iter(contractions)
    return [next(outs[q is not None]) for q, _ in readouts], final


def _elementwise_corrections(form, s0, log_decay, corrections, writes, value_corrections, chunk_size, num_threads,
                             span_max) -> list:
    """The corrections of a state that decays element by element (log_decay [B, T, H, dk, dv]) as writes:
    [(u, p)] for the key-side ones, [(P, b)] for the value-side ones (never both: why_not refuses them).
    Column c of S is a state [dk, 1] whose rows decay by log_decay[..., c], and its pseudo-values
    p_t[c] = w_t·S_(t−1)[:, c] are readouts before the update of it: with the columns folded into the heads
    (H·dv heads of a state [dk, 1]) this module's kernels solve its triangular systems, one per column. A
    value-side correction (S·a)⊗b is the same on Sᵀ, one system per row."""
    if corrections and value_corrections:
        raise LinrecError("corrections on both sides of a state have no derived form")
    if value_corrections:
        keys = _by_columns(form, np.swapaxes(np.asarray(s0), -1, -2), np.swapaxes(np.asarray(log_decay), -1, -2),
                           [(b, a) for a, b in value_corrections], [(x, kappa) for kappa, x in writes], chunk_size,
                           num_threads, span_max)
        return [(key, b) for key, (_, b) in zip(keys, value_corrections)]
    if not corrections:
        return []
    pseudo = _by_columns(form, s0, log_decay, corrections, writes, chunk_size, num_threads, span_max)
    return [(u, p) for (u, _), p in zip(corrections, pseudo)]


def _by_columns(form, s0, log_decay, corrections, writes, chunk_size, num_threads, span_max) -> list:
    """The pseudo-values w_t·S_(t−1) [B, T, H, cols] of key-side corrections (u, w) [B, T, H, rows] of a state
    s0 [B, H, rows, cols] decaying per element by log_decay [B, T, H, rows, cols], one column per head."""
    s0, log_decay = np.asarray(s0), np.asarray(log_decay)
    batch, tokens, heads, rows, cols = log_decay.shape
    folded = (batch, tokens, heads * cols)

    def spread(vector):  # [B, T, H, rows], the same for every column, or one per column ([B, T, H, rows,
        #                  cols]: a correction on the decayed state): [B, T, H·cols, rows]
        vector = np.asarray(vector)
        if vector.ndim == 5:
            return np.moveaxis(vector, -1, -2).reshape(folded + (rows,))
        return np.broadcast_to(vector[..., None, :], (batch, tokens, heads, cols, rows)).reshape(folded + (rows,))

    decay = np.moveaxis(log_decay, -1, -2).reshape(folded + (rows,))
    state = np.swapaxes(s0, -1, -2).reshape((batch, heads * cols, rows, 1))
    pseudo, _ = scan(form, state, decay, [(spread(u), spread(w)) for u, w in corrections],
                     [(spread(kappa), np.asarray(x).reshape(folded + (1,))) for kappa, x in writes],
                     [(spread(w), True) for _, w in corrections], True, chunk_size, num_threads, span_max)
    return [p.reshape((batch, tokens, heads, cols)) for p in pseudo]


def _on_the_value_axis(form, s0, log_decay, corrections, writes, readouts, causal, chunk_size, num_threads, span_max,
                       value_log_decay, value_corrections):
    """scan() for a state whose columns decay (S·diag(exp(m))) or that has value-side corrections (a, b), in two
    passes over the compiled kernels. The pseudo-keys P_t = S_(t−1)·a_t are readouts before the update of Sᵀ,
    whose rows decay by m and which has the corrections (b, a) and the writes (x, κ): this module's kernels
    run it. With them every term is a write P⊗b or κ⊗x, and the state decays element by element by l_r + m_c
    (c_elementwise's kernels), or by rows only where the columns do not decay. What needs a triangular system
    per row or column — key-side corrections beside m, value-side ones beside a decay of the rows — is
    refused (why_not says so before any call)."""
    if corrections and value_corrections:
        raise LinrecError("corrections on both sides of a state have no derived form")
    if corrections and value_log_decay is not None:
        raise LinrecError(f"the C scan kernels do not take {VALUE_DECAY_WITH_CORRECTIONS}")
    if value_corrections and log_decay is not None:
        raise LinrecError(f"the C scan kernels do not take {VALUE_CORRECTIONS_UNDER_A_DECAY}")
    if value_corrections:
        transposed = np.swapaxes(np.asarray(s0), -1, -2)
        keys, _ = scan(form, transposed, value_log_decay, [(b, a) for a, b in value_corrections],
                       [(x, kappa) for kappa, x in writes], [(a, True) for a, _ in value_corrections], True, chunk_size,
                       num_threads, span_max)
        writes = writes + [(key, b) for key, (_, b) in zip(keys, value_corrections)]
    if value_log_decay is None:
        return scan(form, s0, log_decay, corrections, writes, readouts, causal, chunk_size, num_threads, span_max)
    if np.shape(value_log_decay)[-1] == 1 and log_decay is None:  # one per token commutes: the rows take it
        return scan(form, s0, value_log_decay, corrections, writes, readouts, causal, chunk_size, num_threads, span_max)
    dk, dv = np.shape(s0)[-2:]
    decay = np.asarray(value_log_decay)
    if log_decay is not None:  # both axes: one log-decay per element
        decay = decay[..., None, :] + np.asarray(log_decay)[..., :, None]
        decay = np.broadcast_to(decay, decay.shape[:3] + (dk, dv))
    else:  # the columns alone: the rows share them
        decay = np.broadcast_to(decay, decay.shape[:3] + (dv,))
    return c_elementwise.scan(form, s0, decay, writes, readouts, causal, chunk_size, num_threads)


def parallel_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None, value_log_decay=None,
                  value_corrections=()):
    """numpy_scan.parallel_scan in C: s0 [B, H, dk, dv]; log_decay None or [B, T, H, 1 | dk]; corrections
    [(u, w)], writes [(κ, x)], readouts [(query, before_update)], per token [B, T, H, *]; value_log_decay None
    or [B, T, H, 1 | dv]; value_corrections [(a, b)]. Returns ([readout [B, T, H, dv]], final state
    [B, H, dk, dv])."""
    return scan("parallel", s0, log_decay, corrections, writes, readouts, causal, chunk_size,
                value_log_decay=value_log_decay, value_corrections=value_corrections)


def chunkwise_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None, value_log_decay=None,
                   value_corrections=()):
    """numpy_scan.chunkwise_scan in C (chunks of chunk_size tokens, default 64); same arguments and results."""
    return scan("chunkwise", s0, log_decay, corrections, writes, readouts, causal, chunk_size,
                value_log_decay=value_log_decay, value_corrections=value_corrections)


def recurrent_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None, value_log_decay=None,
                   value_corrections=()):
    """numpy_scan.recurrent_scan in C: the state carried token by token (the chunkwise kernel with chunks of
    one token), for the stabilized programs whose recurrent form is emitted as a scan; same arguments (a
    value-side decay S·diag(e^m) included)."""
    return scan("chunkwise", s0, log_decay, corrections, writes, readouts, causal, 1,
                value_log_decay=value_log_decay, value_corrections=value_corrections)


# ---- programs: the generated source, and the module of a form ----------------------------------------
def structures(compiled: Compiled, dtype=np.float32, dims: dict[str, int] | None = None) -> list[tuple[str, Structure]]:
    """(state name, kernel structure) for every state of a program, at the given (else default) sizes: a
    c_values.Structure for a vector state read as it is, a c_elementwise.Structure for a state that decays
    element by element, a Structure for the readouts q·S of a vector state, if any, and for every other
    state."""
    p, d = compiled.program, compiled.decomposition
    if d.sequence is not None:
        raise LinrecError(f"'{compiled.name}' reads the whole sequence: it is not a scan over a recurrent state")
    sizes = {x.name: x.default for x in p.dims} | dict(dims or {})
    ctype = CTYPES[np.dtype(dtype)]
    stable = stabilized_states(compiled)  # carried as S·exp(−M): M_(t−1) − M_t is one more log-decay per token
    out = []
    for st in p.states:
        t = d.transition(st.name)
        if not t.factorable:
            why = "; ".join(t.reasons)
            raise LinrecError(f"state '{st.name}' of '{compiled.name}' has no parallel or chunkwise form: {why}")
        decay = "none" if t.log_decay is None else ("row" if t.log_decay.shape else "token")
        if decay == "none" and (st.name in stable or (t.value_decay is not None and not t.value_decay.shape)):
            decay = "token"  # (a scalar decay carried on the value axis commutes: the rows take it)
        reads = [r for r in d.readouts if r.state == st.name]
        before = tuple(r.before_update for r in reads if not r.is_value)
        values = tuple(r.before_update for r in reads if r.is_value)
        shape = tuple(reversed(st.shape)) if st.name in d.transposed else st.shape  # (carried as Sᵀ)
        dk = sizes[shape[0]]
        dv = sizes[shape[1]] if len(shape) == 2 else 1
        vc = len(t.value_corrections)
        if t.elementwise and (t.corrections or vc):  # one column (row) per head: _elementwise_corrections
            r, size = (len(t.corrections), dk) if t.corrections else (vc, dv)
            out.append((st.name, Structure("row", r, len(t.writes), (True,) * r, True, size, 1, ctype,
                                           c_build.vector_bytes())))
            vc += len(t.corrections)  # (their pseudo-values are writes of the elementwise kernel)
        elif vc:  # the pseudo-keys: readouts before the update of Sᵀ (_on_the_value_axis)
            rows = "none" if t.value_log_decay is None else "row" if t.value_log_decay.shape else "token"
            out.append((st.name, Structure(rows, vc, len(t.writes), (True,) * vc, True, dv, dk, ctype,
                                           c_build.vector_bytes())))
        if t.elementwise or (t.value_decay is not None and (t.value_decay.shape or t.decay is not None)):
            out.append((st.name, c_elementwise.Structure(len(t.writes) + vc, before, p.causal, dk, dv, ctype,
                                                         not t.elementwise and t.decay is None and st.name not in stable)))
            continue
        if values:  # c_values reads it as it is and gives its final state
            out.append((st.name, c_values.Structure(decay, len(t.writes), values, p.causal, dk, ctype)))
        if before or not values:
            out.append((st.name, Structure(decay, len(t.corrections), len(t.writes) + vc, before, p.causal, dk, dv,
                                           ctype, c_build.vector_bytes())))
    return out


def why_not(compiled: Compiled) -> str | None:
    """Why these kernels cannot run the program's scans, or None (see VALUES_WITH_CORRECTIONS)."""
    d = compiled.decomposition
    if d.stages:  # (each stage is a program of its own, whose scans these kernels run: linrec.stages)
        return "it is derived in stages: its scans are those of each stage's program"
    for state in dict.fromkeys(r.state for r in d.readouts if r.is_value):
        if d.transition(state).corrections:
            return f"vector state '{state}': {VALUES_WITH_CORRECTIONS}"
    for t in d.transitions:
        if t.elementwise and any(len(u.shape) == 2 for u, _ in t.corrections):
            return (f"state '{t.state}' has a rank-one correction under its elementwise decay (`X*(u⊗(w·S))`), whose "
                    f"write u⊙X[:, c]·p[c] is no outer product for the elementwise kernels")
        if t.value_corrections and t.decay is not None and not t.elementwise:
            return f"state '{t.state}' has {VALUE_CORRECTIONS_UNDER_A_DECAY}, which the C scan kernels do not take"
        if t.value_decay is not None and t.corrections:
            return f"state '{t.state}' has {VALUE_DECAY_WITH_CORRECTIONS}, which the C scan kernels do not take"
    return None


def emit(compiled: Compiled, form: str, dtype=np.float32, dims: dict[str, int] | None = None) -> str:
    """The C source of a program's parallel or chunkwise form: one kernel per state, each a translation unit of
    its own (the generated NumPy module of the form prepares the per-token arrays and calls them, see load)."""
    if form not in FORMS:
        raise LinrecError(f"the C scan kernels implement the parallel and chunkwise forms, not {form!r}")
    why = compiled.decomposition.why_not(form)
    if why:
        raise LinrecError(f"'{compiled.name}' has no {form} form: {why}")
    why = why_not(compiled)
    if why:
        raise LinrecError(f"the C backend does not build the {form} form of '{compiled.name}': {why}")
    parts = [f"/* linrec {VERSION}: the {form} form of '{c_comment_text(compiled.name)}' in C, generated. Do not edit.\n"
             f"   One kernel per state below, each a translation unit of its own. The NumPy module of the form (as\n"
             f"   linrec emit FILE --form {form} prints it, its scans these kernels) prepares the per-token arrays,\n"
             f"   calls them and reads the outputs.\n"
             f"   Source program:\n{comment_lines(compiled.source.strip(), '       ', c=True)} */"]
    for name, s in structures(compiled, dtype, dims):
        source = c_values.render(s, form) if isinstance(s, c_values.Structure) else \
            c_elementwise.render(s, form) if isinstance(s, c_elementwise.Structure) else render(s, form)
        parts.append(f"/* ==== state '{name}': {s.describe()} ==== */\n" + source)
    return "\n".join(parts)


def load(compiled: Compiled, form: str):
    """The generated NumPy module of the form (per-token arrays, outputs from the readouts) with its scan
    running in C: forward(inputs, params, initial_state, dims, chunk_size=None) and default_params."""
    if form not in FORMS:
        raise LinrecError(f"the C scan kernels implement the parallel and chunkwise forms, not {form!r}")
    why = compiled.decomposition.why_not(form)
    if why:
        raise LinrecError(f"'{compiled.name}' has no {form} form: {why}")
    refused = why_not(compiled)
    if refused:
        raise LinrecError(f"the C scan kernels do not run the {form} form of '{compiled.name}': {refused}")
    structures(compiled)  # a scan program with factorable states, or a clear error
    source = emit_derived(compiled, form, scan_module=__name__)
    module = numpy_backend.module_from_source(source, compiled, form, "C scan")
    module.form = form
    # NumPy prepares the arrays and checks them, as in its own forms; the kernels count in C ints
    module.capabilities = Capabilities(largest_count=C_INT_MAX)
    return module
