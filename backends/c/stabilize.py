"""Exponential feature maps in the fused C kernel (forms.md §8): a state whose write keys are c·exp(α), α
varying per token (FAVOR+'s exp(W·x − ‖x‖²/2)/√m), is carried as S·exp(−σ), σ the running maximum M of
its exponents — the NumPy scans' stabilization (linrec.numpy.derived), taken one token at a time:

    M_t = max(M_(t−1), max α_t),   σ_t = M_t,   S̃_t = exp(σ_(t−1) − σ_t)·S̃_(t−1) + c·exp(α_t − σ_t) ⊗ v_t

so every key factor is ≤ 1 and the rescale exp(σ_(t−1) − σ_t) ≤ 1 is one more scalar decay, applied lazily
like any other. A query c·exp(β) is read as c·exp(β − μ_t), μ_t = max β_t; readout r then carries the
log-scale σ + μ (σ_(t−1) before the update), which cancels in ratios such as (φ(q)·S)/(φ(q)·z) and is
multiplied back into every other output. States with the same exponents share σ (S and z of Performer).

The caller's log-scale ("S.log_scale", [B, H]) comes in and goes out beside the states: NaN means a state at
its true scale (σ = 0, M = −∞; σ = −∞ for a state that is all zero, whose first rescale then multiplies no
zero by ∞). Non-causal programs keep the NumPy-prepared scans."""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.analysis import rebuild, variance
from ..compiler.linearity import ONE
from ..compiler.transitions import split_exp

from .printer import CPrinter, Local
from ..compiler.stabilize import log_scale_keys, scale_degree, stabilized_states


def _exp_minus(alpha: ir.Expr, shift: str) -> ir.Expr:
    """exp(α − shift), shift a scalar C local of the kernel"""
    return ir.Apply(alpha.shape, "exp", (ir.Arith(alpha.shape, "sub", alpha, Local((), shift)),))


def _times(c: ir.Expr, e: ir.Expr, shape) -> ir.Expr:
    return e if c == ONE else ir.Arith(shape, "mul", c, e)


class Scales:
    """The stabilized states of one program and what the generator needs of them: rewritten transitions and
    queries, the per-token lines that move σ, and the outputs with their scales put back where they do not
    cancel. C names: ls{g}/mx{g} σ and M of group g (carried per head), lsp{g} σ before the token, lsd{g}
    the log of its rescale, mu{j} the maximum of query exponent j, rsc{i} (blk_rsc{i}[u]) readout i's
    log-scale, lsc{g} the caller's [B, H] log-scales."""

    def __init__(self, compiled: Compiled):
        p, d = compiled.program, compiled.decomposition
        stable = stabilized_states(compiled) if p.causal else {}
        keys = log_scale_keys(compiled)
        self.groups: list[dict] = []  # {"alphas", "states" (names, program order), "key" ("S.log_scale")}
        self.group_of: dict[str, int] = {}
        for st in p.states:
            if st.name not in stable:
                continue
            g = next((i for i, gr in enumerate(self.groups) if gr["alphas"] == stable[st.name]), None)
            if g is None:
                g = len(self.groups)
                self.groups.append({"alphas": stable[st.name], "states": [], "key": keys[st.name]})
            self.groups[g]["states"].append(st.name)
            self.group_of[st.name] = g
        self.betas: list[ir.Expr] = []  # query exponents, each with its per-token maximum mu{j}
        self.queries: dict[int, ir.Expr] = {}  # readout index → its query with mu factored out
        self.scale_of: dict[int, str] = {}  # readout index → the C code of its log-scale
        for r in d.readouts:
            g = self.group_of.get(r.state)
            if g is None:
                continue
            scale = f"lsp{g}" if r.before_update else f"ls{g}"
            c, beta = split_exp(r.query) if not r.is_value else (None, None)
            if beta is not None and variance(beta) == "token":
                if beta not in self.betas:
                    self.betas.append(beta)
                mu = f"mu{self.betas.index(beta)}"
                self.queries[r.index] = _times(c, _exp_minus(beta, mu), r.query.shape)
                scale += f" + {mu}"
            self.scale_of[r.index] = scale

    def __bool__(self) -> bool:
        return bool(self.groups)

    def exponents(self) -> list[ir.Expr]:
        """Every exponent whose maximum the kernel takes (for CPrinter.expect: each is then computed once)."""
        return [a for gr in self.groups for a in gr["alphas"]] + self.betas

    def transition(self, tr) -> tuple[ir.Expr | None, tuple]:
        """(decay, writes) of a state's update as the kernel runs it: a stabilized state's decay times its
        rescale exp(σ_(t−1) − σ_t), its keys c·exp(α − σ_t)."""
        g = self.group_of.get(tr.state)
        if g is None:
            return tr.decay, tr.writes
        rescale = ir.Apply((), "exp", (Local((), f"lsd{g}"),))
        decay = rescale if tr.decay is None else ir.Arith(tr.decay.shape, "mul", tr.decay, rescale)
        writes = []
        for key, value in tr.writes:
            c, alpha = split_exp(key)
            writes.append((_times(c, _exp_minus(alpha, f"ls{g}"), key.shape), value))
        return decay, tuple(writes)

    def query(self, r) -> ir.Expr | None:
        return self.queries.get(r.index, r.query)

    def outputs(self, outputs, block: bool) -> tuple[list, list[int]]:
        """The outputs with exp(scale) multiplied back into every readout of a stabilized state, except
        where the scales cancel (ratios); and the readouts whose scales the outputs read."""
        done, needed = [], []
        for name, e in outputs:
            degrees = scale_degree(e, self.scale_of)
            if not self.scale_of or (degrees is not None and not any(degrees.values())):
                done.append((name, e))
                continue

            def put_back(node):
                if isinstance(node, ir.ReadoutRef) and node.index in self.scale_of:
                    if node.index not in needed:
                        needed.append(node.index)
                    where = f"blk_rsc{node.index}[u]" if block else f"rsc{node.index}"
                    # times exp(scale/2), twice: exp(scale) alone overflows float from 88.7 on, where the
                    # readout (at most 1 per unit of its vectors) times it may not (an exp(ig) write gate of
                    # 95 gave ∞ and NaN long after the state had decayed back into range)
                    half = ir.Apply((), "exp", (ir.Arith((), "mul", ir.Const((), 0.5), Local((), where)),))
                    return ir.Arith(node.shape, "mul", ir.Arith(node.shape, "mul", node, half), half)
                return node
            done.append((name, rebuild(e, put_back)))
        return done, needed

    def token_lines(self, pr: CPrinter, needed: list[int], block: bool) -> list[str]:
        """One token's lines, before anything that reads σ: the running maxima, σ and its rescale, the
        queries' maxima and the readouts' log-scales (into block arrays when `block`)."""
        lines = []
        for g, gr in enumerate(self.groups):
            lines.append(f"/* {', '.join(gr['states'])}: stored times exp(−σ), σ = ls{g} the running maximum of their "
                         f"key exponents */")
            maxima = [self._max(pr, a, f"amax{g}_{n}") for n, a in enumerate(gr["alphas"])]
            lines += pr.take_token() + [f"const T lsp{g} = ls{g};  /* σ before this token */"]
            lines += [f"if ({m} > mx{g}) mx{g} = {m};" for m in maxima]
            lines += [f"ls{g} = mx{g};", f"const T lsd{g} = lsp{g} - ls{g};  /* the rescale exp(σ_(t−1) − σ_t) ≤ 1 "
                      f"(> 1 only from a state given at its true scale) */"]
        for j, beta in enumerate(self.betas):
            self._max(pr, beta, f"mu{j}")
            lines += pr.take_token()
        for i in needed:
            lines.append(f"blk_rsc{i}[u] = {self.scale_of[i]};" if block else f"const T rsc{i} = {self.scale_of[i]};")
        return lines

    @staticmethod
    def _max(pr: CPrinter, e: ir.Expr, name: str) -> str:
        """`name`, a C local the printer's token lines set to the largest element of e (e for a scalar)."""
        code = pr.scalar(e) if not e.shape else f"lr_max_row({pr.array(e)}, {pr.size(e.shape[0])})"
        pr.token.append(f"const T {name} = {code};")
        return name
