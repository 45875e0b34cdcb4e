"""The decode step's body for one (batch row, head) (fused_plan.StepRegion): one token on the caller's state
rows — the token's values, then per state the corrections' p = wᵀS, the right vectors and one fused pass
(rows of S at their true stride dv, with a column tail when dv is not a whole number of registers), then
the outputs."""
from __future__ import annotations

from dataclasses import dataclass

from ..compiler import ir

from .fused_plan import (CorrectionOperands, NextHead, ScaleGroup, StepMatrixPass, StepRegion, StepVectorPass,
                         VectorRead)
from .kernel_source import KernelSource
from .passes import Decay, MatrixOperands, ReadoutOperands, column_block, correction_arrays, correction_pass, row_pass
from .printer import CPrinter
from .stabilize import Scales
from .state_terms import StateTerms, state_terms


@dataclass(frozen=True)
class _Values:
    """The C of a state's per-token values, as phase 1 of the step prints them."""

    decay: Decay | None
    ws: tuple[str, ...]                # the corrections' w
    xs: tuple[str, ...]                # the groups' left vectors
    queries: tuple[str | None, ...]    # the readouts' (None: a read of the state as it is)


def step_region(kernel: KernelSource, scales: Scales, groups: list[ScaleGroup]) -> StepRegion:
    """The token of one (batch row, head) the decode step runs (`tok` its row of every array)."""
    k = kernel
    pr = CPrinter(k.target.ctype, k.dims, k.ref)
    terms = [state_terms(k, scales, st, updates=True, readouts=True) for st in k.program.states]
    # declare everything this region prints, so that shared subexpressions are computed once
    for t in terms:
        pr.expect(*[e for e in (t.decay,) if e is not None], *[c.w for c in t.corrections], *[g.x for g in t.groups],
                  *[g.y for g in t.groups], *t.queries())
    pr.expect(*scales.exponents())
    outputs, scaled = scales.outputs(k.decomposition.outputs, block=False)
    pr.expect(*[e for _, e in outputs])
    # 1. the token's state-free values (first the scales of stabilized states: the rest reads them)
    scale_lines = scales.token_lines(pr, scaled, block=False)
    values = [_values(pr, t) for t in terms]
    lines = scale_lines + pr.take_token()
    # 2. per state: corrections, right vectors, the fused pass
    readouts, passes, next_heads = [], [], []
    for st, t, v in zip(k.program.states, terms, values):
        state_pass, next_head = _state(k, pr, st, t, v, readouts)
        passes.append(state_pass)
        next_heads += [next_head] if next_head else []
    # 3. the outputs, from the readouts
    output_lines = []
    for name, e in outputs:
        target = k.cout(name)
        body = pr.fill(e, k.row(target)) if e.shape else [f"{target}[tok] = {pr.scalar(e)};"]
        output_lines += pr.take_token() + body
    rows = k.rows_mentioned(lines, passes, output_lines)
    return StepRegion(
        head=tuple(pr.take_head()), scales=tuple(groups),
        input_rows="".join(x.declaration + "\n" for x in k.input_arrays() if x.row in rows),
        values=tuple(lines), readouts=tuple(readouts), passes=tuple(passes),
        output_rows=tuple(o.declaration for o in k.output_arrays() if not o.scalar) if output_lines else (),
        outputs=tuple(output_lines), next_heads=tuple(next_heads))


def _values(pr: CPrinter, t: StateTerms) -> _Values:
    """A state's per-token values, printed in phase 1's order: decay, corrections' w, left vectors, queries."""
    d = t.decay
    return _Values(None if d is None else Decay(pr.array(d) if d.shape else pr.scalar(d), bool(d.shape)),
                   tuple(pr.array(c.w) for c in t.corrections), tuple(pr.array(g.x) for g in t.groups),
                   tuple(None if r.is_value else pr.array(r.query) for r in t.readouts))


def _state(k: KernelSource, pr: CPrinter, st: ir.State, t: StateTerms, v: _Values, readouts: list[str]):
    """The pass of state st (its readouts' declarations into `readouts`), and the pointer to the next head's
    rows when the pass prefetches them."""
    c = k.cstate(st.name)
    matrix = len(st.shape) == 2
    rows = k.dims[st.shape[0]]
    cols = k.dims[st.shape[1]] if matrix else 1
    cols_padded = k.padded(cols) if matrix else 1
    right_lines, rights = _right_vectors(k, pr, c, t, matrix, cols, cols_padded)
    before, after = [], []
    for r, q in zip(t.readouts, v.queries):
        (before if r.before_update else after).append(ReadoutOperands(q, f"r{r.index}"))
        if not matrix and not r.is_value:
            readouts.append(f"T r{r.index} = 0;")
        else:
            readouts.append(f"T r{r.index}[{rows if r.is_value else cols_padded}] __attribute__((aligned(64)));")
    buffer = k.local("buf", c)
    comment = k.decomposition.transition(st.name).kind
    ahead = k.local("next", c)  # (the next head's rows, for the prefetches)
    ops = MatrixOperands(st.name, comment, buffer, rows, cols, True, v.decay, v.xs, rights, tuple(before),
                         tuple(after), tuple(CorrectionOperands(w, cr.p.name) for w, cr in zip(v.ws, t.corrections)),
                         bits=k.bf16_in_pass and matrix)
    if not matrix:
        decay = v.decay
        update = ((f"{decay.code}[i]" if decay.vector else "d") + " * " if decay else "") + f"{buffer}[i]" \
            + "".join(f" + {x}[i] * {y}" for x, y in zip(v.xs, rights))
        reads = [VectorRead(st.name, buffer, rows, rd.query, rd.sums) for rd in before + after]
        return StepVectorPass(st.name, comment, buffer, rows, ops.corrections,
                              tuple(reads[:len(before)]), update, tuple(reads[len(before):]), right_scalars=right_lines,
                              scalar_decay=decay.code if decay and not decay.vector else None), None
    lanes, whole = k.target.lanes, cols // k.target.lanes
    # read twice (corrections first): the update pass runs from L1 and can prefetch the next head (bfloat16
    # bits: lr_step_heads prefetches the next head's whole state before the token, half the lines)
    prefetches = bool(t.corrections) and not k.state_is_bf16
    corrections = None
    if t.corrections:
        corrections = correction_pass(ops, lanes=lanes, columns=cols,
                                      registers=column_block(whole, 2 * len(v.ws) + 1, k.target.vector_bytes))
    update = row_pass(ops, lanes=lanes, vector_bytes=k.target.vector_bytes, columns=cols,
                      registers=column_block(whole, len(v.xs) + 2 * len(t.readouts) + 1, k.target.vector_bytes),
                      ahead=ahead if prefetches else None)
    return (StepMatrixPass(correction_arrays(ops, cols_padded) if t.corrections else (), corrections, right_lines,
                           update),
            NextHead(ahead, c, rows * cols, buffer) if prefetches else None)


def _right_vectors(k: KernelSource, pr: CPrinter, c: str, t: StateTerms, matrix: bool, cols: int,
                   cols_padded: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The lines that compute the groups' right vectors (a row padded to whole registers, or a scalar for a
    vector state), and their C names (an input or param row is read in place)."""
    lines, names = [], []
    for i, g in enumerate(t.groups):
        y = g.y
        name = k.local("y", c, i)
        if matrix and isinstance(y, (ir.InputRef, ir.ParamRef)):
            names.append(pr.array(y))  # a value used as it is: read it in place
            continue
        if matrix:
            body = pr.fill(y, name, cols)
            pad = [f"for (int i = {cols}; i < {cols_padded}; ++i) {name}[i] = 0;"] if cols_padded > cols else []
            lines += pr.take_token() + [f"T {name}[{cols_padded}] __attribute__((aligned(64)));"] + body + pad
        else:
            code = pr.scalar(y)
            lines += pr.take_token() + [f"const T {name} = {code};"]
        names.append(name)
    return tuple(lines), tuple(names)
