"""The typed, immutable IR of a linrec program.

Expressions are frozen dataclasses carrying their element shape: a tuple of dimension names, `()` for a
scalar. Leading axes (batch, time, head) are implicit: what an expression varies over is derived from
what it references (see `compiler.analysis`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl.errors import Span

Shape = tuple[str, ...]


@dataclass(frozen=True)
class Expr:
    shape: Shape
    span: Span | None = field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class Const(Expr):
    value: float


@dataclass(frozen=True)
class DimSize(Expr):
    """The size of a dimension, as a scalar (e.g. `dk^(−1/2)`)."""

    dim: str


@dataclass(frozen=True)
class HeadIndex(Expr):
    """`h`, the index of the head (0..H−1), for per-head parameter defaults."""


@dataclass(frozen=True)
class HeadCount(Expr):
    """`H`, the number of heads of the call, for parameter defaults (ALiBi's slopes 2^(−8·(h + 1)/H))."""


@dataclass(frozen=True)
class InputRef(Expr):
    name: str


@dataclass(frozen=True)
class ParamRef(Expr):
    name: str
    per_head: bool


@dataclass(frozen=True)
class StateRef(Expr):
    """A state's value at this point of the token's statements: "prev" (S_(t−1)) or "new" (S_t)."""

    name: str
    version: str


@dataclass(frozen=True)
class LetRef(Expr):
    """A named intermediate value defined earlier by `name = expr`."""

    name: str


@dataclass(frozen=True)
class ReadoutRef(Expr):
    """The result of readout number `index` (only in derived forms: see compiler.decompose)."""

    index: int


@dataclass(frozen=True)
class Apply(Expr):
    """A builtin function: elementwise (exp, elu, …), vector → vector (l2norm, groupnorm, …) or
    vector → scalar (sum, norm). `options` holds keyword constants such as eps."""

    function: str
    args: tuple[Expr, ...]
    options: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Neg(Expr):
    operand: Expr


@dataclass(frozen=True)
class Arith(Expr):
    """Elementwise add, sub, mul, div, pow; a scalar operand broadcasts."""

    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Dot(Expr):
    """`a·b` with numpy.dot semantics: contracts a's last axis with b's first; a scalar scales."""

    left: Expr
    right: Expr


@dataclass(frozen=True)
class Outer(Expr):
    left: Expr
    right: Expr


@dataclass(frozen=True)
class Diag(Expr):
    operand: Expr


@dataclass(frozen=True)
class Identity(Expr):
    """`I`, shape (n, n)."""


@dataclass(frozen=True)
class Random(Expr):
    """A seeded random array for a parameter's default (only in param defaults)."""

    kind: str  # "normal" | "uniform"
    seed: int
    options: tuple[tuple[str, float], ...] = ()


# ---- program ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dim:
    name: str
    default: int


@dataclass(frozen=True)
class Input:
    name: str
    shape: Shape
    low: float | None = None
    high: float | None = None
    low_open: bool = True
    high_open: bool = True


@dataclass(frozen=True)
class Param:
    name: str
    shape: Shape
    per_head: bool
    default: Expr | None
    span: Span | None = field(default=None, compare=False, repr=False)  # its declaration


@dataclass(frozen=True)
class State:
    name: str
    shape: Shape
    span: Span | None = field(default=None, compare=False, repr=False)  # its declaration


@dataclass(frozen=True)
class Let:
    name: str
    value: Expr


@dataclass(frozen=True)
class Update:
    """The state's update for one token. A state assigned in steps has one Update, their composition
    (compiler.steps); `assignments` are where each step is written."""

    state: str
    value: Expr
    span: Span | None = field(default=None, compare=False, repr=False)
    assignments: tuple[Span, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Output:
    name: str
    value: Expr


Step = Let | Update | Output


@dataclass(frozen=True)
class Program:
    name: str
    causal: bool
    dims: tuple[Dim, ...]
    inputs: tuple[Input, ...]
    params: tuple[Param, ...]
    states: tuple[State, ...]
    steps: tuple[Step, ...]

    def state(self, name: str) -> State:
        return next(s for s in self.states if s.name == name)

    @property
    def outputs(self) -> tuple[Output, ...]:
        return tuple(s for s in self.steps if isinstance(s, Output))

    @property
    def lets(self) -> dict[str, Expr]:
        return {s.name: s.value for s in self.steps if isinstance(s, Let)}

    @property
    def updates(self) -> dict[str, Update]:
        return {s.state: s for s in self.steps if isinstance(s, Update)}
