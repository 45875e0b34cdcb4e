"""The adjoint of a recurrence: its vector–Jacobian product, derived from the statements by reverse-mode
differentiation (docs/gradients.md).

One token's statements run forward in order; their adjoint runs them backwards. Each statement `x = e` is
seeded with the adjoint of x (∂L/∂x: the output's upstream gradient, the named value's accumulated adjoint,
the state's adjoint after the update) and the chain rule walks e from the root to its leaves, where the
contributions accumulate: into the adjoints of inputs, params, named values and states (the version before
or after this token's update, as the statement read it). What is done to a state's adjoint is the transpose
of what the update does to the state — the adjoint recurrence of adjoint.md — without the compiler knowing
any variant: it is only the chain rule over the IR.

The derivative expressions are IR over a few nodes of this module: `GradRef` (an adjoint variable),
`Einsum` (a contraction of element axes, for transposes and sums), `Vjp` (a builtin's vector–Jacobian
product: the backend supplies it, as it supplies the builtin). Points where a builtin has no derivative:
relu and abs at 0 take the subgradient 0, norm at the zero vector the subgradient 0 (as PyTorch does);
sqrt, and a power below 1, at 0 have an infinite slope — the backend's Vjp reports the place when one is
used there with a nonzero upstream gradient —, and so does log at 0 whatever the upstream gradient (0·∞ there:
log(0) = −∞ made finite by what follows), except where log(w) is a term of a softmax's argument, whose weight w
it is: the derivative in w, finite at 0, is taken without the division by w (_Sweep.softmax_of_weights).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..dsl.errors import Span

from . import Compiled, ir
from .analysis import children, inline_lets, product_factors, rebuild, states_in, to_text, walk
from .builtins import SEQUENCE
from .linearity import split_scalar
from .sequence import SequencePlan

_LETTERS = "ijklmnpqrs"


# ---- the nodes of derivative expressions --------------------------------------------------------------
@dataclass(frozen=True)
class GradRef(ir.LetRef):
    """The adjoint of a value, read: kind "output" (the upstream gradient of an output at this token), "let",
    "state" (version "prev" or "new"), "param", "sequence" (of a seq(…) read's argument, gathered over the
    tokens that read it), "quantity" (of a per-token array of the decomposition), or "temp" (a gradient the sweep bound to a name because two
    subexpressions use it). A LetRef so that the IR's analyses treat it as the per-token value it is."""

    kind: str = "temp"
    version: str = ""


@dataclass(frozen=True)
class Einsum(ir.Apply):
    """A contraction over element axes, `spec` in numpy.einsum's notation without the leading axes (which
    broadcast): "ij,j->i" is a matrix–vector product, "ij->ji" a transpose, "ij->" a sum."""

    spec: str = ""


@dataclass(frozen=True)
class Vjp(ir.Apply):
    """The vector–Jacobian product of the builtin `function` at args[0] with upstream gradient args[1] (for
    "pow", args[2] is the exponent; "pow_exponent", the gradient of a^b with respect to b: args (a, g, b, a^b);
    "softmax" with args[2], rest, the gradient with respect to w where args[0] = rest + log(w)): the gradient
    with respect to args[0] (args[2] for "pow_exponent", w for "softmax" with a rest). `site` names the call in the
    program, for the error where the builtin has no derivative."""

    site: str = ""


# ---- the statements of an adjoint ----------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """What a contribution accumulates into: kind "input" | "param" | "let" | "state" (version "prev" or
    "new") | "sequence" (name: the index of a seq(…) read, its gradient at the visible positions) |
    "readout" (name: a readout's index, in a decomposition's outputs)."""

    kind: str
    name: str
    version: str = ""


@dataclass(frozen=True)
class Accumulate:
    """target += value (the backend reduces broadcast axes where the target has fewer)."""

    target: Target
    value: ir.Expr


@dataclass(frozen=True)
class Bind:
    """A temporary: name = value (an upstream gradient that more than one subexpression uses)."""

    name: str
    value: ir.Expr


@dataclass(frozen=True)
class StepAdjoint:
    """The adjoint of one forward statement: its seed (the adjoint of what it assigns) and the statements
    that carry the seed to the leaves."""

    step: ir.Step | ir.Param
    seed: GradRef
    statements: tuple[Accumulate | Bind, ...]


@dataclass(frozen=True)
class SequenceRead:
    """seq(arg) (a program that reads the sequence): arg at every visible position. Its adjoint gathers, for
    each position, the gradients of every token that read it; then they flow into arg, for all tokens."""

    index: int
    arg: ir.Expr


@dataclass(frozen=True)
class Adjoint:
    """A program's adjoint, per token: `loop` — the statements computed token by token (the updates, the
    outputs and the named values that read a state), in reverse order; `hoisted` — the named values that read
    no state, computed for all tokens at once before the loop, in reverse order; `params` — params whose
    defaults are computed from other params, for when their defaults are used, in reverse order. In a
    program that reads the sequence (softmax attention), the named values that read it are inlined into the
    outputs, and `sequences` holds the adjoint of each seq(x)."""

    loop: tuple[StepAdjoint, ...]
    hoisted: tuple[StepAdjoint, ...]
    params: tuple[StepAdjoint, ...]
    hoisted_lets: frozenset[str]
    loop_lets: tuple[str, ...]
    sequences: tuple[StepAdjoint, ...] = ()  # seq(x) reads: their adjoints, run before `hoisted`


def why_no_adjoint(program: ir.Program, sequence: SequencePlan | None) -> str | None:
    """Why the adjoint is not derived for a program (`sequence`: its plan, if it reads the sequence), or
    None."""
    if not program.inputs:
        return "the program has no inputs"
    for prm in program.params:  # (the gradient would flow through the draw: it has no value in the IR)
        nodes = list(walk(prm.default)) if prm.default is not None else []
        if any(isinstance(n, ir.Random) for n in nodes) and any(isinstance(n, ir.ParamRef) for n in nodes):
            return (f"the default of param '{prm.name}' combines a random draw with another param: the gradient "
                    f"through it is not derived (define the draw as a param of its own)")
    return None


def derive(program: ir.Program, source: str = "", filename: str = "") -> Adjoint:
    """The adjoint of a recurrence (see why_no_adjoint), derived from its statements. (For a non-causal one
    the backend runs the outputs' adjoints first, every token reading the final states, then the updates'.)"""
    program = _sequence_reads_inlined(program)
    lets = program.lets
    hoisted = frozenset(n for n, v in lets.items() if not states_in(inline_lets(v, lets)))
    live = _Liveness(lets)
    site = functools.partial(_site, source=source, filename=filename)
    loop, top, sequences = [], [], []
    _sweep = functools.partial(_sweep_statement, sequences=sequences)
    for step in reversed(program.steps):
        if isinstance(step, ir.Let):
            seed = GradRef(step.value.shape, step.name, kind="let")
            adjoint = _sweep(step.value, seed, live, site, step)
            (top if step.name in hoisted else loop).append(adjoint)
        elif isinstance(step, ir.Update):
            seed = GradRef(step.value.shape, step.state, kind="state", version="new")
            loop.append(_sweep(step.value, seed, live, site, step))
        else:
            loop.append(_sweep(step.value, GradRef(step.value.shape, step.name, kind="output"), live, site, step))
    params = []
    for prm in reversed(program.params):
        if prm.default is not None and any(isinstance(n, ir.ParamRef) for n in walk(prm.default)):
            seed = GradRef(prm.shape, prm.name, kind="param")
            params.append(_sweep(prm.default, _fit(seed, prm.default.shape), live, site, prm, seed))
    reads = []
    for i, arg in enumerate(sequences):  # (an argument's own sweep reads no sequence: args are per token)
        seed = GradRef(arg.shape, str(i), kind="sequence")
        reads.append(_sweep(arg, seed, live, site, SequenceRead(i, arg)))
    loop_lets = tuple(n for n in lets if n not in hoisted)
    return Adjoint(tuple(loop), tuple(top), tuple(params), hoisted, loop_lets, tuple(reads))


def _sequence_reads_inlined(program: ir.Program) -> ir.Program:
    """The program with every named value that reads the sequence (seq) inlined where it is used: such a
    value is not per token ([T, *] at each token), so it is recomputed at each token with the outputs."""
    lets = program.lets
    reading = {n for n, v in lets.items() if any(isinstance(x, ir.Apply) and x.function in SEQUENCE
                                                  for x in walk(inline_lets(v, lets)))}
    if not reading:
        return program

    def unfold(e: ir.Expr) -> ir.Expr:
        return rebuild(e, lambda n: unfold(lets[n.name]) if isinstance(n, ir.LetRef) and n.name in reading else n)
    steps = []
    for step in program.steps:
        if isinstance(step, ir.Let) and step.name in reading:
            continue
        steps.append(dataclasses.replace(step, value=unfold(step.value)))
    return dataclasses.replace(program, steps=tuple(steps))


def _site(e: ir.Expr, source: str, filename: str) -> str:
    """Where a builtin is called, for an error message: `sqrt(x)` at FILE:LINE:COL."""
    span: Span | None = e.span
    where = f" at {filename or '<source>'}:{span.line}:{span.column}" if span is not None else ""
    return f"`{to_text(e)}`{where}"


class _Liveness:
    """Which expressions carry a gradient: they read an input, a param, a state or a named value that does."""

    def __init__(self, lets: dict[str, ir.Expr]):
        self.lets = lets
        self.live_lets = {n for n, v in lets.items() if self._reads_leaf(inline_lets(v, lets))}

    @staticmethod
    def _reads_leaf(e: ir.Expr) -> bool:
        return any(isinstance(n, (ir.InputRef, ir.ParamRef, ir.StateRef)) for n in walk(e))

    def __call__(self, e: ir.Expr) -> bool:
        return any(isinstance(n, (ir.InputRef, ir.ParamRef, ir.StateRef, ir.ReadoutRef))
                   or (isinstance(n, ir.LetRef) and n.name in self.live_lets) for n in walk(e))


def _sweep_statement(value: ir.Expr, seed: ir.Expr, live: _Liveness, site, step,
                     named_seed: GradRef | None = None, *, sequences: list[ir.Expr]) -> StepAdjoint:
    sweep = _Sweep(live, site, prefix=_temp_prefix(step), sequences=sequences)
    sweep.grad(value, seed)
    return StepAdjoint(step, named_seed or seed, tuple(sweep.out))


def _temp_prefix(step) -> str:
    if isinstance(step, SequenceRead):
        return f"g_seq{step.index}"
    if isinstance(step, Quantity):
        return "g_" + step.label.replace(".", "_")
    name = step.state if isinstance(step, ir.Update) else step.name
    return f"g_{name}"


# ---- the chain rule ------------------------------------------------------------------------------------
def _arith(op: str, a: ir.Expr, b: ir.Expr) -> ir.Arith:
    return ir.Arith(a.shape or b.shape, op, a, b)


def _neg(a: ir.Expr) -> ir.Expr:
    return a.operand if isinstance(a, ir.Neg) else ir.Neg(a.shape, a)


def _product(factors: list[ir.Expr], shape: ir.Shape) -> ir.Expr:
    out = factors[0]
    for f in factors[1:]:
        out = _arith("mul", out, f)
    return out if out.shape == shape else ir.Arith(shape, "mul", out, ir.Const((), 1.0))


def _summands(e: ir.Expr) -> list[ir.Expr]:
    """e as a sum: its terms through + and − (a subtracted term negated)."""
    if isinstance(e, ir.Arith) and e.op in ("add", "sub"):
        right = _summands(e.right)
        return _summands(e.left) + (right if e.op == "add" else [_neg(t) for t in right])
    return [e]


def _sum(terms: list[ir.Expr]) -> ir.Expr:
    out = terms[0]
    for t in terms[1:]:
        out = _arith("add", out, t)
    return out


def _fit(g: ir.Expr, shape: ir.Shape) -> ir.Expr:
    """The gradient of an operand that broadcast: a scalar operand of a vector operation gets the sum. The sum
    of a product is a contraction of its last two vector factors, the scalar factors outside it
    (Σ_i s·a_i·b_i = s·(a·b)): over [B, T, H, d] arrays the sum then makes no product array of its own; the sum of
    a negated array is the negated sum, the same values bit for bit (negation is exact, the order of the sum the
    same)."""
    if g.shape == shape:
        return g
    if not shape and isinstance(g, ir.Neg):  # (−Σ g, not Σ −g: a pass over [B, T, H] rather than [B, T, H, d])
        return _neg(_fit(g.operand, shape))
    if not shape:
        letters = _LETTERS[:len(g.shape)]
        factors = product_factors(g)
        vectors = [f for f in factors if f.shape == g.shape]
        scalars = [f for f in factors if not f.shape]
        if len(vectors) < 2 or len(vectors) + len(scalars) != len(factors):
            return Einsum((), "einsum", (g,), spec=f"{letters}->")
        head = vectors[0] if len(vectors) == 2 else _product(vectors[:-1], g.shape)
        total = Einsum((), "einsum", (head, vectors[-1]), spec=f"{letters},{letters}->")
        return _product(scalars + [total], ()) if scalars else total
    raise TypeError(f"internal error: a gradient of shape {g.shape} for an operand of shape {shape}")


def _is_name(e: ir.Expr) -> bool:
    """An expression that is no computation to repeat: a temporary would not make the code cheaper."""
    return isinstance(e, (GradRef, ir.Const, ir.InputRef, ir.ParamRef, ir.LetRef, ir.StateRef, ir.DimSize))


class _Sweep:
    def __init__(self, live: _Liveness, site, prefix: str, sequences: list[ir.Expr]):
        self.live, self.site, self.prefix = live, site, prefix
        self.sequences = sequences  # the arguments of seq(…) met so far, shared by the program's sweeps
        self.out: list[Accumulate | Bind] = []

    def shared(self, g: ir.Expr) -> ir.Expr:
        """g bound to a temporary when it is more than a name: two subexpressions use it."""
        if _is_name(g):
            return g
        name = f"{self.prefix}_{sum(isinstance(s, Bind) for s in self.out)}"
        self.out.append(Bind(name, g))
        return GradRef(g.shape, name, kind="temp")

    def grad(self, e: ir.Expr, g: ir.Expr) -> None:
        """Carry the gradient g of e (of e's shape) to e's leaves."""
        if not self.live(e):
            return
        if isinstance(e, ir.InputRef):
            self.out.append(Accumulate(Target("input", e.name), g))
        elif isinstance(e, ir.ParamRef):
            self.out.append(Accumulate(Target("param", e.name), g))
        elif isinstance(e, ir.LetRef):
            self.out.append(Accumulate(Target("let", e.name), g))
        elif isinstance(e, ir.StateRef):
            self.out.append(Accumulate(Target("state", e.name, e.version), g))
        elif isinstance(e, ir.ReadoutRef):  # (the outputs of a decomposition, over its readouts q·S)
            self.out.append(Accumulate(Target("readout", str(e.index)), g))
        elif self.scaled_array(e, g):
            pass
        elif isinstance(e, ir.Neg):
            self.grad(e.operand, _neg(g))
        elif isinstance(e, ir.Arith):
            self.arith(e, g)
        elif isinstance(e, ir.Dot):
            self.dot(e, g)
        elif isinstance(e, ir.Outer):
            self.outer(e, g)
        elif isinstance(e, ir.Diag):
            self.grad(e.operand, Einsum(e.operand.shape, "einsum", (g,), spec="ii->i"))
        elif isinstance(e, ir.Apply):
            self.apply(e, g)
        else:  # Const, DimSize, HeadIndex, HeadCount, Identity, Random: no gradient (and never live)
            raise TypeError(f"internal error: no derivative rule for {type(e).__name__}")

    def scaled_array(self, e: ir.Expr, g: ir.Expr) -> bool:
        """The gradient of c·v — one array v of e's shape scaled by a scalar c that is itself a product, a
        quotient or negated (−e^g·β·kn, a delta rule's correction: c = −(e^g·β); linearity.split_scalar) —
        carried to its leaves, or False where e is no such product. The binary rule would walk the products'
        tree, multiplying g by a scalar at each level and contracting it with v once per level: over [B, T, H, d]
        arrays, a pass each. Here c's gradient is one contraction Σ g⊙v, whose chain rule through c's own tree
        runs per token (no array), and v's is g·c: two passes whatever c."""
        if not e.shape:
            return False
        c, v = split_scalar(e)
        if v.shape != e.shape or not isinstance(c, (ir.Neg, ir.Arith)):
            return False  # (no scalar, or a single one: the binary rule is these two passes already)
        if self.live(c) and self.live(v):
            g = self.shared(g)
        if self.live(c):
            letters = _LETTERS[:len(e.shape)]
            self.grad(c, Einsum((), "einsum", (g, v), spec=f"{letters},{letters}->"))
        self.grad(v, _arith("mul", g, c))
        return True

    def pair(self, e: ir.Expr, g: ir.Expr) -> ir.Expr:
        """g shared when both operands of e carry a gradient."""
        both = sum(self.live(c) for c in (e.left, e.right)) == 2
        return self.shared(g) if both else g

    def arith(self, e: ir.Arith, g: ir.Expr) -> None:
        a, b = e.left, e.right
        g = self.pair(e, g)
        if e.op == "add":
            self.grad(a, _fit(g, a.shape))
            self.grad(b, _fit(g, b.shape))
        elif e.op == "sub":
            self.grad(a, _fit(g, a.shape))
            self.grad(b, _fit(_neg(g), b.shape))
        elif e.op == "mul":
            self.grad(a, _fit(_arith("mul", g, b), a.shape))
            self.grad(b, _fit(_arith("mul", g, a), b.shape))
        elif e.op == "div":
            self.grad(a, _fit(_arith("div", g, b), a.shape))
            # ∂(a/b)/∂b = −(a/b)/b
            self.grad(b, _fit(_neg(_arith("div", _arith("mul", g, e), b)), b.shape))
        elif e.op == "pow":
            # ∂(a^b)/∂a = b·a^(b−1), checked at a = 0 by the backend (an infinite slope for b < 1)
            self.grad(a, _fit(Vjp(e.shape, "pow", (a, g, b), site=self.site(e)), a.shape))
            # ∂(a^b)/∂b = a^b·log(a), and 0 at a = 0 for b ≥ 0 (where a^b·log(a) is 0·(−∞): PyTorch's choice)
            self.grad(b, _fit(Vjp(e.shape, "pow_exponent", (a, g, b, e)), b.shape))
        else:
            raise TypeError(f"internal error: no derivative rule for the operator {e.op}")

    def dot(self, e: ir.Dot, g: ir.Expr) -> None:
        a, b = e.left, e.right
        if not a.shape or not b.shape:  # a scalar scales
            self.arith(ir.Arith(e.shape, "mul", a, b, span=e.span), g)
            return
        if isinstance(a, ir.Identity):
            self.grad(b, g)
            return
        if isinstance(b, ir.Identity):
            self.grad(a, g)
            return
        g = self.pair(e, g)
        if isinstance(a, ir.Diag):  # diag(d)·X scales X's rows: ∂d_i = Σ_j g_ij X_ij, ∂X = diag(d)·g
            rows = Einsum(a.operand.shape, "einsum", (g, b), spec="ij,ij->i") if len(b.shape) == 2 \
                else _arith("mul", g, b)
            self.grad(a.operand, rows)
            self.grad(b, ir.Dot(b.shape, a, g))
            return
        if isinstance(b, ir.Diag):  # X·diag(d) scales X's columns
            cols = Einsum(b.operand.shape, "einsum", (g, a), spec="ij,ij->j") if len(a.shape) == 2 \
                else _arith("mul", g, a)
            self.grad(b.operand, cols)
            self.grad(a, ir.Dot(a.shape, g, b))
            return
        ranks = (len(a.shape), len(b.shape))
        if ranks == (1, 1):  # a·b is a scalar
            self.grad(a, _arith("mul", g, b))
            self.grad(b, _arith("mul", g, a))
        elif ranks == (1, 2):  # (a·B)_j = Σ_i a_i B_ij
            self.grad(a, ir.Dot(a.shape, b, g))
            self.grad(b, ir.Outer(b.shape, a, g))
        elif ranks == (2, 1):  # (A·b)_i = Σ_j A_ij b_j
            self.grad(a, ir.Outer(a.shape, g, b))
            self.grad(b, ir.Dot(b.shape, g, a))
        else:  # numpy.dot: a's last axis with b's first
            la = _LETTERS[:ranks[0]]
            lb = la[-1] + _LETTERS[ranks[0]:ranks[0] + ranks[1] - 1]
            lo = la[:-1] + lb[1:]
            self.grad(a, Einsum(a.shape, "einsum", (g, b), spec=f"{lo},{lb}->{la}"))
            self.grad(b, Einsum(b.shape, "einsum", (a, g), spec=f"{la},{lo}->{lb}"))

    def outer(self, e: ir.Outer, g: ir.Expr) -> None:
        a, b = e.left, e.right
        g = self.pair(e, g)
        if len(a.shape) == 1 and len(b.shape) == 1:
            self.grad(a, ir.Dot(a.shape, g, b))
            self.grad(b, ir.Dot(b.shape, a, g))
            return
        la, lb = _LETTERS[:len(a.shape)], _LETTERS[len(a.shape):len(a.shape) + len(b.shape)]
        self.grad(a, Einsum(a.shape, "einsum", (g, b), spec=f"{la}{lb},{lb}->{la}"))
        self.grad(b, Einsum(b.shape, "einsum", (a, g), spec=f"{la},{la}{lb}->{lb}"))

    def apply(self, e: ir.Apply, g: ir.Expr) -> None:
        if e.function == "seq":  # the gradient at each visible position gathers into that position's
            (x,) = e.args
            if x not in self.sequences:
                self.sequences.append(x)
            self.out.append(Accumulate(Target("sequence", str(self.sequences.index(x))), g))
            return
        if e.function == "lsh_attention":  # a sequence-level op: both gradients from one backward (the backend's)
            q, v = e.args
            g = self.shared(g)
            for x, which in ((q, "q"), (v, "v")):
                self.grad(x, Vjp(x.shape, f"lsh_attention_{which}", (q, v, g), e.options, site=self.site(e)))
            return
        if e.function in SEQUENCE:
            raise TypeError(f"internal error: no derivative rule for {e.function} (why_no_adjoint refuses it)")
        (x,) = e.args
        if e.function == "exp":
            self.grad(x, _arith("mul", g, e))
        elif e.function == "log" and e.span is None:
            # a log the compiler wrote, not the program: a decay given as a value, as its log-decay
            # (transitions.log_of), which no backward takes below the normal range (adjoint_arrays.BelowNormalRange,
            # 0 included): 1/x has no infinite slope to meet there, and stays the division
            self.grad(x, _arith("div", g, x))
        elif e.function == "softmax" and any(self.is_log_weight(t) for t in _summands(x)):
            self.softmax_of_weights(e, g)
        else:  # the backend's vector–Jacobian product of the builtin (log's: 1/x, checked at 0 by the backend)
            self.grad(x, Vjp(x.shape, e.function, (x, g), e.options, site=self.site(e)))

    def is_log_weight(self, term: ir.Expr) -> bool:
        """A term log(w) of a softmax's argument, w carrying a gradient: softmax(s + log(w)) weighs e^s by w."""
        return isinstance(term, ir.Apply) and term.function == "log" and self.live(term)

    def softmax_of_weights(self, e: ir.Apply, g: ir.Expr) -> None:
        """softmax(s + log(w)): the softmax of the scores s weighted by w — an additive log-mask where w = 0, at
        which log(w) is −∞ and the softmax's gradient there 0. Through log the chain rule would divide that 0
        by w = 0, but softmax(s + log(w))_j = w_j·e^(s_j) / Σ w·e^s has a finite derivative in w_j at 0: the
        softmax's gradient divided by w, written without the division — the backend's Vjp "softmax" given the
        sum's other terms (`rest`: s), softmax_j / w_j = e^(s_j − m) / Σ e^(x − m). The other terms take the
        softmax's gradient as ever."""
        (x,) = e.args
        terms = _summands(x)
        weights = [i for i, t in enumerate(terms) if self.is_log_weight(t)]
        others = [t for i, t in enumerate(terms) if i not in weights]
        uses = len(weights) + (bool(others) and self.live(_sum(others)))
        g = self.shared(g) if uses > 1 else g
        if others:
            rest = _sum(others)
            self.grad(rest, _fit(Vjp(x.shape, "softmax", (x, g), e.options, site=self.site(e)), rest.shape))
        for i in weights:
            rest = _sum(terms[:i] + terms[i + 1:]) if len(terms) > 1 else ir.Const((), 0.0)
            (w,) = terms[i].args
            self.grad(w, _fit(Vjp(x.shape, "softmax", (x, g, rest), e.options, site=self.site(e)), w.shape))


# the forms whose backward is derived where the program allows (see why_no_gradient)
GRADIENT_FORMS = ("recurrent", "parallel", "chunkwise")


def why_no_gradient(compiled: Compiled, form: str) -> str | None:
    """Why a gradient form of the program is not derived, or None (a gradient form needs the forward form
    it differentiates)."""
    d = compiled.decomposition
    if form not in d.forms:
        return f"there is no {form} forward form: {d.why_not(form)}"
    reason = why_no_adjoint(compiled.program, d.sequence)
    if reason:
        return reason
    if form != "recurrent":
        return why_no_decomposed_adjoint(compiled, form)
    return None


# ---- the adjoint over the decomposition: the parallel and chunkwise backward ------------------------------
# For a state whose update is a decay plus rank-one corrections and writes, read by readouts q·S, the adjoint is
# again such a recurrence, run in reverse: a backend runs it as a masked product inside a chunk, with the adjoint
# state passed from chunk to chunk (adjoint.md; corrections through the transposed UT transform). What is left
# is the chain rule from the outputs to the readouts, and from the per-token arrays of the decomposition
# (log-decay, keys, values, corrections' u and w, queries) to the inputs and params: sweeps over those
# expressions, for all tokens at once.
@dataclass(frozen=True)
class Quantity:
    """A per-token array of the decomposition: what its adjoint seeds (`label`: "S.log_decay",
    "S.value_log_decay" — of S·diag(e^m) —, "S.key0", "S.value0", "S.correction0_u" and "S.correction0_w" — of a
    correction u ⊗ (w·S_(t−1)) —, "S.value_correction0_a" and "S.value_correction0_b" — of a value-side one
    (D·S_(t−1)·a) ⊗ b —, "r1" — a readout's query) and the expression it is computed from."""

    label: str
    value: ir.Expr
    also: tuple[str, ...] = ()  # the labels of the other arrays computed from the same expression

    @property
    def name(self) -> str:
        return ", ".join((self.label,) + self.also)


@dataclass(frozen=True)
class DecomposedAdjoint:
    """outputs: each output's adjoint, over the readouts (seeding their adjoints, kind "readout") and the
    values that read no state; quantities: the sweep of each per-token array's adjoint (kind "quantity")
    into the inputs, params and named values; hoisted and params as in Adjoint."""

    outputs: tuple[StepAdjoint, ...]
    quantities: tuple[StepAdjoint, ...]
    hoisted: tuple[StepAdjoint, ...]
    params: tuple[StepAdjoint, ...]
    hoisted_lets: frozenset[str]


def why_no_decomposed_adjoint(compiled: Compiled, form: str) -> str | None:
    """Why the parallel or chunkwise backward (a decay plus rank-one corrections and writes, run in reverse) is
    not derived for a program, or None."""
    d = compiled.decomposition
    if d.sequence is not None:
        return f"the {form} backward of attention over the sequence is not derived"
    for t in d.transitions:  # (an elementwise decay: its own scan, or, with corrections, a state per column; in
        # the transposed convention the same on Sᵀ, as the forward forms carry it)
        if t.elementwise and t.value_log_decay is not None:
            return f"'{t.state}' decays elementwise (`X*{t.state}`) beside a decay of its value axis: the {form} " \
                   f"backward of that is not derived"
    if any(r.is_value and len(compiled.program.state(r.state).shape) != 1 for r in d.readouts):
        return f"an output reads a state as a value (not q·S): the {form} backward of that is not derived"
    return None


def derive_over_readouts(compiled: Compiled, outputs, quantities, refold=lambda e: e,
                         sequences: tuple[ir.Expr, ...] = ()) -> tuple[tuple[StepAdjoint, ...], tuple[StepAdjoint, ...]]:
    """The adjoints of outputs written over readouts ((name, expression); a ReadoutRef seeds the readout's adjoint,
    Target kind "readout") and of arrays the backend computes for all tokens ((label, expression): seeded by
    GradRef kind "quantity"), each by the chain rule into the inputs, params and named values, and into the
    sequence reads (`sequences`: the seq(…) arguments in the order of derive()'s, for a program that reads the
    sequence). `refold`: the backend's folding of inlined named values back to their names."""
    live = _Liveness(compiled.program.lets)
    site = functools.partial(_site, source=compiled.source, filename=compiled.filename)
    sweep = functools.partial(_sweep_statement, sequences=list(sequences))
    swept_outputs = []
    for name, expr in reversed(outputs):
        value = refold(expr)
        swept_outputs.append(sweep(value, GradRef(value.shape, name, kind="output"), live, site,
                                   ir.Output(name, value)))
    # Arrays computed from the same expression (the linear transformer's φ(k), key of S and of its normalizer z)
    # are one sweep, seeded by the sum of their adjoints: the chain rule through the expression — elu's slope,
    # a random-feature map's product — once, not once per array.
    labels_of: dict[ir.Expr, list[str]] = {}
    for label, expr in quantities:
        labels_of.setdefault(refold(expr), []).append(label)  # (IR nodes compare without their spans)
    swept = []
    for value, labels in labels_of.items():
        seeds = [GradRef(value.shape, label, kind="quantity") for label in labels]
        swept.append(sweep(value, _sum(seeds), live, site, Quantity(labels[0], value, tuple(labels[1:])),
                           named_seed=seeds[0]))
    return tuple(swept_outputs), tuple(swept)


def constant_factor(query: ir.Expr) -> tuple[ir.Expr | None, ir.Expr]:
    """A readout's query as (its constant factor, the rest): the product of its scalar factors written with
    numbers and dimensions' sizes alone (`dk^(−1/2)` of `dk^(−1/2)·q`: the same at every token and head, and for
    every call of the sizes a kernel is built for), and the product of its other factors. (None, query) where it
    has no such factor, or nothing else. A backend's kernel that multiplies by the factor itself takes the rest
    as the readout's query array (derive_decomposed's `query_of`)."""
    def sizes_only(e: ir.Expr) -> bool:
        return not e.shape and all(isinstance(n, (ir.Const, ir.DimSize)) for n in walk(e) if not children(n))
    factors = product_factors(query)
    constant = [f for f in factors if sizes_only(f)]
    rest = [f for f in factors if not sizes_only(f)]
    if not constant or not rest:
        return None, query
    return _product(constant, ()), _product(rest, query.shape)


def derive_decomposed(compiled: Compiled, refold=lambda e: e, query_of=None,
                      factors_of=lambda t: None, decay_of=lambda t: None) -> DecomposedAdjoint:
    """The adjoint of a program's outputs over its readouts, and of its decomposition's per-token arrays (see
    why_no_decomposed_adjoint). `refold`: the backend's folding of inlined named values back to their names;
    `query_of`: the expression of a readout's query array (None: its query; a backend whose kernel applies a
    constant factor itself gives the rest, constant_factor); `factors_of`: a transition's key-side vectors as
    its backward takes them, factored (compiler.key_factors.KeyFactors), or None: each slot's own array. A
    factored slot's arrays are labelled "<slot>.scale" (where it has a scalar) and "<slot>.base" (its owner).
    `decay_of`: a transition's elementwise log-decay as its backward takes it, factored
    (compiler.decay_factors.DecayFactors), or None: one array; a factored one's arrays are labelled
    "<state>.log_decay.rate" (the same for every token: its gradient comes summed over them) and
    "<state>.log_decay.step"."""
    program, d = compiled.program, compiled.decomposition
    lets = program.lets
    hoisted = frozenset(n for n, v in lets.items() if not states_in(inline_lets(v, lets)))
    live = _Liveness(lets)
    site = functools.partial(_site, source=compiled.source, filename=compiled.filename)
    sweep = functools.partial(_sweep_statement, sequences=[])
    labelled = []

    def quantity(label: str, expr: ir.Expr | None):
        if expr is not None:
            labelled.append((label, expr))

    def key_side(label: str, expr: ir.Expr, slot, bases):  # (slot None: the vector as one array)
        if slot is None:
            quantity(label, expr)
            return
        quantity(f"{label}.scale", slot.scale)
        if slot.owner:
            quantity(f"{label}.base", bases[slot.base])
    for t in d.transitions:
        decay = decay_of(t)
        if decay is None:
            quantity(f"{t.state}.log_decay", t.log_decay)
        else:
            quantity(f"{t.state}.log_decay.rate", decay.rate)
            quantity(f"{t.state}.log_decay.step", decay.step)
        quantity(f"{t.state}.value_log_decay", t.value_log_decay)  # (S·diag(e^m); None: the columns do not decay)
        f = factors_of(t)
        bases = f.bases if f else ()
        for j, (key, value) in enumerate(t.writes):
            key_side(f"{t.state}.key{j}", key, f and f.writes[j], bases)
            quantity(f"{t.state}.value{j}", value)
        for j, (u, w) in enumerate(t.corrections):  # + u ⊗ (w·S_(t−1)): the UT transform's backward seeds them
            key_side(f"{t.state}.correction{j}_u", u, f and f.corrections[j][0], bases)
            key_side(f"{t.state}.correction{j}_w", w, f and f.corrections[j][1], bases)
        for j, (a, b) in enumerate(t.value_corrections):  # + (D·S_(t−1)·a) ⊗ b: Sᵀ's key-side corrections
            quantity(f"{t.state}.value_correction{j}_a", a)
            quantity(f"{t.state}.value_correction{j}_b", b)
    for r in d.readouts:
        quantity(f"r{r.index}", r.query if query_of is None else query_of(r))
    outputs, quantities = derive_over_readouts(compiled, d.outputs, labelled, refold)
    # (a named value nothing differentiates through has no adjoint to carry: one whose every use is taken as
    # another array by the backend's scans — the C backward's kernel normalizing l2norm(x) itself, say — gets none)
    reached = {s.target.name for adj in (*outputs, *quantities) for s in adj.statements
               if isinstance(s, Accumulate) and s.target.kind == "let"}
    top = []
    for step in reversed(program.steps):  # (a later value's adjoint reaches the earlier ones it reads)
        if isinstance(step, ir.Let) and step.name in hoisted and step.name in reached:
            top.append(sweep(step.value, GradRef(step.value.shape, step.name, kind="let"), live, site, step))
            reached |= {s.target.name for s in top[-1].statements
                        if isinstance(s, Accumulate) and s.target.kind == "let"}
    chained = derive(program, compiled.source, compiled.filename).params
    return DecomposedAdjoint(outputs, quantities, tuple(top), chained, hoisted)
