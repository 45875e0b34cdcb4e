"""The recurrent backward of a recurrence as a NumPy module: the adjoint the compiler derives from the
statements (compiler.adjoint), printed as a reverse sweep over the tokens.

The forward runs the statements as written and keeps the states every `segment` tokens (checkpoints);
the backward then goes through the segments from the last, recomputes the states of one segment from its
checkpoint, and runs the tokens' adjoints in reverse: memory O(T/C + C) states for a segment of C tokens.
The values that read no state are computed for all tokens at once, before the loops, and their adjoints
after them, for all tokens at once again.
"""
from __future__ import annotations

from ..compiler import Compiled, ir
from ..compiler.adjoint import Accumulate, Adjoint, Einsum, GradRef, SequenceRead, StepAdjoint, Vjp, derive
from ..compiler.analysis import to_text, walk
from ..templating import environment
from ..version import VERSION
from .emitter import NUMPY_MODULES, Emitter, imports, source_comment
from .sequence import visible_slice
from .printer import ATOM, NumpyPrinter
from .vjp import HELPERS

VJP, ADJOINT_SCAN = "linrec.numpy.vjp", "linrec.numpy.adjoint_scan"
ADJOINT_SCANS = frozenset({"decay_scan", "decay_scan_backward"})  # the parallel and chunkwise backward's
MODULES = NUMPY_MODULES | {VJP: HELPERS, ADJOINT_SCAN: ADJOINT_SCANS}
_SITED = {"sqrt", "pow", "log"}  # the Vjps that check for a point without a derivative and name the place


class AdjointPrinter(NumpyPrinter):
    """NumpyPrinter for derivative expressions: adjoints by name (`grad(node)`), contractions as einsum with
    the leading axes broadcast, builtins' vector–Jacobian products as calls of linrec.numpy.vjp."""

    def __init__(self, ref, grad, seq=None, token: str | None = None):
        super().__init__(ref)
        self.grad = grad
        self.seq = seq  # seq(x) → the code of x at the visible positions (programs that read the sequence)
        self.token = token  # the token's index where the code runs token by token ([B, H, *] arrays), else None

    def _p(self, e: ir.Expr):
        if isinstance(e, GradRef):
            return self.grad(e), ATOM
        if isinstance(e, ir.Apply) and e.function == "seq":
            return self.seq(e.args[0]), ATOM
        if isinstance(e, Einsum):
            inputs, output = e.spec.split("->")
            spec = ",".join("..." + s for s in inputs.split(",")) + "->..." + output
            return f"np.einsum('{spec}', {', '.join(self(a) for a in e.args)})", ATOM
        if isinstance(e, Vjp):
            helper = f"vjp_{e.function}"
            self.helpers.add(helper)
            if e.function in ("pow", "pow_exponent"):  # elementwise with a scalar base or exponent: align the axes
                rank = len(e.shape)
                args = ", ".join(self._expand(a, rank) or self(a) for a in e.args)
            else:
                args = ", ".join(self(a) for a in e.args)
            args += "".join(f", {k}={float(v)!r}" for k, v in e.options)
            if e.function in _SITED:
                args += f", site={e.site!r}" + (f", token={self.token}" if self.token else "")
            return f"{helper}({args})", ATOM
        return super()._p(e)


class BackwardEmitter:
    """The recurrent backward's module: names (each adjoint `d_x`, the states before the update `S_prev`),
    printers, the statements' adjoints as lines, and the module's body. adjoint_derived's emitter of the
    parallel and chunkwise backward builds on it (and linrec.c.grad's on that one)."""

    modules = MODULES  # where the generated module imports its helpers from
    form = "recurrent"  # the gradient form this module is (its docstring says so)
    # whether body() calls fused_forward, which the module then defines (to give None) so that it runs on its
    # own: linrec's loader replaces it (linrec.numpy.adjoint_derived.DecomposedEmitter.fused_forward)
    calls_fused_forward = False

    def __init__(self, compiled: Compiled):
        self.c = compiled
        self.em = em = Emitter(compiled)
        self.p = em.p
        self.adjoint: Adjoint = derive(self.p, compiled.source, compiled.filename)
        self.helpers: set[str] = set()
        n = em.name
        # names of this module's own: the adjoints, the previous states, the checkpoints
        self.prev = {s.name: em.fresh(f"{n(s.name)}_prev") for s in self.p.states}
        self.d = {}
        for kind, names in (("input", [x.name for x in self.p.inputs]), ("param", [p.name for p in self.p.params]),
                            ("let", list(self.p.lets)), ("output", [o.name for o in self.p.outputs])):
            for name in names:
                self.d[(kind, name)] = em.fresh(f"d_{n(name)}")
        for s in self.p.states:
            self.d[("state", s.name, "new")] = em.fresh(f"d_{n(s.name)}")
            self.d[("state", s.name, "prev")] = em.fresh(f"d_{n(s.name)}_prev")
        self.temps: dict[str, str] = {}
        self.segment, self.checkpoints, self.before = em.fresh("segment"), em.fresh("checkpoints"), \
            em.fresh("states_before")
        self.per_token_lets = em.per_token
        # programs that read the sequence: each seq(x) argument head-major [B, H, T, *], and its adjoint
        self.seq_vars = {}
        for adj in self.adjoint.sequences:
            arg = adj.step.arg
            label = n(arg.name) if isinstance(arg, (ir.InputRef, ir.LetRef)) else f"x{adj.step.index}"
            self.seq_vars[adj.step.index] = (em.fresh(f"{label}_seq"), em.fresh(f"d_{label}_seq"))

    # ---- printers ----
    def printer(self, token_index: str | None) -> AdjointPrinter:
        base = self.em.printer(token_index)
        prev = self.prev

        def ref(node: ir.Expr) -> str:
            if isinstance(node, ir.StateRef):
                return prev[node.name] if node.version == "prev" else self.em.name(node.name)
            return base.ref(node)

        def seq(arg: ir.Expr) -> str:
            index = next(a.step.index for a in self.adjoint.sequences if a.step.arg == arg)
            return f"{self.seq_vars[index][0]}[:, :, keys]"
        return AdjointPrinter(ref, lambda g: self.grad_name(g, token_index), seq, token_index)

    def grad_name(self, g: GradRef, token_index: str | None) -> str:
        if g.kind == "temp":
            return self.temps.setdefault(g.name, self.em.fresh(g.name))
        if g.kind == "state":
            return self.d[("state", g.name, g.version)]
        if g.kind == "sequence":  # (read for all tokens at once: back to [B, T, H, *])
            return f"np.swapaxes({self.seq_vars[int(g.name)][1]}, 1, 2)"
        name = self.d[(g.kind, g.name)]
        at = f"[:, {token_index}]" if token_index else ""
        if g.kind == "output" or (g.kind == "let" and g.name in self.per_token_lets and g.name in
                                  self.adjoint.hoisted_lets):
            return name + at
        return name

    # ---- statements ----
    def token_forward(self, printer, with_outputs: bool, with_updates: bool = True) -> list[str]:
        """One token's statements with both versions of each state named: S_prev (before this token's update)
        and S (after it). The caller binds S_prev first."""
        n, lines = self.em.name, []
        for step in self.p.steps:
            if isinstance(step, ir.Let) and step.name not in self.adjoint.hoisted_lets:
                lines.append(f"{n(step.name)} = {printer(step.value)}")
            elif isinstance(step, ir.Update) and with_updates:
                lines.append(f"{n(step.state)} = {printer(step.value)}")
            elif isinstance(step, ir.Output) and with_outputs:
                lines.append(f"{n(step.name)}[:, t] = {printer(step.value)}")
        self.helpers |= printer.helpers
        return lines

    def step_adjoint(self, adj: StepAdjoint, printer: AdjointPrinter, token_index: str | None,
                     final_reads: bool = False) -> list[str]:
        """The adjoint statements of one forward statement. final_reads: the statement read the final states
        (a non-causal program's outputs), whatever version it names: their adjoints go to the final states'."""
        step = adj.step
        if isinstance(step, SequenceRead):
            what = f"seq({to_text(step.arg)}), gathered over the tokens that read each position"
        elif isinstance(step, ir.Update):
            what = f"{step.state} = {to_text(step.value)}"
        elif isinstance(step, ir.Param):
            what = f"param {step.name} = {to_text(step.default)}"
        else:
            what = f"{step.name} = {to_text(step.value)}"
        lines = [f"# adjoint of {what}"]
        for s in adj.statements:
            if isinstance(s, Accumulate):
                lines.append(self.accumulate(s, printer, token_index, final_reads))
            else:
                lines.append(f"{self.grad_name(GradRef(s.value.shape, s.name), token_index)} = {printer(s.value)}")
        self.helpers |= printer.helpers
        return lines if len(lines) > 1 else []

    def accumulate(self, s: Accumulate, printer: AdjointPrinter, token_index: str | None,
                   final_reads: bool = False) -> str:
        t, value = s.target, printer(s.value)
        at = f"[:, {token_index}]" if token_index else ""
        if t.kind == "state":
            return f"{self.d[('state', t.name, 'new' if final_reads else t.version)]} += {value}"
        if t.kind == "sequence":  # this token's gradient at the positions it sees
            return f"{self.seq_vars[int(t.name)][1]}[:, :, keys] += {value}"
        name = self.d[(t.kind, t.name)]
        if t.kind == "let" and t.name not in self.adjoint.hoisted_lets:
            return f"{name} += {value}"  # a value that reads a state: this token's, [B, H, *]
        if t.kind == "input" or (t.kind == "let" and t.name in self.per_token_lets):
            return f"{name}{at} += {value}"
        if isinstance(s.value, ir.Outer):  # (W of W·x: a matrix product over the tokens, not an array per token)
            self.helpers.add("outer_sum")
            return f"{name} += outer_sum({printer(s.value.left)}, {printer(s.value.right)}, {name}.shape)"
        self.helpers.add("unbroadcast")  # a param, or a value fixed per head: summed over what it broadcast along
        return f"{name} += unbroadcast({value}, {name}.shape)"

    # ---- the module ----
    def adjoint_arrays(self) -> list[str]:
        """The adjoints' arrays: of the outputs (given), the inputs, the params, the values computed for all
        tokens."""
        p, n = self.p, self.em.name
        body = ["", "# adjoints: of the outputs (given), the inputs, the params and the values computed for all tokens"]
        for o in p.outputs:
            body.append(f"{self.d[('output', o.name)]} = grad_outputs[\"{o.name}\"]")
        for x in p.inputs:
            body.append(f"{self.d[('input', x.name)]} = np.zeros_like({n(x.name)})")
        for prm in p.params:
            body.append(f"{self.d[('param', prm.name)]} = np.zeros(np.shape({n(prm.name)}), dtype)")
        swept = {adj.step.name for adj in self.adjoint.hoisted}  # (a value nothing differentiates through: none)
        for name in p.lets:
            if name in self.adjoint.hoisted_lets and name in swept:
                shape = f"np.shape({n(name)})" if name not in self.per_token_lets else \
                    "(batch, tokens, heads" + "".join(", " + n(d) for d in p.lets[name].shape) + ")"
                body.append(f"{self.d[('let', name)]} = np.zeros({shape}, dtype)")
        return body

    def tail(self, prelude: AdjointPrinter) -> list[str]:
        """After the token loops: the sequence reads', the hoisted values' and the params' adjoints, for all
        tokens at once; the gradients returned."""
        p, body = self.p, []
        reads = [x for adj in self.adjoint.sequences for x in self.step_adjoint(adj, prelude, None)]
        if reads:
            body += ["", "# the sequence's positions, each with the gradients of every token that read it"] + reads
        top = [x for adj in self.adjoint.hoisted for x in self.step_adjoint(adj, prelude, None)]
        if top:
            body += ["", "# the values that do not depend on a state, for all tokens at once"] + top
        if self.adjoint.params:
            body += ["", "# params whose default is computed from other params: where the default was used, "
                         "the gradient flows on"] + self.param_chain()
        grads = [f"\"{x.name}\": {self.d[('input', x.name)]}" for x in p.inputs]
        grads += [f"\"{prm.name}\": {self.d[('param', prm.name)]}" for prm in p.params]
        grads += [f"\"{s.name}\": {self.d[('state', s.name, 'new')]}" for s in p.states]
        return body + ["", "grads = {" + ", ".join(grads) + "}", "return outputs, final_state, grads"]

    def attention_body(self) -> list[str]:
        """A program that reads the sequence (softmax attention): each token against the positions it sees
        (the KV cache), forward, then each token's adjoint, whose gradients at the positions gather into the
        sequence's adjoint."""
        em, p, n = self.em, self.p, self.em.name
        prelude, loop = self.printer(None), self.printer("t")
        body = em.prologue() + [f"causal = {p.causal}"]
        body += em.hoisted_lets(prelude, "per-token values, for all tokens at once")
        body += ["", "# the sequence, head-major [B, H, T, *]: what seq(x) reads"]
        for adj in self.adjoint.sequences:
            body.append(f"{self.seq_vars[adj.step.index][0]} = np.swapaxes({prelude(adj.step.arg)}, 1, 2)")
        lo, hi = visible_slice(p.causal, self.c.decomposition.sequence.window)
        body += em.output_alloc()
        body += ["", "# the forward: each token against the positions it sees (the KV cache)",
                 "for t in range(tokens):", f"    keys = slice({lo}, {hi})"]
        body += ["    " + x for x in self.token_forward(loop, with_outputs=True)]
        body += ["outputs = {" + ", ".join(f"\"{o.name}\": {n(o.name)}" for o in p.outputs) + "}",
                 "final_state = {}"]
        body += self.adjoint_arrays()
        body += [f"{d} = np.zeros_like({var})" for var, d in self.seq_vars.values()]
        body += ["", "# each token's adjoint: its gradients at the positions it sees gather into the sequence's",
                 "for t in range(tokens):", f"    keys = slice({lo}, {hi})"]
        for adj in self.adjoint.loop:
            body += ["    " + x for x in self.step_adjoint(adj, loop, "t")]
        tail = self.tail(prelude)
        self.helpers |= prelude.helpers | loop.helpers
        return body + tail

    def body(self) -> list[str]:
        """The recurrent backward of a recurrence (one that reads the sequence: attention_body)."""
        if self.c.decomposition.sequence is not None:
            return self.attention_body()
        em, p, n = self.em, self.p, self.em.name
        states = [s.name for s in p.states]
        S = [n(s) for s in states]
        prev = [self.prev[s] for s in states]
        prelude = self.printer(None)
        loop = self.printer("t")
        body = em.prologue()
        body += em.hoisted_lets(prelude, "values that do not depend on a state, for all tokens at once")
        body += ["", "# the forward, statement by statement, keeping the states every `segment` tokens",
                 f"{self.segment} = chunk_size or max(1, int(round(tokens ** 0.5)))  # tokens per checkpoint",
                 _assign(S, [f"initial_state[\"{s}\"]" for s in states]),
                 f"{self.checkpoints} = []"]
        body += em.output_alloc()
        causal = p.causal
        body += ["for t in range(tokens):",
                 f"    if t % {self.segment} == 0:",
                 f"        {self.checkpoints}.append({_tuple(S)})",
                 "    " + _assign(prev, S)]
        body += ["    " + x for x in self.token_forward(loop, with_outputs=causal)]
        if not causal:
            body += ["# non-causal: every output reads the final states",
                     "for t in range(tokens):", "    " + _assign(prev, S)]
            body += ["    " + x for x in self.token_forward(loop, with_outputs=True, with_updates=False)]
        body += ["outputs = {" + ", ".join(f"\"{o.name}\": {n(o.name)}" for o in p.outputs) + "}",
                 "final_state = {" + ", ".join(f"\"{s}\": {n(s)}" for s in states) + "}"]
        body += self.adjoint_arrays()
        body.append("# of the states after the last token")
        for s in states:
            body.append(f"{self.d[('state', s, 'new')]} = np.array(grad_final_state[\"{s}\"], dtype=dtype) "
                        f"if grad_final_state.get(\"{s}\") is not None else np.zeros_like({n(s)})")
        zeros = [f"{self.d[('let', name)]} = np.zeros((batch, heads"
                 + "".join(", " + n(d) for d in p.lets[name].shape) + "), dtype)" for name in self.adjoint.loop_lets]
        if not causal:
            body += ["", "# the outputs read the final states: their adjoints first, into the final states'",
                     "for t in range(tokens):", "    " + _assign(prev, S)]
            body += ["    " + x for x in self.token_forward(loop, with_outputs=False, with_updates=False)]
            body += ["    " + x for x in zeros]
            for adj in self.adjoint.loop:
                if not isinstance(adj.step, ir.Update):
                    body += ["    " + x for x in self.step_adjoint(adj, loop, "t", final_reads=True)]
        body += ["", "# the segments from the last: recompute their states from the checkpoint, then the adjoints "
                     "token by token in reverse",
                 f"for start in reversed(range(0, tokens, {self.segment})):",
                 f"    stop = min(start + {self.segment}, tokens)",
                 "    " + _assign(S, [f"*{self.checkpoints}[start // {self.segment}]"]),
                 f"    {self.before} = []",
                 "    for t in range(start, stop):",
                 f"        {self.before}.append({_tuple(S)})",
                 "        " + _assign(prev, S)]
        body += ["        " + x for x in self.token_forward(loop, with_outputs=False)]
        body += ["    for t in reversed(range(start, stop)):",
                 "        " + _assign(prev, [f"*{self.before}[t - start]"]),
                 "        # this token's forward again: the values that read a state, the states after it"]
        body += ["        " + x for x in self.token_forward(loop, with_outputs=False)]
        body += ["        " + f"{self.d[('state', s, 'prev')]} = np.zeros_like({self.prev[s]})" for s in states]
        body += ["        " + x for x in zeros]
        for adj in self.adjoint.loop:
            if causal or not isinstance(adj.step, ir.Output):
                body += ["        " + x for x in self.step_adjoint(adj, loop, "t")]
        body += ["        " + f"{self.d[('state', s, 'new')]} = {self.d[('state', s, 'prev')]}" for s in states]
        tail = self.tail(prelude)
        self.helpers |= prelude.helpers | loop.helpers
        return body + tail

    def param_chain(self) -> list[str]:
        printer = self.printer(None)
        lines = []
        if any(isinstance(node, ir.HeadIndex) for adj in self.adjoint.params for node in walk(adj.step.default)):
            lines.append("h = np.arange(heads)")
        for adj in self.adjoint.params:
            inner = self.step_adjoint(adj, printer, None)
            if inner:
                lines.append(f"if \"{adj.step.name}\" in derived_params:")
                lines += ["    " + x for x in inner]
        return lines

    def render(self) -> str:
        body = self.body()
        param_lines = self.em.param_lines(self.helpers)
        return environment(__package__).get_template("backward.py.j2").render(
            name=self.p.name, form=self.form, version=VERSION, source_comment=source_comment(self.c),
            imports=imports(self.helpers, self.modules), param_lines=param_lines,
            param_names=[(prm.name, self.em.name(prm.name)) for prm in self.p.params], body=body,
            fused_forward=self.calls_fused_forward)


def _tuple(names: list[str]) -> str:
    """`(a, b,)`; `()` for a program with no states."""
    return f"({', '.join(names)},)" if names else "()"


def _assign(names: list[str], values: list[str]) -> str:
    """`a, b, = x, y,`; a value "*x" is a tuple unpacked: `a, b, = x` (`pass` for a program with no states)."""
    if not names:
        return "pass"
    right = values[0][1:] if len(values) == 1 and values[0].startswith("*") else ", ".join(values) + ","
    return f"{', '.join(names)}, = {right}"


def emit_backward(compiled: Compiled) -> str:
    """The recurrent backward of a causal recurrence (compiler.adjoint.why_no_adjoint says which)."""
    return BackwardEmitter(compiled).render()
