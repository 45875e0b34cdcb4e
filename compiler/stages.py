"""Staged derivation over the state graph: a program whose states read each other in one direction, derived
one stage after another.

A state reads another when its update does, or when a readout of it has a query that does: q·S, or S·q —
a read from the right, the readout of a state in the transposed convention (docs/forms.md), which the stage
that has S derives as its outputs are, carrying S transposed where that gives it the forms
(compiler.transpose). States are ordered by that relation: a state's stage is one after the latest stage of
the states it reads outside its own cycle (states that read each other stay in one stage), so a stage's
states read no later one. The per-token values a later stage needs of an earlier one — a vector state's
value (S_(t−1) or S_t), or a readout q·S or S·q of a matrix state — become outputs of the earlier stage and
per-token inputs of the later one, however nonlinearly the later one uses them (a softmax over a read, a
preconditioned key). Each stage is a program of its own (an ir.Program, decomposed as any other), so
every stage gets the forms its own structure allows, and the program gets the forms every stage has. The
recurrent form needs no stages: it runs the program as written.

    stages = split(program)      # None: one stage; _NoStages: a later stage would need a matrix per token, or
                                 # a value that reads states of both stages
    derive(program, decompose(program)) → the decomposition, with its stages and their forms
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from . import ir
from .analysis import inline_lets, rebuild, refs, states_in, to_text, walk
from .decompose import FORMS, Decomposition, decompose
from .linearity import ZERO
from .readouts import in_readout_shape, read_side
from .transitions import classify


@dataclass(frozen=True)
class Handed:
    """A per-token value one stage computes for a later one: `name` is an output of the stage that has
    `state`, and an input of the stages that use it; `value` is what it reads — the (vector) state itself
    (`query` None) or a readout query·S — or S·query, a read from the right (`side` "right": the readout of
    a state in the transposed convention) — of S_(t−1) or S_t (`version`)."""

    name: str
    state: str
    version: str                  # "prev" (S_(t−1)) or "new" (S_t)
    query: ir.Expr | None
    value: ir.Expr
    side: str = "left"            # where the query multiplies S: "left" (q·S) or "right" (S·q)

    def text(self) -> str:
        when = "before" if self.version == "prev" else "after"
        if self.query is None:
            read = self.state
        elif self.side == "right":
            read = f"{self.state}·({to_text(self.query)})"
        else:
            read = f"({to_text(self.query)})·{self.state}"
        return f"{self.name} = {read} ({when} this token's update)"


@dataclass(frozen=True)
class Stage:
    """One stage: its states, the program that derives them (the values earlier stages hand it are inputs
    of that program, and the values it hands on are outputs), and that program's decomposition."""

    number: int                          # 1, 2, … in the order they run
    states: tuple[str, ...]
    program: ir.Program
    decomposition: Decomposition
    takes: tuple[str, ...]               # its inputs that earlier stages compute
    hands: tuple[Handed, ...]            # its outputs that later stages take
    outputs: tuple[str, ...]             # the program's outputs it computes

    @property
    def forms(self) -> tuple[str, ...]:
        return self.decomposition.forms

    def header(self) -> str:
        """The stage as its generated source's header names it: its states, what it takes and hands on."""
        takes = f"; takes {', '.join(self.takes)}" if self.takes else ""
        hands = f"; hands on {'; '.join(h.text() for h in self.hands)}" if self.hands else ""
        return f"stage {self.number}: state(s) {', '.join(self.states)}{takes}{hands}"

    def arguments(self, values: dict, params: dict, initial_state: dict | None) -> tuple[dict, dict, dict | None]:
        """The stage's inputs (taken from `values`: the program's inputs and what earlier stages handed on),
        params and initial states (None: none given), by name."""
        program = self.program
        state0 = None if initial_state is None else \
            {s.name: initial_state[s.name] for s in program.states if s.name in initial_state}
        return ({x.name: values[x.name] for x in program.inputs},
                {p.name: params[p.name] for p in program.params if p.name in params}, state0)


def run_in_order(stages, inputs: dict, params: dict, initial_state: dict | None, run) -> tuple[dict, dict, dict]:
    """The stages run one after another, each given the program's inputs it reads and the values the stages
    before it handed on: run(stage, inputs, params, initial states) → (its outputs, its final states), its
    arguments from Stage.arguments. Returns (the program's outputs the stages computed, every stage's final
    states, the inputs with every value handed on)."""
    values = dict(inputs)
    outputs, final = {}, {}
    for stage in stages:
        out, ends = run(stage, *stage.arguments(values, params, initial_state))
        values.update((h.name, out[h.name]) for h in stage.hands)
        outputs.update((name, out[name]) for name in stage.outputs)
        final.update((s.name, ends[s.name]) for s in stage.program.states)
    return outputs, final, values


class _NoStages(Exception):
    """The program does not split into stages (the message says why, for check's reason)."""


def derive(program: ir.Program, whole: Decomposition) -> Decomposition:
    """The program's decomposition with its stages: when the program as a whole has no parallel or chunkwise
    form and its states split into stages, its forms are those every stage has (each stage's reasons for
    the others). A program whose states read each other in a cycle keeps its reasons, and says so."""
    if whole.sequence is not None or not whole.unavailable or len(program.states) < 2:
        return whole
    levels, cycles = _levels(program)
    cycle_note = "; ".join(f"states {', '.join(c)} read each other (a cycle): neither can be derived before the "
                           f"other, so they stay in one stage" for c in cycles)
    if not program.causal:
        return _noted(whole, cycle_note or ("" if max(levels.values()) == 0 else
                                            "a non-causal program is not derived in stages: its outputs read the "
                                            "states after every token, while a later stage takes an earlier one's "
                                            "values token by token"))
    try:
        stages = split(program, levels)
    except _NoStages as why:
        return _noted(whole, str(why))
    if stages is None:
        return _noted(whole, cycle_note)
    unavailable = []
    for form in FORMS:
        reasons = [f"stage {s.number} ({', '.join(s.states)}): {_with_legend(s.decomposition.why_not(form), s, stages)}"
                   for s in stages if s.decomposition.why_not(form)]
        if reasons:
            unavailable.append((form, "; ".join(reasons + ([cycle_note] if cycle_note else []))))
    return dataclasses.replace(whole, unavailable=tuple(unavailable), stages=tuple(stages))


def _with_legend(reason: str, stage: Stage, stages: list[Stage]) -> str:
    """A stage's reason, with what the values it names that a stage hands on are (they are no names of the
    program): its own, handed on to a later stage, and those an earlier stage hands to it."""
    def named(hands) -> list[str]:
        return [h.text() for h in hands if re.search(rf"(?<!\w){re.escape(h.name)}(?!\w)", reason)]
    own = named(stage.hands)
    taken = named(h for s in stages if s is not stage for h in s.hands)
    legend = ([f"{'; '.join(own)}, which this stage hands on to a later one"] if own else []) + \
        ([f"{'; '.join(taken)}, handed on by an earlier stage"] if taken else [])
    return reason + (f" (where {'; and '.join(legend)})" if legend else "")


def _noted(d: Decomposition, note: str) -> Decomposition:
    if not note:
        return d
    return dataclasses.replace(d, unavailable=tuple((f, f"{r}; {note}") for f, r in d.unavailable))


# ---- the state graph ------------------------------------------------------------------------------------
def _expressions(program: ir.Program) -> list[ir.Expr]:
    """Every update and output, named values written out and linear reads of matrix states as readouts."""
    lets = program.lets
    values = [u.value for u in program.updates.values()] + [o.value for o in program.outputs]
    return [in_readout_shape(inline_lets(v, lets), program.states) for v in values]


def _reads(program: ir.Program) -> dict[str, set[str]]:
    """state → the other states it reads: in its update, and in the queries of its readouts q·S and S·q."""
    lets = program.lets
    reads = {s.name: states_in(inline_lets(program.updates[s.name].value, lets)) - {s.name}
             for s in program.states}
    for e in _expressions(program):
        for state, query, _ in filter(None, map(read_side, walk(e))):
            reads[state.name] |= states_in(query) - {state.name}
    return reads


def _levels(program: ir.Program) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    """Each state's stage (0, 1, …: one more than the latest stage it reads outside its own cycle), and the
    cycles (states that read each other, in declaration order)."""
    reads = _reads(program)
    reach: dict[str, set[str]] = {}
    for s in reads:  # (a handful of states: the transitive closure by search)
        seen, todo = set(), list(reads[s])
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(reads[x])
        reach[s] = seen
    order = [s.name for s in program.states]
    component = {s: tuple(x for x in order if x == s or (x in reach[s] and s in reach[x])) for s in order}
    levels: dict[str, int] = {}

    def level(s: str) -> int:
        if s not in levels:
            outside = {x for x in reach[s] if x not in component[s]}
            levels[s] = 1 + max((level(x) for x in outside), default=-1)
        return levels[s]
    for s in order:
        level(s)
    cycles = list(dict.fromkeys(c for c in component.values() if len(c) > 1))
    return levels, cycles


# ---- the stages' programs -------------------------------------------------------------------------------
def split(program: ir.Program, levels: dict[str, int] | None = None) -> list[Stage] | None:
    """The program as stages, or None when its states are one stage. Raises _NoStages when the states are
    ordered but a later stage reads an earlier matrix state other than through readouts q·S or S·q (its value
    per token would be a matrix, which no stage hands on). A read S·q is handed on as q·S is: the stage that
    has S computes it as an output, which its decomposition takes as any program's (compiler.decompose: a
    state read from the right is carried transposed where that gives it the forms, and where it does not,
    that stage — and so the program — has the recurrent form only, with that reason)."""
    levels = levels or _levels(program)[0]
    count = max(levels.values()) + 1
    if count < 2:
        return None
    taken = {d.name for d in program.dims} | {x.name for x in program.inputs} | \
        {p.name for p in program.params} | {s.name for s in program.states} | set(program.lets) | \
        {o.name for o in program.outputs}
    lets = program.lets
    handed: dict[tuple, Handed] = {}            # (state, version, query) → the value handed on
    requests: dict[int, list[Handed]] = {k: [] for k in range(count)}

    def hand(state: ir.State, version: str, query: ir.Expr | None, side: str = "left") -> str:
        key = (state.name, version, query, side)
        if key not in handed:
            base = f"{state.name}_{'t' if version == 'new' else 'prev'}" if query is None else f"{state.name}_read"
            name, n = base, 1
            while name in taken:
                name, n = f"{base}{n}", n + 1
            taken.add(name)
            read = ir.StateRef(state.shape, state.name, version)
            if query is None:
                value = read
            elif side == "right":
                value = ir.Dot(state.shape[:1], read, query)
            else:
                value = ir.Dot(state.shape[1:], query, read)
            handed[key] = Handed(name, state.name, version, query, value, side)
            requests[levels[state.name]].append(handed[key])
        return handed[key].name

    def localize(e: ir.Expr, k: int) -> ir.Expr:
        """`e` as stage k computes it: every read of an earlier stage's state replaced by the input it is
        handed as."""
        written_out = inline_lets(e, lets)
        if not any(levels[s] < k for s in states_in(written_out)):
            return e
        # an earlier matrix state is handed on through its readouts: bring its reads to that shape (named
        # values written out) where they are not in it as written
        matrices = tuple(s for s in program.states if levels[s.name] < k and len(s.shape) == 2)
        if any(not _in_readouts(written_out, m.name) for m in matrices):
            e = in_readout_shape(written_out, matrices)

        def visit(node: ir.Expr) -> ir.Expr:
            read = read_side(node)
            if read is not None and levels.get(read[0].name, k) < k:  # (S·q is handed on as q·S is)
                state, query, side = read
                return ir.InputRef(node.shape, hand(program.state(state.name), state.version,
                                                    inline_lets(query, lets), side))
            if isinstance(node, ir.StateRef) and levels.get(node.name, k) < k and len(node.shape) == 1:
                return ir.InputRef(node.shape, hand(program.state(node.name), node.version, None))
            return node
        e = rebuild(e, visit)
        left = [n.name for n in walk(e) if isinstance(n, ir.StateRef) and levels[n.name] < k]
        if left:
            raise _NoStages(f"state '{left[0]}' is read by a later stage other than through readouts q·{left[0]} "
                            f"or {left[0]}·q with a query q that reads no state of its stage: its value per token "
                            f"is a matrix, which no stage hands on{_as_vectors(program, left[0])}")
        return e

    def stage_of(e: ir.Expr) -> int:
        return max((levels[s] for s in states_in(inline_lets(e, lets))), default=0)

    # the stages' steps, the last stage first: a stage's reads of earlier states ask those stages for values
    steps_of: dict[int, list] = {}
    for k in reversed(range(count)):
        steps, needed = [], set()
        for step in program.steps:
            if isinstance(step, ir.Update) and levels[step.state] == k:
                steps.append(dataclasses.replace(step, value=localize(step.value, k)))
            elif isinstance(step, ir.Output) and stage_of(step.value) == k:
                steps.append(ir.Output(step.name, localize(step.value, k)))
            elif isinstance(step, ir.Let):
                steps.append(step)  # (kept below if this stage's steps use it)
        # the values this stage hands on, read where the program reads them: S_(t−1) before S's update,
        # S_t after it
        for h in requests[k]:
            value = localize(h.value, k)
            if states_in(value) - {h.state}:
                raise _NoStages(f"the value `{to_text(value)}` a later stage takes reads states of its own stage "
                                f"besides '{h.state}'")
            at = next(i for i, s in enumerate(steps) if isinstance(s, ir.Update) and s.state == h.state)
            steps.insert(at if h.version == "prev" else at + 1, ir.Output(h.name, value))
        for s in steps:
            if not isinstance(s, ir.Let):
                needed |= _lets_used(s.value, lets)
        steps_of[k] = [dataclasses.replace(s, value=localize(s.value, k)) if isinstance(s, ir.Let) else s
                       for s in steps if not isinstance(s, ir.Let) or s.name in needed]

    stages = []
    for k in range(count):
        names = tuple(s.name for s in program.states if levels[s.name] == k)
        steps = tuple(steps_of[k])
        takes = tuple(dict.fromkeys(n for s in steps for n in refs(s.value, ir.InputRef)
                                    if any(h.name == n for h in handed.values())))
        sub = _program(program, k, names, steps, {h.name: h for h in handed.values()})
        stages.append(Stage(k + 1, names, sub, decompose(sub), takes, tuple(requests[k]),
                            tuple(s.name for s in steps if isinstance(s, ir.Output)
                                  and s.name in {o.name for o in program.outputs})))
    return stages


def _as_vectors(program: ir.Program, name: str) -> str:
    """For a matrix state that holds only its token's write a⊗b (Mamba-3's previous write, read by the next
    token): how to write it as two vector states, which a stage hands on."""
    t = classify(program, program.updates[name])
    if t.decay != ZERO or t.corrections or len(t.writes) != 1 or t.reasons:
        return ""
    a, b = t.writes[0]
    state = program.state(name)
    return (f"; '{name}' holds only its token's write `{to_text(ir.Outer(state.shape, a, b))}`: as two vector states, "
            f"`state {name}_a[{state.shape[0]}], {name}_b[{state.shape[1]}]` with `{name}_a = {to_text(a)}` and "
            f"`{name}_b = {to_text(b)}`, read as `{name}_a⊗{name}_b`, the two vectors are handed on (an initial "
            f"state then is their outer product)")


def _in_readouts(e: ir.Expr, state: str) -> bool:
    """Every read of matrix state `state` in `e` is q·S or S·q with a vector q."""
    reads = sum(isinstance(n, ir.StateRef) and n.name == state for n in walk(e))
    return reads == sum(r is not None and r[0].name == state for r in map(read_side, walk(e)))


def _lets_used(e: ir.Expr, lets: dict[str, ir.Expr]) -> set[str]:
    used, todo = set(), refs(e, ir.LetRef)
    while todo:
        name = todo.pop()
        if name not in used:
            used.add(name)
            todo.extend(refs(lets[name], ir.LetRef))
    return used


def _program(program: ir.Program, k: int, states: tuple[str, ...], steps: tuple, handed: dict[str, Handed]) \
        -> ir.Program:
    """Stage k's program: its states and steps, the inputs and params they use (with the params their
    defaults use), and the values earlier stages hand it as inputs."""
    used_inputs, used_params = set(), set()
    for s in steps:
        used_inputs |= set(refs(s.value, ir.InputRef))
        used_params |= set(refs(s.value, ir.ParamRef))
    params = {p.name: p for p in program.params}
    todo = list(used_params)
    while todo:
        p = params[todo.pop()]
        if p.default is not None:
            for q in refs(p.default, ir.ParamRef):
                if q not in used_params:
                    used_params.add(q)
                    todo.append(q)
    inputs = [x for x in program.inputs if x.name in used_inputs]
    inputs += [ir.Input(name, _shape_of(program, h)) for name, h in handed.items() if name in used_inputs]
    # a stage of params alone (positions P = P + theta) has the program's first input, unused: its forms take
    # the batch, the tokens, the heads and the dtype from a per-token array
    if not inputs and program.inputs:
        inputs = [program.inputs[0]]
    return ir.Program(f"{program.name}_stage{k + 1}", program.causal, program.dims, tuple(inputs),
                      tuple(p for p in program.params if p.name in used_params),
                      tuple(s for s in program.states if s.name in states), steps)


def _shape_of(program: ir.Program, h: Handed) -> ir.Shape:
    state = program.state(h.state)
    if h.query is None:
        return state.shape
    return state.shape[:1] if h.side == "right" else state.shape[1:]
