"""The chunkwise (flash-attention) backward of softmax attention as a NumPy module (docs/gradients.md), for the
programs whose every use of the sequence is softmax(K·q)·V with K and V computed from the sequence alone and q
per token (sequence.kernel_support, as the parallel backward's).

The forward computes, per softmax readout, the query q_t [B, T, H, dk] and the keys and values at every
position [B, T, H, *] (their sequence expressions, once), then attention by query blocks against key blocks
with an online softmax, keeping each query's log-sum-exp (attention.flash_attention). The backward: the
outputs' adjoints into the readouts' (the chain rule over the outputs' expressions, for all tokens at once);
each readout's flash backward (attention.flash_attention_backward: the probabilities of each block
recomputed from the scores and the log-sum-exp, D = rowsum(∂O ⊙ O)); then the chain rule from ∂q, ∂K and ∂V
into the query's and the sequence expressions' inputs — ∂K and ∂V at every position gather into the
gradient of each seq(x) they read — and, as the recurrent backward ends, from seq(x) into x, the hoisted
values and the params. Memory: one block of scores, [B, C, H, C], beside the per-token arrays.
"""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.adjoint import Accumulate, GradRef, derive_over_readouts
from .adjoint import AdjointPrinter, BackwardEmitter
from .adjoint_attention import pad_sequence_param_grads
from .sequence import BLOCK, cut_sequence_params, kernel_pattern, kernel_support, positions


def why_no_flash_attention_backward(compiled: Compiled) -> str | None:
    """Why the chunkwise backward of a program that reads the sequence is not derived here, or None."""
    unsupported = kernel_support(compiled)
    if unsupported:
        return f"the chunkwise backward of attention is derived for softmax(K·q)·V over the sequence only: {unsupported}"
    return None


class FlashAttentionEmitter(BackwardEmitter):
    """The recurrent backward's names and the chain rule's sweeps, around flash attention and its backward
    (the helpers flash_attention and flash_attention_backward, imported from `modules`: linrec.c's emitter
    points them at its kernels)."""

    form = "chunkwise"

    def __init__(self, compiled: Compiled):
        super().__init__(compiled)
        em = self.em
        self.plan = compiled.decomposition.sequence
        self.readout_vars, self.arrays, self.seeds = {}, {}, {}
        for r in self.plan.softmax_readouts:
            i = r.index
            self.readout_vars[i] = em.fresh(f"r{i}")
            self.d[("readout", str(i))] = em.fresh(f"d_r{i}")
            # the readout's query, keys and values, its log-sum-exp, and their adjoints
            self.arrays[i] = {what: em.fresh(f"{what}{i}") for what in
                              ("query", "keys", "values", "lse", "d_query", "d_keys", "d_values")}
        quantities = []  # (label, expression): each readout's query, and its keys and values over the sequence
        for r in self.plan.softmax_readouts:
            keys, query, values = kernel_pattern(r)
            for what, e in (("query", query), ("keys", keys), ("values", values)):
                self.seeds[f"r{r.index}.{what}"] = (r.index, what)
                quantities.append((f"r{r.index}.{what}", e))
        # (the seq(…) reads indexed as the recurrent backward's, whose names and tail this module shares; their
        # arguments refolded as the swept expressions are, or seq(l2norm(k)) beside kn = l2norm(k) is not found)
        self.output_sweeps, self.quantity_sweeps = derive_over_readouts(
            compiled, self.plan.outputs, quantities, em.refold,
            tuple(em.refold(a.step.arg) for a in self.adjoint.sequences))

    def sequence_printer(self):
        """Sequence expressions over every position, [B, 1, H, T, *] (the query axis of size 1)."""
        base = self.em.printer(None)

        def seq(arg: ir.Expr) -> str:
            # (arg as the refolded keys and values print it: a named value, kn = l2norm(k), in place of its
            # expression — seq(l2norm(k)) reads the sequence of kn)
            index = next(a.step.index for a in self.adjoint.sequences
                         if arg in (a.step.arg, self.em.refold(a.step.arg)))
            return f"{self.seq_vars[index][0]}[:, None]"
        return AdjointPrinter(base.ref, lambda g: self.grad_name(g, None), seq)

    def grad_name(self, g: GradRef, token_index):
        if g.kind == "quantity":
            index, what = self.seeds[g.name]
            code = self.arrays[index][f"d_{what}"]
            # (the keys' and values' adjoints at every position, as their expressions print: [B, 1, H, T, *])
            return code if what == "query" else f"np.swapaxes({code}, 1, 2)[:, None]"
        return super().grad_name(g, token_index)

    def accumulate(self, s: Accumulate, printer, token_index, final_reads=False) -> str:
        if s.target.kind == "readout":
            return f"{self.d[('readout', s.target.name)]} += {printer(s.value)}"
        if s.target.kind == "sequence":  # the gradient at every position, [B, 1, H, T, *] → the sequence's
            d = self.seq_vars[int(s.target.name)][1]
            return f"{d} += np.broadcast_to({printer(s.value)}, (batch, 1) + {d}.shape[1:])[:, 0]"
        return super().accumulate(s, printer, token_index, final_reads)

    def body(self) -> list[str]:
        em, p, n = self.em, self.p, self.em.name
        prelude = self.printer(None)
        over = self.sequence_printer()
        body = em.prologue() + cut_sequence_params(em) + [f"causal = {p.causal}"]
        body += em.hoisted_lets(prelude, "per-token values, for all tokens at once")
        body += ["", "# the sequence, head-major [B, H, T, *]: what seq(x) reads"]
        for adj in self.adjoint.sequences:
            body.append(f"{self.seq_vars[adj.step.index][0]} = np.swapaxes({prelude(adj.step.arg)}, 1, 2)")
        body += self.block_lines()
        for r in self.plan.softmax_readouts:
            keys, query, values = kernel_pattern(r)
            a, readout = self.arrays[r.index], self.readout_vars[r.index]
            body += ["", f"# {readout} = softmax(K·q)·V: its query, its keys and values at every position [B, T, H, *]",
                     f"{a['keys']} = np.swapaxes(np.broadcast_to({over(em.refold(keys))}, (batch, 1, heads, "
                     f"{positions(self.em, keys)}, {n(keys.shape[-1])}))[:, 0], 1, 2)",
                     f"{a['values']} = np.swapaxes(np.broadcast_to({over(em.refold(values))}, (batch, 1, heads, "
                     f"{positions(self.em, values)}, {n(values.shape[-1])}))[:, 0], 1, 2)",
                     f"{a['query']} = np.broadcast_to({prelude(em.refold(query))}, (batch, tokens, heads, "
                     f"{n(query.shape[-1])}))",
                     self.attend(a, readout)]
        self.helpers |= set(self.kernels)
        out = em.printer(None, readout_vars=self.readout_vars)
        body += ["", "# outputs from the readouts"]
        for name, expr in self.plan.outputs:
            o = next(x for x in p.outputs if x.name == name)
            dims = "".join(", " + n(x) for x in o.value.shape)
            body.append(f"{n(name)} = np.broadcast_to({out(em.refold(expr))}, (batch, tokens, heads{dims})).astype(dtype)")
        self.helpers |= out.helpers
        body += ["outputs = {" + ", ".join(f"\"{o.name}\": {n(o.name)}" for o in p.outputs) + "}",
                 "final_state = {}"]
        body += self.adjoint_arrays()
        body += [f"{d} = np.zeros_like({var})" for var, d in self.seq_vars.values()]
        body += [f"{self.d[('readout', str(i))]} = np.zeros_like({var})" for i, var in self.readout_vars.items()]
        readouts = AdjointPrinter(out.ref, lambda g: self.grad_name(g, None))
        for adj in self.output_sweeps:
            body += self.step_adjoint(adj, readouts, None)
        body += ["", self.backward_comment]
        for i, a in self.arrays.items():
            body.append(f"{a['d_query']}, {a['d_keys']}, {a['d_values']} = {self.attend_backward(i, a)}")
        body += ["", "# the query's, keys' and values' adjoints into their expressions"]
        for adj in self.quantity_sweeps:
            body += self.step_adjoint(adj, prelude if adj.step.label.endswith(".query") else over, None)
        tail = pad_sequence_param_grads(self, self.tail(prelude))
        self.helpers |= prelude.helpers | over.helpers | readouts.helpers
        return body + tail

    # ---- the attention and its backward: flash attention's (a subclass calls other kernels) ----
    kernels = ("flash_attention", "flash_attention_backward")
    backward_comment = "# each readout's flash backward: the blocks' probabilities recomputed from the log-sum-exp"

    def block_lines(self) -> list[str]:
        return ["", f"block = chunk_size or {BLOCK}  # query and key blocks"]

    def attend(self, a: dict, readout: str) -> str:
        """The line computing a readout from its query, keys and values (and what its backward keeps)."""
        return (f"{readout}, {a['lse']} = flash_attention({a['query']}, {a['keys']}, {a['values']}, causal, "
                f"{self.plan.window}, block)")

    def attend_backward(self, index: int, a: dict) -> str:
        """The call giving a readout's ∂query, ∂keys, ∂values from its adjoint."""
        return (f"flash_attention_backward({a['query']}, {a['keys']}, {a['values']}, {self.readout_vars[index]}, "
                f"{a['lse']}, {self.d[('readout', str(index))]}, causal, {self.plan.window}, block)")


def emit_flash_attention_backward(compiled: Compiled) -> str:
    """The chunkwise backward of softmax attention (see why_no_flash_attention_backward)."""
    return FlashAttentionEmitter(compiled).render()
