"""The decode step's body for one (batch row, head) (fused_plan.StepRegion): one token on the caller's state
rows — the token's values, then per state the corrections' p = wᵀS, the right vectors and one fused pass
(rows of S at their true stride dv, with a column tail when dv is not a whole number of registers), then
the outputs."""
from __future__ import annotations

from ..compiler import ir

from .fused_plan import NextHead, ScaleGroup, StepMatrixPass, StepRegion, StepVectorPass, VectorCorrection, VectorRead
from .kernel_source import KernelSource
from .passes import (REGISTER_BUDGET, Decay, MatrixOperands, ReadoutOperands, correction_arrays, correction_pass,
                     divisor_at_most, row_pass)
from .printer import CPrinter
from .stabilize import Scales
from .state_terms import StateTerms, state_terms


def step_region(kernel: KernelSource, scales: Scales, groups: list[ScaleGroup]) -> StepRegion:
    k = kernel
    pr = CPrinter(k.target.ctype, k.dims, k.ref)
    terms = [state_terms(k, scales, st, updates=True, readouts=True) for st in k.program.states]
    # declare everything this region prints, so that shared subexpressions are computed once
    for t in terms:
        pr.expect(*[e for e in (t.decay,) if e is not None], *[c.w for c in t.corrections], *[g.x for g in t.groups],
                  *[g.y for g in t.groups], *t.queries())
    pr.expect(*scales.exponents())
    outputs, scaled = scales.outputs(k.derivation.outputs, block=False)
    pr.expect(*[e for _, e in outputs])
    # 1. the token's state-free values (first the scales of stabilized states: the rest reads them)
    scale_lines = scales.token_lines(pr, scaled, block=False)
    codes = [_codes(pr, t) for t in terms]
    values = scale_lines + pr.take_token()
    # 2. per state: corrections, right vectors, the fused pass
    readouts, passes, next_heads = [], [], []
    for st, t, (decay, ws, xs, queries) in zip(k.program.states, terms, codes):
        state_pass, next_head = _state(k, pr, st, t, decay, ws, xs, queries, readouts)
        passes.append(state_pass)
        next_heads += [next_head] if next_head else []
    # 3. the outputs, from the readouts
    output_lines = []
    for name, e in outputs:
        target = k.cout(name)
        body = pr.fill(e, k.row(target)) if e.shape else [f"{target}[tok] = {pr.scalar(e)};"]
        output_lines += pr.take_token() + body
    rows = k.rows_mentioned(values, passes, output_lines)
    return StepRegion(
        tuple(pr.take_head()), tuple(groups), "".join(x.declaration + "\n" for x in k.input_arrays() if x.row in rows),
        tuple(values), tuple(readouts), tuple(passes),
        tuple(o.declaration for o in k.output_arrays() if not o.scalar) if output_lines else (), tuple(output_lines),
        tuple(next_heads))


def _codes(pr: CPrinter, t: StateTerms):
    """C of a state's decay (Decay, or None), corrections' w, left vectors and readouts' queries (None for a
    read of the state as it is)."""
    d = t.decay
    decay = None if d is None else Decay(pr.array(d) if d.shape else pr.scalar(d), bool(d.shape))
    return (decay, [pr.array(c.w) for c in t.corrections], [pr.array(g.x) for g in t.groups],
            [None if r.is_value else pr.array(r.query) for r in t.readouts])


def _state(k: KernelSource, pr: CPrinter, st: ir.State, t: StateTerms, decay: Decay | None, ws, xs, queries,
           readouts: list[str]):
    """The pass of state st (and its readouts' declarations, into `readouts`), and the pointer to the next
    head's rows when the pass prefetches them."""
    c = k.cstate(st.name)
    matrix = len(st.shape) == 2
    rows = k.dims[st.shape[0]]
    cols = k.dims[st.shape[1]] if matrix else 1
    cols_padded = k.padded(cols) if matrix else 1
    right_lines, rights = [], []
    for i, g in enumerate(t.groups):
        y = g.y
        name = k.local("y", c, i)
        if matrix and isinstance(y, (ir.InputRef, ir.ParamRef)):
            rights.append(pr.array(y))  # a value used as it is: read it in place
            continue
        if matrix:
            body = pr.fill(y, name, cols)
            pad = [f"for (int i = {cols}; i < {cols_padded}; ++i) {name}[i] = 0;"] if cols_padded > cols else []
            right_lines += pr.take_token() + [f"T {name}[{cols_padded}] __attribute__((aligned(64)));"] + body + pad
        else:
            code = pr.scalar(y)
            right_lines += pr.take_token() + [f"const T {name} = {code};"]
        rights.append(name)
    before, after = [], []
    for r, q in zip(t.readouts, queries):
        (before if r.before_update else after).append(ReadoutOperands(q, f"r{r.index}"))
        if not matrix and not r.is_value:
            readouts.append(f"T r{r.index} = 0;")
        else:
            readouts.append(f"T r{r.index}[{rows if r.is_value else cols_padded}] __attribute__((aligned(64)));")
    state = k.local("buf", c)
    comment = k.derivation.transition(st.name).kind
    ahead = k.local("next", c)  # (the next head's rows, for the prefetches)
    lanes, whole = k.target.lanes, cols // k.target.lanes
    ops = MatrixOperands(st.name, comment, state, rows, cols, True, decay, tuple(xs), tuple(rights), tuple(before),
                         tuple(after), tuple((w, cr.p.name) for w, cr in zip(ws, t.corrections)))
    if not matrix:
        update = ((f"{decay.code}[i]" if decay.vector else "d") + " * " if decay else "") + f"{state}[i]" \
            + "".join(f" + {x}[i] * {y}" for x, y in zip(xs, rights))
        reads = [VectorRead(st.name, state, rows, rd.query, rd.sums) for rd in before + after]
        return StepVectorPass(st.name, comment, state, rows, tuple(VectorCorrection(p, w) for w, p in ops.corrections),
                              tuple(right_lines), tuple(reads[:len(before)]),
                              decay.code if decay and not decay.vector else None, update,
                              tuple(reads[len(before):])), None
    # read twice (corrections first): the update pass runs from L1 and can prefetch the next head
    prefetches = bool(t.corrections)
    corrections = None
    if t.corrections:
        corrections = correction_pass(ops, lanes=lanes, columns=cols, registers=divisor_at_most(
            whole, REGISTER_BUDGET // max(1, 2 * len(ws) + 1)))
    update = row_pass(ops, lanes=lanes, vector_bytes=k.target.vector_bytes, columns=cols, registers=divisor_at_most(
        whole, REGISTER_BUDGET // max(1, len(xs) + 2 * len(t.readouts) + 1)), ahead=ahead if prefetches else None)
    return (StepMatrixPass(correction_arrays(ops, cols_padded) if t.corrections else (), corrections,
                           tuple(right_lines), update),
            NextHead(ahead, k.cstate(st.name), rows * cols, state) if prefetches else None)
