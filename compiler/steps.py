"""Updates in steps: a state assigned several times in one token, composed into the one update it derives from.

Papers and reference code write a token's update as a sequence — `S = exp(g)·S`, then
`S = S + beta·k⊗(v − k·S)` — each assignment seeing the value the one before left. While the resolver reads
the program, a read of state S after its k-th assignment is `StateRef(S, "step k")`, and each assignment's
value is composed with the ones before it (its reads of S replaced by the value they see, written over
S_(t−1)). When the whole program has been read, `settle` writes every read in the two versions the rest of
the compiler knows: a read of the last assignment is S_t ("new"); a read between two assignments is that
intermediate value written out over S_(t−1) (linear in it, so readouts and transitions see an ordinary
expression). The composed update takes the place of the last assignment, so the rest of the compiler sees
one update per state.
"""
from __future__ import annotations

import dataclasses

from . import ir
from .analysis import inline_lets, rebuild, states_in

_STEP = "step "


def _after(count: int) -> str:
    return "prev" if count == 0 else f"{_STEP}{count}"


def _count(version: str) -> int | None:
    return int(version[len(_STEP):]) if version.startswith(_STEP) else None


class StepValues:
    """Each state's value after each of its assignments so far, over S_(t−1)."""

    def __init__(self):
        self.values: dict[str, list[ir.Expr]] = {}

    def assignments(self, state: str) -> int:
        return len(self.values.get(state, ()))

    def version(self, state: str) -> str:
        """The version of a read of `state` at this point of the program."""
        return _after(self.assignments(state))

    def assign(self, state: str, value: ir.Expr) -> ir.Expr:
        """Record an assignment `state = value` (its reads of the state at the version before it) and return
        the composed value: the state after every assignment so far, over S_(t−1)."""
        before = self.assignments(state)
        if before:
            previous = self.values[state][-1]

            def compose(node: ir.Expr) -> ir.Expr:
                if isinstance(node, ir.StateRef) and node.name == state and _count(node.version) == before:
                    return previous
                return node
            value = rebuild(value, compose)
        self.values.setdefault(state, []).append(value)
        return value

    def settle(self, e: ir.Expr) -> tuple[ir.Expr, set[str]]:
        """`e` with every read in the versions "prev" and "new", and the states it reads between two of their
        assignments (whose intermediate values it now holds, written over S_(t−1))."""
        between: set[str] = set()

        def visit(node: ir.Expr) -> ir.Expr:
            count = _count(node.version) if isinstance(node, ir.StateRef) else None
            if count is None:
                return node
            if count == self.assignments(node.name):  # after the last assignment: S_t
                return dataclasses.replace(node, version="new")
            between.add(node.name)
            return rebuild(self.values[node.name][count - 1], visit)
        return rebuild(e, visit), between


def composed_update(program: ir.Program, update: ir.Update) -> ir.Expr:
    """The update as `check` reports it: for one composed from several assignments, with the named values
    that read a state written out (they hold the intermediate values the steps saw)."""
    if len(update.assignments) < 2:
        return update.value
    lets = program.lets

    def visit(node: ir.Expr) -> ir.Expr:
        if isinstance(node, ir.LetRef) and states_in(inline_lets(node, lets)):
            return rebuild(lets[node.name], visit)
        return node
    return rebuild(update.value, visit)
