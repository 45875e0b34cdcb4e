"""Which recurrent kernel of the C backend takes a program, answered from the program's structure.

The C backend runs a recurrent form in one of two kernels: the fused one (fused.py: a decay plus
rank-one terms per state, tiles of the state in registers) or, where that one does not take the program,
its statements one by one (statements.py). Whether a kernel takes a program is decided here, before any code
is generated, in two parts:

- the kernel's limits: what it is not built for (the fused kernel: an update that is no decay plus rank-one
  terms, a state carried transposed, a decay of the value axis, an elementwise decay, per-token matrices as
  inputs; the statement kernel: stabilized exponential feature maps, values of more than two axes);
- spelling: every expression the kernel prints must have a C spelling in its printer (CPrinter in
  printer.py, StatementPrinter in statements.py). `_Spelling` walks exactly the expressions the kernel prints —
  for the fused kernel the transitions' decomposition (decay, corrections, writes) and the readouts'
  queries after stabilization (stabilize.Scales) and the outputs over the readouts; for the statement kernel
  its statements (`printed_statements`, which statements.py prints) — with rules that follow the printers'
  dispatch and read the printers' own tables (_ELEMENTWISE, _VECTOR, _REDUCE, _ROWS, matrix_vector,
  vector_product, …): a builtin added to a table is then accepted here too. tests/test_c_support.py checks
  on every example and test program that the verdicts and the printers agree.

A reason is a sentence about the program: the place (an output, the decay of a state, …) and what is in
the way; the advice (another backend) is the backend's to add (CBackend.why_not).

    fused_refusal(compiled)        None when the fused kernel takes the program, else why not
    statements_refusal(compiled)   the same for the statement-by-statement kernel
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterator

from ..compiler import Compiled, ir
from ..compiler.analysis import inline_lets, rebuild, states_in, to_text, walk
from ..compiler.stabilize import stabilized_states

from .printer import (_ELEMENTWISE, _LEAVES, _REDUCE, _ROWS, _VECTOR, MATRIX_LEAVES, elu_plus_one, matrix_vector,
                      read_only_through_readouts, vector_product)
from .stabilize import Scales

# builtins the printers compute over a vector: whole-vector helpers, row helpers and elementwise ones
# (CPrinter.array's dispatch, in that order); elementwise ones alone for scalars and matrix elements
_VECTOR_BUILTINS = _VECTOR | set(_ROWS) | set(_ELEMENTWISE)


def _shape(shape: ir.Shape) -> str:
    return "[" + ", ".join(shape) + "]"


# ---- the fused kernel (fused.py) ---------------------------------------------------------------------
def fused_limits(compiled: Compiled) -> str | None:
    """What in the program the fused kernel is not built for, or None."""
    p, d = compiled.program, compiled.decomposition
    if d.sequence is not None:
        return _reads_the_sequence(compiled)
    bad = [t for t in d.transitions if not t.factorable]
    if len(bad) == 1:
        return (f"the update of state '{bad[0].state}' is not a decay plus rank-one terms, which the fused kernel "
                f"needs: {'; '.join(bad[0].reasons)}")
    if bad:
        why = "; ".join(f"state '{t.state}': {r}" for t in bad for r in t.reasons)
        return (f"the updates of states {', '.join(repr(t.state) for t in bad)} are not a decay plus rank-one terms, "
                f"which the fused kernel needs: {why}")
    if d.transposed:
        names = ", ".join(f"'{n}'" for n in sorted(d.transposed))
        return (f"state {names} is multiplied and read from the right: the derived forms carry it transposed, the "
                f"fused kernel only as declared")
    for t in d.transitions:
        if t.elementwise:
            return (f"state '{t.state}' decays elementwise (`X*{t.state}`, a decay per element), which the fused "
                    f"kernel's lazy decay of the rows does not take")
        if t.value_corrections:
            return (f"state '{t.state}' has a rank-one correction on the value side (`{t.state}·(I − a⊗b)`), which "
                    f"the fused kernel's corrections of the rows do not take")
        if t.value_decay is not None:
            return (f"state '{t.state}' decays its value axis (`{t.state}·diag(…)`), which the fused kernel's lazy "
                    f"decay of the rows does not take")
    for x in p.inputs:
        if len(x.shape) > 1:
            return f"input '{x.name}' has shape {_shape(x.shape)}: the fused kernel takes scalar and vector inputs only"
    for s in p.states:
        if len(s.shape) not in (1, 2):
            return f"state '{s.name}' has shape {_shape(s.shape)}: the fused kernel holds vector and matrix states only"
        if len(s.shape) == 2 and any(value is None or not value.shape for _, value in d.transition(s.name).writes):
            return f"a write to matrix state '{s.name}' has a scalar value, no k⊗v"  # (see state_terms.py)
    return None


def _reads_the_sequence(compiled: Compiled) -> str:
    """(Such programs run in attention kernels, c.attention, not in the recurrent ones.)"""
    return f"'{compiled.name}' reads the whole sequence: no state carried from one token to the next"


def fused_expressions(compiled: Compiled) -> Iterator[tuple[str, ir.Expr, ir.Expr]]:
    """(place, expression as printed, as derived) for every per-token expression the fused kernel prints
    (state_terms.py, step_region.py and block_region.py): per state its decay, corrections and writes, its
    readouts' queries, then the outputs over the readouts — printed as stabilize.Scales rewrites them (the
    shifts of exponential feature maps), derived as compiler.decompose gives them (for the reasons). (The
    generator groups rank-one terms by their left vector with compiler.linearity.split_scalar, whose parts
    are subexpressions of these.)"""
    p, d = compiled.program, compiled.decomposition
    scales = Scales(compiled)
    for st in p.states:
        tr = d.transition(st.name)
        decay, writes = scales.transition(tr)
        if decay is not None:
            yield f"the decay of state '{st.name}'", decay, tr.decay if tr.decay is not None else decay
        for u, w in tr.corrections:
            yield f"a correction of state '{st.name}'", u, u
            yield f"a correction of state '{st.name}'", w, w
        for (key, value), (derived, _) in zip(writes, tr.writes):
            yield f"a write to state '{st.name}'", key, derived
            if value is not None:
                yield f"a write to state '{st.name}'", value, value
        for r in d.readouts:
            if r.state == st.name and not r.is_value:
                yield f"a readout of state '{st.name}'", scales.query(r), r.query
    outputs, _ = scales.outputs(d.outputs, block=True)
    for (name, e), (_, derived) in zip(outputs, d.outputs):
        yield f"output '{name}'", e, derived


def fused_unspellable(compiled: Compiled) -> str | None:
    """What the fused kernel's printer (CPrinter) has no C for, in a program within its limits, or None."""
    spelling = _Spelling(_fused_leaf, matrices=False)
    for place, printed, derived in fused_expressions(compiled):
        blocker = spelling.blocker(printed)
        if blocker is not None:  # (named as the decomposition has it: no stabilizing shifts, readouts as q·S)
            return _computes(place, spelling.blocker(derived) or blocker, fused=True,
                             readouts=compiled.decomposition.readouts)
    return None


# A program's answer, kept per program object (a Compiled never changes), by id and dropped with the program.
# The question comes several times a call — form="auto"'s choice, the backend's refusal, the kernel it loads,
# the saved forward of a training step — and each answer walks every expression the kernel prints: a tenth of
# a training step through linrec.torch at T = 16 (GLA and gated DeltaNet, d = 16).
_FUSED_REFUSALS: dict[int, tuple[weakref.ref, str | None]] = {}


def fused_refusal(compiled: Compiled) -> str | None:
    """Why the fused recurrent kernel (fused.py) does not take the program, or None when it does."""
    key = id(compiled)
    known = _FUSED_REFUSALS.get(key)
    if known is not None and known[0]() is compiled:
        return known[1]
    reason = fused_limits(compiled) or fused_unspellable(compiled)
    _FUSED_REFUSALS[key] = (weakref.ref(compiled, lambda _, key=key: _FUSED_REFUSALS.pop(key, None)), reason)
    return reason


def _fused_leaf(e: ir.Expr) -> bool:
    """The leaves FusedKernel.ref names: inputs, params, kernel locals and readouts (never a state: the fused
    kernel reads states through readouts only)."""
    return not isinstance(e, (ir.StateRef, ir.LetRef))


# ---- the statement-by-statement kernel (statements.py) ------------------------------------------------------
def printed_statements(program: ir.Program) -> list[tuple[ir.Step, ir.Expr]]:
    """The statement kernel's statements in program order, each with the value it prints: the named values
    that read a state (computed where they are defined: the state may change after them), every update
    and every output; state-free named values are inlined (CPrinter then computes what they share once)."""
    lets = program.lets
    free = {name: value for name, value in lets.items() if not states_in(inline_lets(value, lets))}

    def expand(e: ir.Expr) -> ir.Expr:
        return rebuild(e, lambda n: expand(free[n.name]) if isinstance(n, ir.LetRef) and n.name in free else n)
    return [(s, expand(s.value)) for s in program.steps if not (isinstance(s, ir.Let) and s.name in free)]


def statements_limits(compiled: Compiled) -> str | None:
    """What in the program the statement kernel is not built for, or None."""
    p = compiled.program
    if compiled.decomposition.sequence is not None:
        return _reads_the_sequence(compiled)
    if stabilized_states(compiled):
        fused = fused_refusal(compiled)
        return "its exponential feature maps are stabilized only in the fused kernel" + \
            (f", which does not take it: {fused}" if fused else "")
    for x in (*p.inputs, *p.params):
        if len(x.shape) > 2:
            what = "input" if x in p.inputs else "param"
            return (f"{what} '{x.name}' has shape {_shape(x.shape)}, and the C kernels take values up to "
                    f"matrices")
    return None


def statements_unspellable(compiled: Compiled) -> str | None:
    """What the statement kernel's printer (StatementPrinter) has no C for, in a program within its limits."""
    spelling = _Spelling(_statement_leaf, matrices=True)
    for step, value in printed_statements(compiled.program):
        blocker = spelling.blocker(value)
        if blocker is not None:
            place = (f"value '{step.name}'" if isinstance(step, ir.Let) else f"output '{step.name}'"
                     if isinstance(step, ir.Output) else f"the update of state '{step.state}'")
            return _computes(place, blocker, fused=False)
    return None


def statements_refusal(compiled: Compiled) -> str | None:
    """Why the statement-by-statement kernel (statements.py) does not take the program, or None when it does."""
    return statements_limits(compiled) or statements_unspellable(compiled)


def _statement_leaf(e: ir.Expr) -> bool:
    """The leaves StatementKernel.ref names: inputs, params, states (their buffers), named values, locals."""
    return not isinstance(e, ir.ReadoutRef)


# ---- the printers' dispatch, without the printing -------------------------------------------------------
class _Spelling:
    """Which subexpression of a per-token expression the printer has no C for (None: it prints all of it).
    Each method follows one method of the printers: `_scalar` CPrinter.scalar/_scalar, `_vector`
    CPrinter.elem/array/_elem (and StatementPrinter's products with a matrix), `_matrix` StatementPrinter's
    melem/_melem, `_product` its _product. `matrices`: StatementPrinter (matrices per token, products by
    their structure), else CPrinter (scalars and vectors only). `leaf(e)`: the generator's ref names e."""

    def __init__(self, leaf: Callable[[ir.Expr], bool], matrices: bool):
        self.leaf = leaf
        self.matrices = matrices
        self._known: dict[tuple[str, ir.Expr], ir.Expr | None] = {}  # (rule, e) → blocker: shared subtrees once

    def blocker(self, e: ir.Expr) -> ir.Expr | None:
        """For a value of any rank, printed as the generator prints a whole value (scalar, array, matrix loop)."""
        return (self.scalar, self.vector, self.matrix)[min(len(e.shape), 2)](e)

    def _first(self, *found: Callable[[], ir.Expr | None]) -> ir.Expr | None:
        for f in found:
            e = f()
            if e is not None:
                return e
        return None

    def _memo(self, rule: str, e: ir.Expr, walk_: Callable[[ir.Expr], ir.Expr | None]) -> ir.Expr | None:
        key = (rule, e)
        if key not in self._known:
            self._known[key] = walk_(e)
        return self._known[key]

    def _leaf(self, e: ir.Expr) -> ir.Expr | None:
        return None if self.leaf(e) else e

    # CPrinter.scalar: a scalar value (scalar() of anything else is no C: the printer refuses it)
    def scalar(self, e: ir.Expr) -> ir.Expr | None:
        return self._memo("scalar", e, self._scalar) if not e.shape else e

    def _scalar(self, e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, (ir.Const, ir.DimSize, ir.HeadIndex, ir.HeadCount)):
            return None
        if isinstance(e, _LEAVES):
            return self._leaf(e)
        if isinstance(e, ir.Neg):
            return self.scalar(e.operand)
        if isinstance(e, ir.Arith):
            return self._first(lambda: self.scalar(e.left), lambda: self.scalar(e.right))
        if isinstance(e, ir.Dot):
            a, b = e.left, e.right
            if not a.shape or not b.shape:
                return self._first(lambda: self.scalar(a), lambda: self.scalar(b))
            if len(a.shape) == 1 and len(b.shape) == 1:  # a reduction over the elements of a·b
                return self._first(lambda: self.vector(a), lambda: self.vector(b))
            return e
        if isinstance(e, ir.Apply):
            if e.function in _ELEMENTWISE:
                return self.scalar(e.args[0])
            if e.function in _REDUCE:
                return self.vector(e.args[0])
            return e
        return e

    # CPrinter.elem / array: a vector, element by element or whole
    def vector(self, e: ir.Expr) -> ir.Expr | None:
        return self._memo("vector", e, self._vector) if len(e.shape) == 1 else e

    def _part(self, e: ir.Expr) -> ir.Expr | None:  # CPrinter._part: a scalar operand broadcasts
        return self.scalar(e) if not e.shape else self.vector(e)

    def _vector(self, e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, _LEAVES):
            return self._leaf(e)
        if self.matrices and vector_product(e):  # StatementPrinter._product_into: a·M or M·a, by loops
            a, b = e.left, e.right
            if len(a.shape) == 1:
                return self._first(lambda: self.vector(a), lambda: self.matrix(b))
            return self._first(lambda: self.matrix(a), lambda: self.vector(b))
        if isinstance(e, ir.Apply):
            return self.vector(e.args[0]) if e.function in _VECTOR_BUILTINS else e
        if isinstance(e, ir.Neg):
            return self.vector(e.operand)
        if isinstance(e, ir.Arith):
            x = elu_plus_one(e)
            if x is not None:
                return self._part(x)
            return self._first(lambda: self._part(e.left), lambda: self._part(e.right))
        if isinstance(e, ir.Dot):
            a, b = e.left, e.right
            if not a.shape or not b.shape:
                return self._first(lambda: self._part(a), lambda: self._part(b))
            if isinstance(a, ir.Identity):
                return self.vector(b)
            if isinstance(b, ir.Identity):
                return self.vector(a)
            if isinstance(a, ir.Diag) and len(b.shape) == 1:
                return self._first(lambda: self.vector(a.operand), lambda: self.vector(b))
            if isinstance(b, ir.Diag) and len(a.shape) == 1:
                return self._first(lambda: self.vector(a), lambda: self.vector(b.operand))
            if matrix_vector(e):  # lr_matvec / lr_vecmat: the parameter at its reference, the vector whole
                matrix, x = (a, b) if len(a.shape) == 2 else (b, a)
                return self._first(lambda: self._leaf(matrix), lambda: self.vector(x))
            return e
        return e

    # StatementPrinter.melem: a matrix, element by element (the fused kernel's printer has none)
    def matrix(self, e: ir.Expr) -> ir.Expr | None:
        return self._memo("matrix", e, self._matrix) if self.matrices and len(e.shape) == 2 else e

    def _mpart(self, e: ir.Expr) -> ir.Expr | None:  # StatementPrinter._part with (i, j)
        return self.scalar(e) if not e.shape else self.matrix(e)

    def _matrix(self, e: ir.Expr) -> ir.Expr | None:
        if isinstance(e, MATRIX_LEAVES):
            return self._leaf(e)
        if isinstance(e, ir.Identity):
            return None
        if isinstance(e, ir.Diag):
            return self.vector(e.operand)
        if isinstance(e, ir.Outer):
            return self._first(lambda: self.vector(e.left), lambda: self.vector(e.right))
        if isinstance(e, ir.Neg):
            return self.matrix(e.operand)
        if isinstance(e, ir.Apply):
            return self.matrix(e.args[0]) if e.function in _ELEMENTWISE else e
        if isinstance(e, ir.Arith):
            x = elu_plus_one(e)
            if x is not None:
                return self.matrix(x)
            return self._first(lambda: self._mpart(e.left), lambda: self._mpart(e.right))
        if isinstance(e, ir.Dot):
            return self._product(e)
        return e

    def _product(self, e: ir.Dot) -> ir.Expr | None:
        """StatementPrinter._product: a matrix product by the structure of its factors."""
        a, b = e.left, e.right
        if not a.shape or not b.shape:
            return self._first(lambda: self._mpart(a), lambda: self._mpart(b))
        if isinstance(a, ir.Identity):
            return self.matrix(b)
        if isinstance(b, ir.Identity):
            return self.matrix(a)
        if isinstance(a, ir.Diag):
            return self._first(lambda: self.vector(a.operand), lambda: self.matrix(b))
        if isinstance(b, ir.Diag):
            return self._first(lambda: self.matrix(a), lambda: self.vector(b.operand))
        if isinstance(a, ir.Outer):  # (u⊗w)·B = u⊗(w·B)
            return self._first(lambda: self.vector(a.left), lambda: self.vector(ir.Dot((b.shape[1],), a.right, b)))
        if isinstance(b, ir.Outer):  # A·(u⊗w) = (A·u)⊗w
            return self._first(lambda: self.vector(ir.Dot((a.shape[0],), a, b.left)), lambda: self.vector(b.right))
        for side in (a, b):  # a sum, a difference, a negation, a scalar multiple: distributed
            def with_(x, side=side):
                return ir.Dot(e.shape, x, b) if side is a else ir.Dot(e.shape, a, x)
            if isinstance(side, ir.Neg):
                return self.matrix(with_(side.operand))
            if isinstance(side, ir.Arith) and side.op in ("add", "sub") and side.left.shape and side.right.shape:
                return self._first(lambda: self.matrix(with_(side.left)), lambda: self.matrix(with_(side.right)))
            if isinstance(side, ir.Arith) and side.op in ("mul", "div") and not side.right.shape:
                return self._first(lambda: self.matrix(with_(side.left)), lambda: self.scalar(side.right))
            if isinstance(side, ir.Arith) and side.op == "mul" and not side.left.shape:
                return self._first(lambda: self.scalar(side.left), lambda: self.matrix(with_(side.right)))
        if isinstance(a, ir.Dot) and len(a.left.shape) == 2 and len(a.right.shape) == 2:  # (A·B)·b = A·(B·b)
            return self.matrix(ir.Dot(e.shape, a.left, ir.Dot((a.right.shape[0], b.shape[1]), a.right, b)))
        return self._first(lambda: self.matrix(a), lambda: self.matrix(b))  # computed whole, then read


def _as_written(e: ir.Expr, readouts) -> ir.Expr:
    """e with each readout written out again: q·S, or the vector state S read as it is."""
    def written(n: ir.Expr) -> ir.Expr:
        if not isinstance(n, ir.ReadoutRef):
            return n
        r = readouts[n.index]
        state = ir.StateRef(n.shape if r.is_value else (), r.state, "prev" if r.before_update else "new")
        return state if r.is_value else ir.Dot(n.shape, r.query, state)
    return rebuild(e, written)


def _computes(place: str, blocker: ir.Expr, fused: bool, readouts=()) -> str:
    """The reason a kernel refuses an expression: where it is, what it is (readouts written out as q·S) and
    why the printer has no C."""
    try:
        text = to_text(_as_written(blocker, readouts))
    except TypeError:  # (a kernel local)
        text = type(blocker).__name__
    states = sorted(n.name for n in walk(blocker) if isinstance(n, ir.StateRef))
    if fused and states:
        why = f"the fused kernel reads {read_only_through_readouts(states[0])}"
    elif fused and len(blocker.shape) > 1:
        why = f"a matrix per token (shape {_shape(blocker.shape)}), and the fused kernel computes scalars and vectors"
    elif len(blocker.shape) > 2:
        why = f"a value of shape {_shape(blocker.shape)}, and the C kernels compute values up to matrices"
    elif isinstance(blocker, ir.Apply) and blocker.function not in _VECTOR_BUILTINS | _REDUCE:
        why = f"the C kernels have no {blocker.function}"
    elif fused and isinstance(blocker, ir.Dot) and any(len(x.shape) == 2 for x in (blocker.left, blocker.right)):
        why = "the fused kernel multiplies a vector by a matrix only when the matrix is a parameter"
    else:
        why = "the C kernels have no form of this operation"
    return f"{place} computes `{text}` per token: {why}"
