"""The parallel backward of softmax attention as a NumPy module (docs/gradients.md): the recurrent (KV-cache)
backward's statements — the same adjoint (compiler.adjoint) — printed for every token at once over the
masked score matrix, as the parallel forward prints the forward (sequence.py): seq(x) is x at every position
[B, 1, H, T, *], a softmax over the sequence is masked by visibility (causal, window), and so is the
vector–Jacobian product of that softmax (an invisible position has probability 0, hence gradient 0). Each
token's gradient at the positions it sees, [B, T, H, T, *], is masked and summed over the tokens into the
gradient of the sequence.

That is the standard attention backward — dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)), dQ = dS·K,
dK = dSᵀ·Q, dV = Pᵀ·dO — found by the chain rule, for programs whose every use of the sequence is softmax(K·q)·V with
K and V computed from the sequence alone (sequence.kernel_support): there, every value over the sequence
axis that reaches a gradient passes through the masked softmax, so the masks above are all it needs. Memory:
the [B, T, H, T] score matrix, as the parallel forward's.
"""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.adjoint import Accumulate, Vjp
from ..compiler.builtins import SEQ
from .adjoint import AdjointPrinter, BackwardEmitter
from .printer import ATOM, NumpyPrinter
from .sequence import SequencePrinter, cut_sequence_params, kernel_support


def why_no_parallel_attention_backward(compiled: Compiled) -> str | None:
    """Why the parallel backward of a program that reads the sequence is not derived here, or None."""
    unsupported = kernel_support(compiled)
    if unsupported:
        return (f"the parallel backward of attention is derived for softmax(K·q)·V over the sequence only: "
                f"{unsupported}")
    return None


class _ParallelPrinter(AdjointPrinter, SequencePrinter):
    """AdjointPrinter's derivative expressions with SequencePrinter's masks, all tokens at once; the softmax's
    vector–Jacobian product over the sequence sees the invisible scores as −∞."""

    def __init__(self, ref, grad, seq, masked: bool, lsh: str, lsh_vjp: str):
        NumpyPrinter.__init__(self, ref)  # (the two parents' own initialisers take different arguments)
        self.grad, self.seq, self.seq_code = grad, seq, seq
        # (AdjointPrinter's token: none, every token at once — a point without a derivative is named at its
        # index in the [B, T, H, *] array, or [B, T, H, T, *] over the keys, as the recurrent backward names it)
        self.token = None
        self.visible = "visible" if masked else "None"
        self.lsh, self.lsh_vjp = lsh, lsh_vjp  # lsh_attention's forward and its vector–Jacobian product
        self.masked = masked

    def _p(self, e: ir.Expr):
        if isinstance(e, Vjp) and e.function in ("lsh_attention_q", "lsh_attention_v"):
            # (one backward gives both gradients; each is printed as its part)
            self.helpers.add(self.lsh_vjp)
            opts = "".join(f", {k}={int(v)}" for k, v in e.options)
            return (f"{self.lsh_vjp}({', '.join(self(a) for a in e.args)}, causal{opts})"
                    f"[{0 if e.function.endswith('_q') else 1}]"), ATOM
        if isinstance(e, Vjp) and e.function == "softmax" and e.args[0].shape[:1] == (SEQ,) and self.masked:
            self.helpers.add("vjp_softmax")
            # (the scores, and the scores without their log-weights where the gradient is a weight's: compiler.
            # adjoint's softmax_of_weights; the gradient, args[1], is not masked)
            args = [f"np.where(visible, {self(a)}, -np.inf)" if i != 1 else self(a) for i, a in enumerate(e.args)]
            return f"vjp_softmax({', '.join(args)})", ATOM
        return super()._p(e)


class ParallelAttentionEmitter(BackwardEmitter):
    """The recurrent backward's names and adjoint statements, printed for every token at once."""

    form = "parallel"
    # lsh_attention's forward and its vector–Jacobian product: the dense (parallel) form's
    lsh, lsh_vjp = "lsh_attention_dense", "vjp_lsh_attention"

    def __init__(self, compiled: Compiled):
        super().__init__(compiled)
        plan = compiled.decomposition.sequence
        self.window = plan.window
        self.masked = compiled.program.causal or bool(plan.window)

    def printer(self, token_index):
        base = self.em.printer(None)

        def seq(arg: ir.Expr) -> str:
            index = next(a.step.index for a in self.adjoint.sequences if a.step.arg == arg)
            return f"{self.seq_vars[index][0]}[:, None]"
        return _ParallelPrinter(base.ref, lambda g: self.grad_name(g, None), seq, self.masked, self.lsh, self.lsh_vjp)

    def accumulate(self, s: Accumulate, printer, token_index, final_reads=False) -> str:
        if s.target.kind != "sequence":
            return super().accumulate(s, printer, token_index, final_reads)
        # every token's gradient at every position [B, T, H, T, *]: the positions it does not see masked, then
        # summed over the tokens into the sequence's [B, H, T, *]
        d = self.seq_vars[int(s.target.name)][1]
        full = f"np.broadcast_to({printer(s.value)}, (batch, tokens) + {d}.shape[1:])"
        if self.masked:
            read = next(a.step for a in self.adjoint.sequences if a.step.index == int(s.target.name))
            extra = len(read.arg.shape)  # (the axes after the position's: visible is [1, T, 1, T])
            full = f"np.where(visible{'[..., None]' * extra}, {full}, 0.0)"
        return f"{d} += np.sum({full}, axis=1)"

    def body(self) -> list[str]:
        em, p, n = self.em, self.p, self.em.name
        printer = self.printer(None)
        body = em.prologue() + cut_sequence_params(em) + [f"causal = {p.causal}"]
        body += em.hoisted_lets(printer, "per-token values, for all tokens at once")
        body += ["", "# the sequence, head-major [B, H, T, *]: what seq(x) reads"]
        for adj in self.adjoint.sequences:
            body.append(f"{self.seq_vars[adj.step.index][0]} = np.swapaxes({printer(adj.step.arg)}, 1, 2)")
        body += ["", "# which keys each query sees: [1, T, 1, T] (None: all)",
                 f"visible = visible_positions(tokens, causal, window={self.window})"]
        self.helpers.add("visible_positions")
        body += ["", "# the forward: every query against every key it sees"]
        for step in p.steps:
            if isinstance(step, ir.Output):
                body.append(f"{n(step.name)} = {printer(step.value)}")
        body += ["outputs = {" + ", ".join(f"\"{o.name}\": {n(o.name)}" for o in p.outputs) + "}",
                 "final_state = {}"]
        body += self.adjoint_arrays()
        body += [f"{d} = np.zeros_like({var})" for var, d in self.seq_vars.values()]
        body += ["", "# every token's adjoint at once, over the masked score matrix"]
        for adj in self.adjoint.loop:
            body += self.step_adjoint(adj, printer, None)
        tail = pad_sequence_param_grads(self, self.tail(printer))
        self.helpers |= printer.helpers
        return body + tail


def pad_sequence_param_grads(emitter: BackwardEmitter, tail: list[str]) -> list[str]:
    """The backward's tail with the gradients of the params over the sequence axis padded back to their
    shape: a call cut them to the first T positions (cut_sequence_params), so their gradient is 0 beyond."""
    pads = [f"{emitter.d[('param', prm.name)]} = pad_to({emitter.d[('param', prm.name)]}, "
            f"np.shape(params[\"{prm.name}\"]))" for prm in emitter.p.params if SEQ in prm.shape]
    if not pads:
        return tail
    emitter.helpers.add("pad_to")
    return tail[:-3] + ["", "# params over the sequence axis: zero beyond the positions this call used"] + pads + tail[-3:]


def emit_parallel_attention_backward(compiled: Compiled) -> str:
    """The parallel backward of softmax attention (see why_no_parallel_attention_backward)."""
    return ParallelAttentionEmitter(compiled).render()


class BucketedLshEmitter(ParallelAttentionEmitter):
    """The chunkwise backward of a program that reads the sequence through lsh_attention: the parallel
    backward's module (as the chunkwise forward of such a program is the parallel one's) with lsh_attention in
    its bucketed form and that form's backward by blocks, the buckets held fixed."""

    form = "chunkwise"

    lsh, lsh_vjp = "lsh_attention_bucketed", "vjp_lsh_attention_bucketed"


def emit_bucketed_lsh_backward(compiled: Compiled) -> str:
    """The chunkwise backward of a program whose sequence is read through lsh_attention (see
    why_no_parallel_attention_backward: the same programs)."""
    return BucketedLshEmitter(compiled).render()
