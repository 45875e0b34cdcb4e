"""Whether the fused recurrent kernel may split the value axis across threads, and into how many parts.

The fused kernel's unit of work is one (batch row, head): a call with fewer of them than threads (B = H = 1
prefill, a single head) leaves threads idle. In a state update S_t = D_t·S_(t−1) + Σ u⊗(wᵀS_(t−1)) + Σ k⊗v,
column j of S_t depends on column j of S_(t−1) and element j of the values alone — a row decay D scales a
row, a correction's p = wᵀS contracts the key axis (rows) and gives one number per column, a write adds
k·v[j] — and a readout qᵀS contracts the key axis too. So when nothing else mixes the columns, a block of
value columns is a recurrence of its own: the kernel can run (batch row, head, value block) as its unit of
work, each block with the same operations in the same order as the whole head (no sum changes its order),
and the results are bit for bit the unsplit kernel's.

What mixes the columns, and refuses the split: a readout or a builtin over the value axis (a group norm or
l2 norm of the output, a sum over it, q·S read as a whole matrix), a decay of the value axis (the fused
kernel refuses those anyway), a parameter along it, the value axis's size as a number (dv^(−1/2) would read
the part's size), an output without the value axis (every part would write it). The kernel's own limits on
the split: causal programs, no stabilized exponential feature maps (their log-scales are one per head).

    value_axis(compiled)      the dimension the kernel may split, or None
    split_refusal(compiled)   None when it may, else why not (a sentence about the program)
    value_parts(...)          how many parts a call should use (1: no split)
"""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.analysis import walk

from .printer import _ELEMENTWISE
from .stabilize import Scales
from .support import fused_expressions, fused_refusal


def _columnwise(e: ir.Expr, dim: str) -> bool:
    """Element j of e (along `dim`) depends on element j of its operands along `dim` alone, and an e without
    `dim` on nothing that has it (no contraction or reduction over `dim`, no size of `dim`)."""
    if dim not in e.shape:
        return not any(dim in n.shape or (isinstance(n, ir.DimSize) and n.dim == dim) for n in walk(e))
    if e.shape != (dim,):
        return False
    if isinstance(e, (ir.InputRef, ir.ReadoutRef)):
        return True
    if isinstance(e, ir.Neg):
        return _columnwise(e.operand, dim)
    if isinstance(e, ir.Arith):  # (a scalar operand broadcasts)
        return _columnwise(e.left, dim) and _columnwise(e.right, dim)
    if isinstance(e, ir.Dot):  # only a scalar times a vector keeps the axis elementwise
        return (not e.left.shape or not e.right.shape) and _columnwise(e.left, dim) and _columnwise(e.right, dim)
    if isinstance(e, ir.Apply):
        return e.function in _ELEMENTWISE and all(_columnwise(a, dim) for a in e.args)
    return False  # a parameter along the axis, a kernel local, …


def _candidate(compiled: Compiled) -> tuple[str | None, str | None]:
    """(the value axis: the columns every matrix state shares, None), or (None, why there is none)."""
    matrices = [s for s in compiled.program.states if len(s.shape) == 2]
    if not matrices:
        return None, "no matrix state"
    columns = {s.shape[1] for s in matrices}
    if len(columns) > 1:
        return None, f"the matrix states have different value axes ({', '.join(sorted(columns))})"
    dim = columns.pop()
    if any(s.shape[0] == dim for s in matrices):
        return None, f"a matrix state has '{dim}' on both axes"
    return dim, None


def split_refusal(compiled: Compiled) -> str | None:
    """Why the fused kernel may not run blocks of the value axis as work of their own, or None."""
    why = fused_refusal(compiled)
    if why:
        return why
    p, d = compiled.program, compiled.decomposition
    if not p.causal:
        return "the program is not causal (its outputs read the final state in a second pass)"
    if Scales(compiled).groups:
        return "stabilized exponential feature maps carry one log-scale per head, not per part of the value axis"
    dim, why = _candidate(compiled)
    if dim is None:
        return why
    for s in p.states:
        if len(s.shape) == 1 and dim in s.shape:
            return f"vector state '{s.name}' runs along the value axis '{dim}'"
    for prm in p.params:
        if dim in prm.shape:
            return f"parameter '{prm.name}' runs along the value axis '{dim}'"
    for x in p.inputs:
        if len(x.shape) > 1:
            return f"input '{x.name}' has more than one axis"
    for o in p.outputs:
        if dim not in o.value.shape:
            return f"output '{o.name}' has no value axis '{dim}': every part would compute it"
    for r in d.readouts:
        if r.is_value and len(p.state(r.state).shape) == 2:
            return f"state '{r.state}' is read as a whole matrix"
    for place, printed, _ in fused_expressions(compiled):
        if not _columnwise(printed, dim):
            return f"{place} mixes the columns of the value axis '{dim}' (a reduction, a norm or its size)"
    return None


def value_axis(compiled: Compiled) -> str | None:
    """The dimension whose blocks the fused kernel may run apart (the value axis), or None."""
    if split_refusal(compiled) is not None:
        return None
    return _candidate(compiled)[0]


def value_parts(size: int, lanes: int, heads: int, threads: int, work: int, thread_work: int) -> int:
    """Parts of the value axis (of `size`) for a call of `heads` (batch row, head) pairs and `work`
    multiply-adds on up to `threads` threads: none (1) unless the threads the work pays for (one per
    `thread_work`, the kernel's LR_THREAD_WORK rule) outnumber the heads; then as few parts as give each of
    those threads a (head, part) — each part whole SIMD registers of `lanes` values, parts of equal size."""
    wanted = min(threads, work // thread_work)
    if heads <= 0 or wanted <= heads:
        return 1
    per_head = -(-wanted // heads)
    for parts in range(per_head, size // lanes + 1):
        if size % parts == 0 and (size // parts) % lanes == 0:
            return parts
    return 1
