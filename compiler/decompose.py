"""The program decomposed for the derived forms: each state's transition (decay, corrections, writes), the
readouts q·S, the outputs written over the readouts, and which forms exist (with the reason when one does
not). The backends derive their forms' code from this."""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .analysis import inline_lets, rebuild, states_in, to_text, walk
from .readouts import in_readout_shape, read_side
from .sequence import SequencePlan, is_sequence_program, plan
from .transitions import Transition, classify
from .transpose import obstacle, transposed

FORMS = ("recurrent", "parallel", "chunkwise")


@dataclass(frozen=True)
class Readout:
    """r = query·S, with S before (S_(t−1)) or after (S_t) this token's update. A vector state an output
    uses as a value of its own (`z*sigmoid(g)`, HGRN- and RG-LRU-style: an elementwise read) is a readout
    with no query: r = z itself."""

    index: int
    state: str
    query: ir.Expr | None
    before_update: bool

    @property
    def is_value(self) -> bool:
        return self.query is None

    @property
    def shape(self) -> ir.Shape:
        return ()  # filled by the caller's state shape; kept for symmetry


@dataclass(frozen=True)
class Decomposition:
    """What decompose() found in a program: each state's transition, the readouts, the outputs over them,
    the forms that do not exist and why; for a program that reads the sequence, its plan instead."""

    transitions: tuple[Transition, ...]
    readouts: tuple[Readout, ...]
    outputs: tuple[tuple[str, ir.Expr], ...]   # output expressions over ReadoutRef and inputs
    unavailable: tuple[tuple[str, str], ...]   # (form, reason)
    sequence: SequencePlan | None = None       # set for programs that read the sequence (seq, …)
    transposed: frozenset[str] = frozenset()   # matrix states the forms carry transposed (compiler.transpose)
    stages: tuple = ()                         # compiler.stages.Stage, in order, when derived in stages

    def transition(self, state: str) -> Transition:
        return next(t for t in self.transitions if t.state == state)

    @property
    def forms(self) -> tuple[str, ...]:
        missing = {f for f, _ in self.unavailable}
        return tuple(f for f in FORMS if f not in missing)

    def why_not(self, form: str) -> str | None:
        return next((r for f, r in self.unavailable if f == form), None)


def _is_readout(node: ir.Expr, state: str | None = None) -> bool:
    """node is q·S (S a state, of that name if given) with a q that reads no state. (Readouts are found
    bottom up: a query that reads a state, (q·U)·S, holds U's readout by then, and is no query either.)"""
    return isinstance(node, ir.Dot) and isinstance(node.right, ir.StateRef) and len(node.left.shape) == 1 \
        and (state is None or node.right.name == state) and not states_in(node.left) \
        and not any(isinstance(n, ir.ReadoutRef) for n in walk(node.left))


def _extract_readouts(program: ir.Program, readouts: list[Readout], problems: list[str]):
    def readout(node: ir.Expr, s: ir.StateRef, query: ir.Expr | None) -> ir.ReadoutRef:
        r = Readout(len(readouts), s.name, query, s.version == "prev" and program.causal)
        for existing in readouts:  # the same readout written twice is computed once
            if (existing.state, existing.query, existing.before_update) == (r.state, r.query, r.before_update):
                return ir.ReadoutRef(node.shape, existing.index)
        readouts.append(r)
        return ir.ReadoutRef(node.shape, r.index)

    def contraction(node: ir.Expr) -> ir.Expr:
        return readout(node, node.right, node.left) if _is_readout(node) else node

    def value(node: ir.Expr) -> ir.Expr:
        # what contractions leave of a vector state is read as it is (elementwise, or whole)
        if isinstance(node, ir.StateRef) and len(node.shape) == 1:
            return readout(node, node, None)
        return node

    outputs = []
    for out in program.outputs:
        expr = rebuild(rebuild(_read_value(program, out), contraction), value)
        for n in walk(expr):
            if isinstance(n, ir.StateRef):
                problems.append(_read_from_both_sides(program, out, n.name) or
                                f"output '{out.name}' uses matrix state '{n.name}' other than through a readout "
                                f"`q·{n.name}` with a state-free q (in `{to_text(out.value)}`)")
                break
        outputs.append((out.name, expr))
    return tuple(outputs)


def _read_value(program: ir.Program, out: ir.Output) -> ir.Expr:
    """The output's value with its named values written out and its linear reads of matrix states in the
    readout shape q·S (compiler.readouts)."""
    return in_readout_shape(inline_lets(out.value, program.lets), program.states)


def _read_through_readouts(program: ir.Program, state: str) -> bool:
    """Every output reads `state` through a readout q·S with a state-free q."""
    return all(_reads_through_readouts(program, out, state) for out in program.outputs)


def _reads_through_readouts(program: ir.Program, out: ir.Output, state: str) -> bool:
    """The output reads `state` (if at all) through readouts q·S with a state-free q."""
    nodes = list(walk(_read_value(program, out)))
    uses = sum(isinstance(n, ir.StateRef) and n.name == state for n in nodes)
    return uses == sum(_is_readout(n, state) for n in nodes)


def _read_from_both_sides(program: ir.Program, out: ir.Output, state: str) -> str | None:
    """Why `out` is no readout of `state` where it reads it from the right (S·w, a readout of Sᵀ) and another
    output reads it from the left (q·S): no orientation of the state takes both — or None."""
    flipped = transposed(program, state)
    if flipped is None or not _reads_through_readouts(flipped, next(o for o in flipped.outputs if o.name == out.name),
                                                      state):
        return None
    for other in program.outputs:
        if other.name != out.name and any(_is_readout(n, state) for n in walk(_read_value(program, other))):
            return (f"output '{out.name}' reads matrix state '{state}' from the right (`{to_text(out.value)}`) and "
                    f"output '{other.name}' from the left (`{to_text(other.value)}`): the forms take the reads of a "
                    f"state on one side, `q·{state}` (or `{state}·q` throughout, the state carried transposed)")
    return None


def _derivable(program: ir.Program, state: str) -> bool:
    return classify(program, program.updates[state]).factorable and _read_through_readouts(program, state)


def _orient(program: ir.Program) -> tuple[ir.Program, frozenset[str], list[str]]:
    """The program the forms are derived from: each matrix state that has them only once transposed (it is
    multiplied and read from the right) replaced by its transpose; and why a state read from the right could
    not be carried transposed, where an input or param matrix meets it."""
    flipped, why = set(), []
    for st in program.states:
        if len(st.shape) != 2 or _derivable(program, st.name):
            continue
        other = transposed(program, st.name)
        if other is not None and _derivable(other, st.name):
            program = other
            flipped.add(st.name)
        elif other is None and _read_from_the_right(program, st.name):
            matrix = obstacle(program, st.name)
            if matrix is not None:
                kind = "an input" if isinstance(matrix, ir.InputRef) else "a param"
                a, b = matrix.shape
                why.append(f"state '{st.name}': it is read from the right (`{st.name}·q`), which the forms take by "
                           f"carrying it transposed, and its update meets '{matrix.name}', {kind} matrix, which "
                           f"would then be transposed too: the forms take no transposed input or param; declare "
                           f"'{st.name}' with its axes swapped, '{matrix.name}' as [{b}, {a}], update it from the "
                           f"left and read it as `q·{st.name}`")
    return program, frozenset(flipped), why


def _read_from_the_right(program: ir.Program, state: str) -> bool:
    """Some output reads matrix state `state` as S·q (a vector on its right)."""
    return any(read is not None and read[0].name == state and read[2] == "right"
               for out in program.outputs for read in map(read_side, walk(_read_value(program, out))))


def decompose(program: ir.Program) -> Decomposition:
    if is_sequence_program(program):
        sp = plan(program)
        return Decomposition((), (), sp.outputs, sp.unavailable, sp)
    program, flipped, orientation = _orient(program)
    updates = program.updates
    transitions = tuple(classify(program, updates[s.name]) for s in program.states)
    readouts: list[Readout] = []
    problems: list[str] = list(orientation)
    outputs = _extract_readouts(program, readouts, problems)
    for t in transitions:
        problems.extend(f"state '{t.state}': {r}" for r in t.reasons)
    unavailable = []
    if problems:
        reason = "; ".join(dict.fromkeys(problems))
        unavailable = [("parallel", reason), ("chunkwise", reason)]
    return Decomposition(transitions, tuple(readouts), outputs, tuple(unavailable), transposed=flipped)
