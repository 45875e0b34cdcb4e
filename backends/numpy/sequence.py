"""NumPy forms of programs that read the sequence (compiler.sequence): softmax attention and relatives.

* parallel: every query against every key at once, masked by visibility (causal, window);
* recurrent: token by token over a KV cache — the keys and values of the visible positions;
* chunkwise: query blocks against key blocks with an online softmax (flash attention); for lsh_attention,
  the bucketed O(T log T) form.
"""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.analysis import children, rebuild, walk
from ..compiler.builtins import SEQ
from ..compiler.sequence import applications

from .emitter import NUMPY_MODULES, Emitter  # the shared pieces of every NumPy module
from .printer import ATOM, NumpyPrinter

BLOCK = 64  # query and key block of the chunkwise form, unless chunk_size is given
# what the compiled kernels' module (linrec.c.attention) provides in place of NumPy's attention
KERNELS = frozenset({"attention", "lsh_attention_dense", "lsh_attention_bucketed"})
# The placeholder for a masked value while its expression prints: a name no program can define (DSL names are
# identifiers), so that it never stands for a user's value of the same name
MASKED = "<masked>"


# reductions over the sequence axis that divide by its length: over the keys a query sees, by their count
MASKED_STATISTICS = {"mean": "masked_mean", "rmsnorm": "masked_rmsnorm", "groupnorm": "masked_groupnorm"}


class SequencePrinter(NumpyPrinter):
    """Prints seq(x) through `seq_code`, masks contractions and softmaxes over the sequence axis."""

    def __init__(self, ref, seq_code, visible: str, lsh: str):
        super().__init__(ref)
        self.seq_code = seq_code
        self.visible = visible
        self.lsh = lsh

    def _apply(self, e: ir.Apply):
        opts = dict(e.options)
        if e.function == "seq":
            return self.seq_code(e.args[0]), ATOM
        if e.function == "lsh_attention":
            self.helpers.add(self.lsh)
            q, v = (self(a) for a in e.args)
            return (f"{self.lsh}({q}, {v}, causal, buckets={int(opts['buckets'])}, rounds={int(opts['rounds'])}, "
                    f"chunk={int(opts['chunk'])}, seed={int(opts['seed'])})"), ATOM
        if e.shape[:1] == (SEQ,) or (e.args and e.args[0].shape[:1] == (SEQ,)):
            if e.function == "softmax":
                self.helpers.add("masked_softmax")
                return f"masked_softmax({self(e.args[0])}, {self.visible})", ATOM
            if e.function in MASKED_STATISTICS and e.args[0].shape == (SEQ,):
                # a mean over the sequence axis counts the keys the query sees, not every key
                helper = MASKED_STATISTICS[e.function]
                self.helpers.add(helper)
                opts = "".join(f", {k}={v!r}" for k, v in e.options)
                return f"{helper}({self(e.args[0])}, {self.visible}{opts})", ATOM
            if e.function in ("sum", "mean", "norm", "l2norm", "groupnorm", "rmsnorm"):
                self.helpers.add("mask")
                inner = ir.LetRef(e.args[0].shape, MASKED)
                code = f"mask({self(e.args[0])}, {self.visible})"
                saved = self.ref
                self.ref = lambda n: code if isinstance(n, ir.LetRef) and n.name == MASKED else saved(n)
                try:
                    return super()._apply(ir.Apply(e.shape, e.function, (inner,), e.options))
                finally:
                    self.ref = saved
        if e.function == "softmax":
            self.helpers.add("softmax")
            return f"softmax({self(e.args[0])})", ATOM
        return super()._apply(e)

    def _dot(self, e: ir.Dot):
        left = e.left
        if left.shape == (SEQ,) and not (isinstance(left, ir.Apply) and left.function == "softmax") \
                and self.visible != "None":
            self.helpers.add("mask")
            masked = ir.LetRef(left.shape, MASKED)
            code = f"mask({self(left)}, {self.visible})"
            saved = self.ref
            self.ref = lambda n: code if isinstance(n, ir.LetRef) and n.name == MASKED else saved(n)
            try:
                return super()._dot(ir.Dot(e.shape, masked, e.right))
            finally:
                self.ref = saved
        return super()._dot(e)


def kernel_pattern(readout) -> tuple[ir.Expr, ir.Expr, ir.Expr] | None:
    """softmax(K·g)·V with K and V sequences that do not depend on the query token and g a per-token
    query vector: (K, g, V) for a compiled attention kernel, else None."""
    found = _scaled_dot(readout.scores)
    if found is None:
        return None
    (keys, query), values = found, readout.values
    if len(keys.shape) != 2 or len(values.shape) != 2:
        return None
    if applications(query, "seq"):
        return None

    def sequence_only(e):  # every per-token reference sits inside seq(…)
        if isinstance(e, ir.Apply) and e.function == "seq":
            return True
        if isinstance(e, (ir.InputRef, ir.LetRef)):
            return False
        return all(sequence_only(c) for c in children(e))
    return (keys, query, values) if sequence_only(keys) and sequence_only(values) else None


def _scaled_dot(scores: ir.Expr) -> tuple[ir.Expr, ir.Expr] | None:
    """(K, g) when the scores are K·q times scalars that do not read the sequence (`dk^(−1/2)·(seq(k)·q)`,
    `−(seq(k)·q)/tau`): g is q with those scalars applied, so that K·g are the same scores. None otherwise."""
    if isinstance(scores, ir.Dot) and len(scores.left.shape) == 2 and len(scores.right.shape) == 1:
        return scores.left, scores.right
    if isinstance(scores, ir.Neg):
        inner = _scaled_dot(scores.operand)
        return inner and (inner[0], ir.Neg(inner[1].shape, inner[1], span=scores.span))
    dividing = isinstance(scores, ir.Arith) and scores.op == "div"
    if not (isinstance(scores, ir.Dot) or dividing or (isinstance(scores, ir.Arith) and scores.op == "mul")):
        return None
    # (scalar, the scaled scores, whether the scalar is written first); a quotient's scalar is its divisor
    sides = [(scores.right, scores.left, False)] if dividing else \
        [(scores.left, scores.right, True), (scores.right, scores.left, False)]
    for scalar, scaled, first in sides:
        if scalar.shape or applications(scalar, "seq"):
            continue
        inner = _scaled_dot(scaled)
        if inner is None:
            return None
        keys, q = inner
        operands = (scalar, q) if first else (q, scalar)
        return keys, ir.Arith(q.shape, "div" if dividing else "mul", *operands, span=scores.span)
    return None


def kernel_support(compiled: Compiled) -> str | None:
    """Why compiled attention kernels cannot run this program (None: they can)."""
    plan = compiled.decomposition.sequence
    if plan is None:
        return "not a sequence-level program"
    for r in plan.softmax_readouts:  # (lsh_attention beside them too: one program, one glue)
        if kernel_pattern(r) is None:
            return ("a softmax readout is not of the form softmax(K·q)·V with K, V sequences and q a per-token "
                    "vector")
    if any(n for _, e in plan.outputs for n in walk(e) if SEQ in n.shape and not isinstance(n, ir.ReadoutRef)):
        return "the sequence is used outside softmax(K·q)·V"
    return None


def emit(compiled: Compiled, form: str, kernels: str | None = None) -> str:
    """kernels: None for NumPy code throughout; a module name (linrec.c.attention) whose attention and
    lsh_attention_* functions run the sequence part."""
    if kernels is not None:
        return _emit_with_kernels(compiled, form, kernels)

    em = Emitter(compiled)
    p, plan, n, fresh = em.p, compiled.decomposition.sequence, em.name, em.fresh
    body, base = _prologue(em)
    exprs = [e for _, e in plan.outputs] + [r.scores for r in plan.softmax_readouts] \
        + [r.values for r in plan.softmax_readouts]
    seq_vars, lines = _sequence_arrays(em, base, exprs)
    body += lines
    window = plan.window
    lsh = "lsh_attention_bucketed" if form == "chunkwise" else "lsh_attention_dense"
    helpers: set[str] = set(base.helpers)

    def printer(token_index, seq_slice, visible, readouts=None):
        inner = em.printer(token_index, readout_vars=readouts)
        pr = SequencePrinter(inner.ref, lambda arg: seq_slice(seq_vars[arg]), visible, lsh)
        return pr

    if form == "parallel" or plan.kind == "lsh" or (form == "chunkwise" and plan.kind != "attention"):
        pr = printer(None, lambda var: f"{var}[:, None]", "visible")
        body += ["", "# which keys each query sees: [1, T, 1, T] (None: all)",
                 f"visible = visible_positions(tokens, causal, window={window})"]
        helpers.add("visible_positions")
        body += ["", "# outputs"]
        for name, expr in plan.outputs:
            out = next(o for o in p.outputs if o.name == name)
            body.append(f"{n(name)} = {pr(em.refold(_restore(expr, plan)))}"
                        + f"  # {name} [B, T, H{''.join(', ' + d for d in out.value.shape)}]")
        helpers |= pr.helpers
    elif form == "recurrent":
        pr = printer("t", lambda var: f"{var}[:, :, keys]", "None")
        body += em.output_alloc()
        lo, hi = visible_slice(p.causal, window)
        body += ["", "# the KV cache: the keys and values of the positions each token sees",
                 "for t in range(first, tokens):", f"    keys = slice({lo}, {hi})"]
        for name, expr in plan.outputs:
            body.append(f"    {n(name)}[:, t] = {pr(em.refold(_restore(expr, plan)))}")
        body += ["if first:  # a decode step: only the new tokens' outputs"]
        body += [f"    {n(o.name)} = {n(o.name)}[:, first:]" for o in p.outputs]
        helpers |= pr.helpers
    else:  # chunkwise attention: blocked online softmax
        readout_vars = {r.index: fresh(f"r{r.index}") for r in plan.softmax_readouts}
        body += ["", "# query blocks against key blocks, keeping a running max, denominator and accumulator",
                 f"block = chunk_size or {BLOCK}"]
        for r in plan.softmax_readouts:
            sc = printer("queries", lambda var: f"{var}[:, None, :, keys]", "None")
            scores, values = sc(em.refold(r.scores)), sc(em.refold(r.values))
            helpers |= sc.helpers
            width = "".join(", " + n(d) for d in r.values.shape[1:])
            # a scalar per position (seq(v) of a scalar v): an axis of one for the accumulator, which
            # online_softmax_step contracts as values [..., keys, dv]
            scalar = not r.values.shape[1:]
            if scalar:
                values = f"{values}[..., None]"
            first = f"max(0, start - {window - 1})" if window else "0"
            last = "stop" if p.causal else (f"min(tokens, stop + {window - 1})" if window else "tokens")
            readout = readout_vars[r.index]
            body += [
                f"{readout} = np.empty((batch, tokens, heads{width}), dtype=dtype)",
                "for start in range(0, tokens, block):",
                "    stop = min(start + block, tokens)",
                "    queries = slice(start, stop)",
                "    m = np.full((batch, stop - start, heads), -np.inf, dtype=dtype)",
                "    l = np.zeros((batch, stop - start, heads), dtype=dtype)",
                f"    acc = np.zeros((batch, stop - start, heads{', 1' if scalar else width}), dtype=dtype)",
                f"    for key_start in range({first}, {last}, block):",
                f"        keys = slice(key_start, min(key_start + block, {last}))",
                f"        visible = visible_positions(tokens, causal, {window}, start, stop, keys.start, keys.stop)",
                f"        scores = {scores}",
                "        if visible is not None:",
                "            scores = np.where(visible, scores, -np.inf)",
                f"        m, l, acc = online_softmax_step(m, l, acc, scores, {values})",
                f"    {readout}[:, queries] = " + ("acc[..., 0] / l" if scalar else "acc / l[..., None]"),
            ]
        helpers |= {"visible_positions", "online_softmax_step"}
        out = em.printer(None, readout_vars=readout_vars)
        body += ["", "# outputs"]
        for name, expr in plan.outputs:
            body.append(f"{n(name)} = {out(em.refold(expr))}")
        helpers |= out.helpers
    body += ["", em.returns()]
    return em.render(form, body, helpers)


def _emit_with_kernels(compiled: Compiled, form: str, kernels: str) -> str:
    """Per-token values in NumPy, the attention itself in compiled kernels."""
    em = Emitter(compiled)
    plan, n, fresh = compiled.decomposition.sequence, em.name, em.fresh
    body, base = _prologue(em)
    seq_vars, lines = _sequence_arrays(em, base, [e for r in plan.softmax_readouts for e in (r.scores, r.values)])
    body += lines
    lsh = "lsh_attention_bucketed" if form == "chunkwise" else "lsh_attention_dense"
    seq_printer = SequencePrinter(em.printer(None).ref, lambda arg: f"{seq_vars[arg]}[:, None]", "None", lsh)
    helpers: set[str] = set(base.helpers)
    readout_vars = {}
    for r in plan.softmax_readouts:
        keys, query, values = kernel_pattern(r)
        readout = readout_vars[r.index] = fresh(f"r{r.index}")
        k, v, q = (fresh(f"{what}{r.index}") for what in ("keys", "values", "query"))
        # a sequence expression prints as [B, 1, H, Tk, *] (an expression of constants or params alone in some
        # axis: broadcast to it): drop the query axis, back to [B, Tk, H, *]
        body += ["", f"# {readout} = softmax(K·q)·V over the visible keys, in a compiled kernel"]
        for name, e in ((k, keys), (v, values)):
            whole = f"(batch, 1, heads, {positions(em, e)}, {n(e.shape[-1])})"
            body.append(f"{name} = np.swapaxes(np.broadcast_to({seq_printer(em.refold(e))}, {whole})[:, 0], 1, 2)")
        body += [f"{q} = np.broadcast_to({base(em.refold(query))}, (batch, tokens, heads, {k}.shape[-1]))",
                 f"{readout} = attention(np.ascontiguousarray({q}[:, first:], dtype=dtype), "
                 f"np.ascontiguousarray({k}, dtype=dtype), np.ascontiguousarray({v}, "
                 f"dtype=dtype), causal, {plan.window}, \"{form}\", chunk_size, query_offset=first)",
                 "if first:  # a decode step over a KV cache: the new tokens' queries only (the rest is not read)",
                 f"    {readout} = np.concatenate([np.zeros((batch, first) + {readout}.shape[2:], dtype=dtype), "
                 f"{readout}], axis=1)"]
    out = SequencePrinter(em.printer(None, readout_vars=readout_vars).ref, lambda arg: "", "None", lsh)
    body += ["", "# outputs"]
    for name, expr in plan.outputs:
        body.append(f"{n(name)} = {out(em.refold(expr))}")
    if kernels_decode_over_cache(compiled):
        body += ["if first:  # a decode step: only the new tokens' outputs"]
        body += [f"    {n(o.name)} = {n(o.name)}[:, first:]" for o in compiled.program.outputs]
    body += ["", em.returns()]
    helpers |= seq_printer.helpers | out.helpers | base.helpers
    if plan.softmax_readouts:
        helpers.add("attention")  # (written out above: the compiled kernel)
    return em.render(form, body, helpers, {kernels: KERNELS, **NUMPY_MODULES})


def positions(em, e: ir.Expr) -> str:
    """The code of the number of positions of a sequence expression [positions, *]: T, or a dim's size
    (Linformer's E·seq(k) has kproj)."""
    first = e.shape[0]
    return "tokens" if first == SEQ else em.name(first)


def visible_slice(causal: bool, window: int) -> tuple[str, str]:
    """The code of the first and the end position token t sees (its KV cache: `keys = slice(lo, hi)`)."""
    lo = f"max(0, t - {window - 1})" if window else "0"
    if causal:
        return lo, "t + 1"
    return lo, (f"min(tokens, t + {window})" if window else "tokens")


def kernels_decode_over_cache(compiled: Compiled) -> bool:
    """Whether the kernel glue computes only tokens first… (forward(first=…), a decode step over a KV
    cache): softmax attention runs the new queries alone; Reformer's LSH hashes and sorts the whole
    sequence, so its decode stays on the NumPy KV-cache form."""
    return compiled.decomposition.sequence.kind != "lsh"


def _prologue(em):
    """Inputs, sizes and params bound; params over the sequence axis cut to its length; per-token values.
    Returns (lines, the printer over all tokens)."""
    p = em.p
    body = em.prologue() + cut_sequence_params(em)
    body.append(f"causal = {p.causal}")
    base = em.printer(None)
    body += em.hoisted_lets(base, "per-token values, for all tokens at once")
    return body, base


def cut_sequence_params(em) -> list[str]:
    """Params over the sequence axis cut to this sequence's length (their first T positions)."""
    lines = []
    for prm in em.p.params:
        if SEQ in prm.shape:
            axis = prm.shape.index(SEQ) + (1 if prm.per_head else 0)
            lines.append(f"{em.name(prm.name)} = {em.name(prm.name)}[{', '.join([':'] * axis + [':tokens'])}]  "
                         f"# the first T positions of {prm.name}")
    return lines


def _sequence_arrays(em, base, exprs) -> tuple[dict[ir.Expr, str], list[str]]:
    """Every distinct seq(x) argument in `exprs`, head-major [B, H, T, *]: (argument → variable, lines). The
    arguments are keyed as the printers meet them: refolded, a named value (`kn = l2norm(k)`) by its name."""
    seq_vars: dict[ir.Expr, str] = {}
    for expr in exprs:
        for node in walk(expr):
            arg = em.refold(node.args[0]) if isinstance(node, ir.Apply) and node.function == "seq" else None
            if arg is not None and arg not in seq_vars:
                label = em.name(arg.name) if isinstance(arg, (ir.InputRef, ir.LetRef)) else f"x{len(seq_vars)}"
                seq_vars[arg] = em.fresh(f"{label}_seq")
    if not seq_vars:
        return seq_vars, []
    return seq_vars, ["", "# the sequence, head-major [B, H, T, *]: what seq(x) reads"] + [
        f"{var} = np.swapaxes({base(arg)}, 1, 2)" for arg, var in seq_vars.items()]


def _restore(expr: ir.Expr, plan) -> ir.Expr:
    """Put the softmax readouts back in (the parallel and recurrent forms evaluate them directly)."""
    by_index = {r.index: r for r in plan.softmax_readouts}

    def back(node):
        if isinstance(node, ir.ReadoutRef) and node.index in by_index:
            r = by_index[node.index]
            soft = ir.Apply(r.scores.shape, "softmax", (r.scores,))
            return ir.Dot(node.shape, soft, r.values)
        return node
    return rebuild(expr, back)


