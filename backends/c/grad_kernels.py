"""The recurrent backward's kernels in C (templates/c_grad.c.j2): what the generated backward module of the C
backend (c.grad) calls for each state, where the NumPy parallel and chunkwise backward call
linrec.numpy.adjoint_scan's decay_scan and decay_scan_backward.

A state's update, decomposed (compiler.transitions), is a decay plus rank-one corrections plus rank-one writes,
and its readouts q·S; the arrays here are those of the decomposition, per token [B, T, H, n]:

    readouts, final, checkpoints = adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=corrections)
    grads = adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                              corrections=corrections)                          # a ScanGrads

s0 [B, H, K, V] (a vector state: one column, V = 1); log_decay None or [B, T, H, 1 | K]; corrections
[(u, w)] and writes [(key, value)] per token — in the backward with corrections (and the chunk kernels'), a
u, w or key may be factored, c.scaled_keys.Scaled (a vector several slots share times a scalar per token: its gradient a
ScaledGrad), and in the backward with corrections an array — a factored vector, a query — may be
c.normalized_rows.Normalized (l2norm(x), taken as x and normalized by the kernel: its gradient x's); queries
[(q, before_update)]. adjoint_checkpoints runs the
forward token by token, keeping the state before every `chunk` tokens (the checkpoints; None: about √T,
see c.grad_calls.default_segment); adjoint_recurrent
runs the adjoint recurrence in reverse, segment by segment from the last, the segment's states recomputed
from its checkpoint — or, without corrections, in two passes that keep no state (the update again from the
initial state for ∂q, then the adjoint in reverse; the decay's gradient from sums over the tokens), unless the
decays are strong (templates/c_grad.c.j2, "the backward without corrections"). The arithmetic is in the initial state's dtype (float32 or float64). A kernel is
specialized per structure (decay none, per token or per row; the numbers of corrections, writes and
readouts, and which readouts read the state before the update), per size (K and V compile-time constants)
and per dtype, built once through c_build (cffi, cached on disk) and memoized.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..dsl.errors import LinrecError
from ..templating import environment
from ..version import VERSION
from . import build as c_build
from ..numpy.adjoint_scan import ScanGrads
from .build import CTYPE_BYTES, CTYPES
from .kernel_source import Target, common_context
from .printer import c_literal
from . import grad_calls, normalized_rows, scaled_keys
from .scan_kernels import cached_kernel, operand

DECAYS = ("none", "token", "row")


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    decay: str                 # "none", "token" (one log-decay per token) or "row" (one per state row)
    corrections: int           # rank-one corrections (u, w)
    writes: int                # writes (key, value)
    before: tuple[bool, ...]   # per readout: reads the state before the update
    dk: int                    # rows of the state
    dv: int                    # columns (1: a vector state)
    ctype: str                 # "float" or "double"
    vector_bytes: int          # SIMD register width the kernel is written for
    # per readout: the constant factor of its query, by which the backward multiplies its upstream gradient (c.grad
    # passes `dk^(−1/2)` of `dk^(−1/2)·q` with q as the query array); () for none
    read_scales: tuple[float, ...] = ()
    # the key-side slots factored (c.scaled_keys; the backward with corrections, the chunk kernels): per slot
    # (u_0, w_0, …, κ_0, …), the slot whose array holds its vector, and whether it is that vector times a scalar
    # per token (the scalars' arrays follow the queries, in the slots' order); () for none factored
    sources: tuple[int, ...] = ()
    scaled: tuple[bool, ...] = ()
    # the rows the backward with corrections normalizes itself (c.normalized_rows): per per-token array, the buffer
    # of its normalized row (arrays of one vector share one), −1 for a row taken as it is; and each buffer's eps;
    # () for none
    normalized: tuple[int, ...] = ()
    norm_eps: tuple[float, ...] = ()

    @property
    def lanes(self) -> int:
        return self.vector_bytes // CTYPE_BYTES[self.ctype]

    @property
    def widths(self) -> list[int]:
        """Values per token of each per-token array, in the kernels' order: [log-decay,] u_0, w_0, …,
        key_0, value_0, …, q_0, …[, the factored slots' scalars, one each]"""
        decay = [] if self.decay == "none" else [self.dk if self.decay == "row" else 1]
        return decay + [self.dk] * 2 * self.corrections + [self.dk, self.dv] * self.writes + \
            [self.dk] * len(self.before) + [1] * sum(self.scaled)

    def describe(self) -> str:
        decay = {"none": "no decay", "token": "one log-decay per token", "row": "one log-decay per row"}
        reads = ", ".join("before" if b else "after" for b in self.before) or "none"
        scales = "; readouts' factors " + ", ".join(map(repr, self.read_scales)) if self.read_scales else ""
        slots = [f"{'uw'[i % 2]}_{i // 2}" for i in range(2 * self.corrections)] + \
            [f"κ_{j}" for j in range(self.writes)]
        factored = "; key slots: " + ", ".join(
            f"{name} " + ("a scalar × " if sc else "") + ("its own vector" if src == i else f"{slots[src]}'s vector")
            for i, (name, src, sc) in enumerate(zip(slots, self.sources, self.scaled))) if self.sources else ""
        norms = "; l2norm taken in the kernel of arrays " + ", ".join(
            str(a) for a, n in enumerate(self.normalized) if n >= 0) if self.normalized else ""
        return (f"{decay[self.decay]}; {self.corrections} correction(s); {self.writes} write(s); readouts: "
                f"{reads}{scales}{factored}{norms}; dk = {self.dk}, dv = {self.dv}, {self.ctype}")

    def slot_input(self, i: int) -> int:
        """The index among the per-token arrays of key-side slot i (u_0, w_0, …, κ_0, …; I_SLOT in the
        template)."""
        first = 0 if self.decay == "none" else 1
        return first + i if i < 2 * self.corrections else first + 2 * self.corrections + 2 * (i - 2 * self.corrections)

    @property
    def factors(self) -> list[float]:
        """Each readout's factor (1 where none is given)."""
        return list(self.read_scales) or [1.0] * len(self.before)


# The forward runs one block of the state's columns at a time over the whole sequence, the block's rows at
# most this many bytes: within the core's L1 (48 KB here) beside the token's rows.
FORWARD_BLOCK_BYTES = 32 << 10
# Tokens of a block of the forward without corrections (TB in templates/c_grad.c.j2): its tiles of rows stay in
# registers across them.
FORWARD_BLOCK_TOKENS = 16


def forward_registers(s: Structure) -> int:
    """Registers of a row in one column block of the forward: the most, dividing the row's, whose DK rows
    stay within FORWARD_BLOCK_BYTES (at least one)."""
    registers = -(-s.dv // s.lanes)
    fits = [n for n in range(1, registers + 1)
            if registers % n == 0 and s.dk * n * s.vector_bytes <= FORWARD_BLOCK_BYTES]
    return max(fits, default=1)


def tile_rows(s: Structure) -> int:
    """Rows of a tile of the forward without corrections (templates/c_grad.c.j2, TR): with a row's registers
    of the column block, 16 registers of the state held across the block of tokens."""
    return max(1, 16 // forward_registers(s))


class TileBounds(NamedTuple):
    """Bounds on the tiles of the backward without corrections (None: no bound of that kind)."""

    row_registers: int | None   # registers of keys in a row of a tile
    registers: int              # registers of a tile, rows × registers of a row
    rows: int | None            # rows of a tile


def _backward_tile(s: Structure) -> TileBounds:
    """The bounds on the tiles of the backward without corrections, which hold TRB rows × KCOLS registers of the
    state (pass 1) or the adjoint (pass 2) across a block of tokens, beside KCOLS accumulators of ∂q or ∂κ and
    each row's operands and ∂x accumulator. With AVX-512's 32 vector registers a tile takes 16 of them; with 16
    (AVX2 and narrower) at most 4 of a row, 8 in all and 4 rows, which leave the accumulators and operands
    theirs: tiles of 2 rows × 8 spilled them, and GLA's backward (a Zen 2 core, dk = dv = 64 and 128) took 7% and
    4% longer."""
    return TileBounds(None, 16, None) if s.vector_bytes >= 64 else TileBounds(4, 8, 4)


def backward_registers(s: Structure) -> int:
    """Registers of a row in one key block of the backward without corrections: its state and adjoint carried
    transposed, [DV × DKP] (templates/c_grad.c.j2, KCOLS) — forward_registers with the axes' roles swapped, within
    _backward_tile's registers of a row."""
    registers = -(-s.dk // s.lanes)
    most = _backward_tile(s).row_registers or registers
    fits = [n for n in range(1, min(registers, most) + 1)
            if registers % n == 0 and s.dv * n * s.vector_bytes <= FORWARD_BLOCK_BYTES]
    return max(fits, default=1)


def backward_tile_rows(s: Structure) -> int:
    """Rows of a tile of the backward's passes (templates/c_grad.c.j2, TRB): as many as _backward_tile's
    registers of a tile hold, within its rows."""
    bounds = _backward_tile(s)
    rows = max(1, bounds.registers // backward_registers(s))
    return rows if bounds.rows is None else min(rows, bounds.rows)


def tile_sum_levels(s: Structure) -> int | None:
    """The levels of the tree of ∂x's sums (row_sum_tree) that pass 2 of the backward without corrections takes
    in its tiles (templates/c_grad.c.j2, LR_TILE_LEVELS): log2 of the tile's rows, where those rows are a power
    of two that divides both the lanes (a group of lanes' rows is whole tiles) and the value size (every tile
    whole); else None, and the tree runs whole after the tiles."""
    rows, lanes = backward_tile_rows(s), s.lanes
    if rows & (rows - 1) or lanes % rows or s.dv % rows:
        return None
    return rows.bit_length() - 1


def row_sum_tree(lanes: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The shuffles that sum the lanes of `lanes` registers at once (templates/c_grad.c.j2, lr_row_sums): at
    each level, pairs of registers (a, b) become lo(a, b) + hi(a, b), every block of 2h lanes of the result
    holding h partial sums of a's row, then h of b's, for h = lanes/2, lanes/4, …, 1 — (lo masks, hi masks,
    one per level) for __builtin_shuffle(a, b, mask) (an index ≥ lanes picks b's lane − lanes); and, per
    lane i of the result, the register to give row i in (the levels interleave the registers' bits in
    reverse order)."""
    lo, hi = [], []
    h = lanes // 2
    while h >= 1:
        lo.append([(0 if i % (2 * h) < h else lanes) + i // (2 * h) * 2 * h + i % h for i in range(lanes)])
        hi.append([m + h for m in lo[-1]])
        h //= 2
    regs = [[r] * lanes for r in range(lanes)]  # which register's row each lane sums, level by level
    for mask in lo:
        regs = [[(regs[2 * i] + regs[2 * i + 1])[m] for m in mask] for i in range(len(regs) // 2)]
    return lo, hi, regs[0]


def transpose_swaps(lanes: int) -> tuple[list[list[int]], list[list[int]]]:
    """The shuffles of a transpose of `lanes` registers of `lanes` lanes in place (templates/c_grad.c.j2,
    lr_transpose): at level s = 1, 2, 4, …, registers a and a + s (a without the bit s) swap their off-diagonal
    blocks of s lanes — (the new a's masks, the new (a + s)'s, one per level) for __builtin_shuffle(r[a],
    r[a + s], mask)."""
    lo, hi = [], []
    s = 1
    while s < lanes:
        lo.append([b if not b & s else lanes + b - s for b in range(lanes)])
        hi.append([b + s if not b & s else lanes + b for b in range(lanes)])
        s *= 2
    return lo, hi


def render(s: Structure) -> str:
    """The C source of one kernel."""
    lanes = s.lanes
    tree_lo, tree_hi, tree_slot = row_sum_tree(lanes)
    swap_lo, swap_hi = transpose_swaps(lanes)
    return environment(__package__).get_template("c_grad.c.j2").render(
        # (c_common.h.j2: LR_BLOCK is the tiled forward's block of tokens; the inputs are not range-checked)
        **common_context(Target(s.ctype, s.vector_bytes)), block_tokens=FORWARD_BLOCK_TOKENS, checks_inputs=False,
        fcols=forward_registers(s), fcols_bytes=FORWARD_BLOCK_BYTES,
        tile_rows=tile_rows(s), kcols=backward_registers(s), tile_rows_backward=backward_tile_rows(s),
        tile_levels=tile_sum_levels(s), tree_lo=tree_lo, tree_hi=tree_hi, tree_slot=tree_slot,
        tree_order=[tree_slot.index(i) for i in range(lanes)], swap_lo=swap_lo, swap_hi=swap_hi,
        version=VERSION, description=s.describe(),
        dk=s.dk, dv=s.dv, dvp=-(-s.dv // lanes) * lanes, dkp=-(-s.dk // lanes) * lanes, decay=DECAYS.index(s.decay),
        db=s.dk if s.decay == "row" else 1, corrections=s.corrections, writes=s.writes, readouts=len(s.before),
        before=", ".join("1" if b else "0" for b in s.before), widths=", ".join(map(str, s.widths)),
        read_scales=", ".join(map(repr, s.factors)), split_terms=s.decay != "none" and not any(s.before),
        n_inputs=len(s.widths), **factoring(s), **normalizing(s))


def normalizing(s: Structure) -> dict:
    """c_grad.c.j2's variables of the rows it normalizes (NNORM, NORM_OF, NORM_SRC: each buffer's first array,
    NORM_EPS)."""
    if s.normalized and len(s.normalized) != len(s.widths):
        raise ValueError(f"normalized: {len(s.normalized)} entries for {len(s.widths)} per-token arrays")
    sources = [s.normalized.index(n) for n in range(len(s.norm_eps))]
    return dict(n_norms=len(s.norm_eps), norm_of=", ".join(map(str, s.normalized)),
                norm_src=", ".join(map(str, sources)), norm_eps=", ".join(c_literal(e, s.ctype) for e in s.norm_eps))


def factoring(s: Structure) -> dict:
    """The templates' variables of the factored key-side slots (c_key_slots.h.j2, in c_grad.c.j2 and
    c_grad_chunk.c.j2): FACTORED, NSCALE, and per slot its SOURCE and SCALE_OF (the index of its scalar's array
    among the scalars', −1: none); and the groups of the written slots (write_groups)."""
    scale_of = [sum(s.scaled[:i]) if sc else -1 for i, sc in enumerate(s.scaled)]
    return dict(factored=bool(s.sources), n_scales=sum(s.scaled), sources=", ".join(map(str, s.sources)),
                scale_of=", ".join(map(str, scale_of)), **write_groups(s))


def write_groups(s: Structure) -> dict:
    """The templates' variables of the groups of written slots (the backward kernels' key-side arrays): the
    corrections' u_r and the writes' κ_j that share a vector — factored slots of one SOURCE; unfactored, each slot
    alone — are one group, whose vector the update and the adjoint take once (NGROUP; per key-side slot u_0,
    w_0, …, κ_0, … its GROUP_OF, −1 for a w_r; per group its first slot, GROUP_SLOT; per slot the group whose
    vector is its array, GROUP_OF_ARRAY, −1 for none)."""
    nkey = 2 * s.corrections + s.writes
    sources = s.sources or tuple(range(nkey))
    written = [2 * r for r in range(s.corrections)] + [2 * s.corrections + j for j in range(s.writes)]
    group_of, group_slot, by_source = [-1] * nkey, [], {}
    for i in written:
        if sources[i] not in by_source:
            by_source[sources[i]] = len(group_slot)
            group_slot.append(i)
        group_of[i] = by_source[sources[i]]
    group_of_array = [by_source.get(a, -1) for a in range(nkey)]
    text = lambda values, empty: ", ".join(map(str, values)) or empty  # noqa: E731
    return dict(n_groups=len(group_slot), group_of=text(group_of, "-1"), group_slot=text(group_slot, "0"),
                group_of_array=text(group_of_array, "-1"))


def cdef(s: Structure) -> str:
    return grad_calls.cdef("lr_grad", s.ctype)


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure."""
    label = f"grad_{s.decay}_r{s.corrections}_w{s.writes}_{s.ctype}"
    return cached_kernel(s, "grad", label, lambda: render(s), cdef(s))


def _prepare(s0, log_decay, corrections, writes, queries, read_scales=()) -> grad_calls.Call:
    slots = scaled_keys.key_slots(corrections, writes)
    factored = [x for x in slots if isinstance(x, scaled_keys.Scaled)]
    sources = tuple(scaled_keys.owners(slots)) if factored else ()
    scaled = tuple(isinstance(x, scaled_keys.Scaled) and x.scale is not None for x in slots) if factored else ()
    corrections, writes = scaled_keys.rebuilt(corrections, writes, [
        x.base if isinstance(x, scaled_keys.Scaled) else x for x in slots])  # (a shared vector: one array object)
    arrays = ([] if log_decay is None else [log_decay]) + [a for pair in list(corrections) + list(writes)
                                                           for a in pair] + [q for q, _ in queries] + \
        [x.scale for x in factored if x.scale is not None]
    normalized, norm_eps = normalized_rows.buffers(arrays)  # (the rows the kernel normalizes; it reads them raw)
    if normalized and not corrections:
        raise LinrecError("rows to normalize in the kernel without corrections: only the backward with corrections "
                          "takes them (c.grad_scans gives the others l2norm's arrays)")
    raw = normalized_rows.raw
    arrays = [raw(a) for a in arrays]
    per_token = [raw(a) for pair in list(corrections) + list(writes) for a in pair] + [raw(q) for q, _ in queries] + \
        ([] if log_decay is None else [log_decay])
    state, lead = grad_calls.lead_and_state(s0, per_token)
    dtype = state.dtype
    dk, dv = int(state.shape[2]), int(state.shape[3])
    decay = "none" if log_decay is None else ("token" if np.shape(log_decay)[-1] == 1 else "row")
    scales = tuple(float(f) for f in read_scales) if any(f != 1.0 for f in read_scales) else ()
    s = Structure(decay, len(corrections), len(writes), tuple(bool(b) for _, b in queries), dk, dv,
                  CTYPES[dtype], c_build.vector_bytes(), scales, sources, scaled, normalized, norm_eps)
    made: dict[int, np.ndarray] = {}  # (a vector several slots share: checked and converted once)
    for a, n in zip(arrays, s.widths):
        if id(a) not in made:
            made[id(a)] = operand(a, dtype, lead + (n,), "a per-token array of the recurrent backward")
    ops = [made[id(a)] for a in arrays]
    # (a slot whose vector another slot holds gets no gradient of its own: it goes with that one's)
    unwritten = frozenset(s.slot_input(i) for i, src in enumerate(sources) if src != i)
    return grad_calls.Call(s, state, ops, lead, passes=1 + 2 * s.corrections + s.writes + len(s.before),
                           unwritten=unwritten)


def adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(), num_threads=None):
    """The forward of the recurrent backward: ([readout [B, T, H, V]], final state [B, H, K, V], the state
    before every chunk [B, H, ⌈T/chunk⌉, K, V]) — linrec.numpy.adjoint_scan.decay_scan's arguments and
    results (log_decay None: no decay), the states kept every `chunk` tokens (None: grad_calls.default_segment)."""
    if normalized_rows.any_normalized(corrections, writes, queries):  # (and l2norm's arrays, made once)
        corrections, writes, queries = normalized_rows.plain(corrections, writes, queries)
    if scaled_keys.any_scaled(corrections, writes):  # (the forward takes each slot's own array)
        corrections, writes = scaled_keys.expand(corrections, writes)
    c = _prepare(s0, log_decay, corrections, writes, queries)
    return grad_calls.forward(c, kernel(c.structure), "lr_grad_forward", [c.structure.dv] * len(queries), chunk,
                              num_threads)


def adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                      corrections=(), num_threads=None, read_scales=()) -> ScanGrads:
    """The backward, as linrec.numpy.adjoint_scan.decay_scan_backward's (ScanGrads; log_decay None where the
    state does not decay), from the readouts' gradients [B, T, H, V] and the final state's (None: zero);
    checkpoints and chunk as adjoint_checkpoints gave and took them. read_scales: per readout, a constant factor
    of its query (the readout is factor·(q·S); () for none), which the kernel applies to its upstream gradient —
    the queries' gradients are then with respect to q."""
    c = _prepare(s0, log_decay, corrections, writes, queries, read_scales)
    outs, d_s0 = grad_calls.backward(c, kernel(c.structure), "lr_grad_backward", [c.structure.dv] * len(queries),
                                     checkpoints, chunk, grad_readouts, grad_final, num_threads)
    return call_grads(c.structure, outs, d_s0, log_decay, corrections, writes, queries)


def call_grads(s: Structure, outs: list, d_s0, log_decay, corrections, writes, queries) -> ScanGrads:
    """A backward kernel's outputs as ScanGrads (scan_grads), the factored slots' (c.scaled_keys.ScaledGrad:
    the vector's with the slot that holds it, the scalar's from the arrays after the queries') where the
    structure has them."""
    n_scales = sum(s.scaled)
    grads = scan_grads(outs[:len(outs) - n_scales], d_s0, log_decay, corrections, writes, queries)
    if not s.sources:
        return grads
    slots = scaled_keys.key_slots(corrections, writes)
    given = scaled_keys.key_slots(grads.corrections, grads.writes)
    scale_grads = iter(outs[len(outs) - n_scales:])
    folded = [scaled_keys.ScaledGrad(d if src == i else None, next(scale_grads) if sc else None)
              if isinstance(x, scaled_keys.Scaled) else d
              for i, (x, d, src, sc) in enumerate(zip(slots, given, s.sources, s.scaled))]
    d_corrections, d_writes = scaled_keys.rebuilt(grads.corrections, grads.writes, folded)
    return grads._replace(corrections=d_corrections, writes=d_writes)


def scan_grads(outs: list, d_s0, log_decay, corrections, writes, queries) -> ScanGrads:
    """A backward kernel's outputs, in its order ([log-decay,] corrections' (u, w), writes' (key, value),
    queries), and the initial state's gradient, as ScanGrads."""
    it = iter(outs)
    d_log_decay = None if log_decay is None else next(it)
    d_corrections = [(next(it), next(it)) for _ in corrections]
    d_writes = [(next(it), next(it)) for _ in writes]
    d_queries = [next(it) for _ in queries]
    return ScanGrads(d_log_decay, d_writes, d_queries, d_s0, d_corrections, None)
