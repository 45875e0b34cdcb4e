"""The parallel and chunkwise backward of a recurrence as a NumPy module: from the decomposition of every
state (a decay plus rank-one corrections and writes, read by readouts q·S;
compiler.adjoint.why_no_decomposed_adjoint says which programs), the adjoint recurrence run chunk by chunk in
reverse (linrec.numpy.adjoint_scan), and the chain rule from the outputs to the readouts and from the per-token arrays to the inputs and params
(compiler.adjoint.derive_decomposed).

backward() reads, in order: the per-token arrays of each state and its forward scan (keeping the state
before each chunk); the outputs from the readouts; the outputs' adjoints into the readouts'; each state's
backward scan, from its last chunk; the per-token arrays' adjoints into their expressions; the values that
read no state and the params, as the recurrent backward ends.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, fields

from ..compiler import Compiled, ir
from ..compiler.adjoint import Accumulate, GradRef, derive_decomposed
from ..compiler.analysis import walk
from ..compiler.decay_factors import DecayFactors
from ..compiler.key_factors import KeyFactors
from .adjoint import ADJOINT_SCANS, AdjointPrinter, BackwardEmitter
from .adjoint_in_place import in_place_products
from .derived import canonical_text, per_token, running_signs_lines
from .shared_arrays import shared_calls, shared_per_token
from .vjp import READ

DEFAULT_CHUNK = 64


@dataclass(frozen=True)
class StateArrays:
    """The variables of a state's per-token arrays in the generated module (log-decays of its rows and of its
    value axis, writes, corrections, readouts' queries), of the states before each chunk, and of the arrays'
    adjoints (linrec.numpy.adjoint_scan.ScanGrads)."""

    log_decay: str
    value_log_decay: str
    bases: str  # the vectors its key-side slots share, where the backward takes them factored (key_factors)
    signs: tuple[str, str] | None  # a decay of either sign: σ_t and σ_(t−1) (linrec.numpy.scan.running_signs)
    value_signs: tuple[str, str] | None  # the same of a decay of the value axis: τ_t and τ_(t−1)
    writes: str
    corrections: str
    value_corrections: str
    queries: str
    starts: str
    grads: str


class DecomposedEmitter(BackwardEmitter):
    """The parallel or chunkwise backward's module: the recurrent one's names and statements, with the
    readouts' adjoints, each state's scans and the seeds of its per-token arrays' adjoints. The C backend's
    recurrent backward (linrec.c.grad) is this module with other scans: the class attributes below."""

    scans = ADJOINT_SCANS  # the helpers the module imports for its scans
    forward_scan = "decay_scan"  # (s0, log_decay, writes, queries, chunk, corrections=, value_log_decay=)
    backward_scan = "decay_scan_backward"  # (…, starts, chunk, grad_readouts, grad_final, …) → ScanGrads
    backward_comment = "the transposed recurrence, from the last chunk"
    no_decay = "per_token(0.0, (batch, tokens, heads, 1), dtype, scalar=True)  # a decay of 1"
    # the backward scan's gradients are arrays of their own (none a view of another, none given twice): one read
    # once may become the adjoint it seeds (first_contributions)
    scan_grads_owned = False
    # whether the forward may be one kernel of the whole program that keeps the state before each chunk — the
    # module then calls `fused_forward(inputs, params, initial_state, dims, chunk)`, which gives (outputs, final
    # states, the states before each chunk) or None (then each state's forward scan runs) — for the programs
    # fused_fits() takes and whose chain rule reads no readout. The module defines it to give None (a module
    # saved from `linrec emit` runs on its own); its loader replaces it with the fused kernel's
    fused_forward = False

    def __init__(self, compiled: Compiled, form: str):
        super().__init__(compiled)
        self.form = form
        self.decomposed = derive_decomposed(compiled, self.em.refold, self.readout_query, self.key_factors,
                                            self.decay_factors)
        # (the named values' adjoints as the decomposition reaches them: a value the scans take as another array —
        # the C backward's normalized rows — has none to carry)
        self.adjoint = dataclasses.replace(self.adjoint, hoisted=self.decomposed.hoisted)
        em, n = self.em, self.em.name
        self.readout_vars = {r.index: em.fresh(f"r{r.index}") for r in compiled.decomposition.readouts}
        for i, var in self.readout_vars.items():
            self.d[("readout", str(i))] = em.fresh(f"d_{var}")
        self.arrays = {}  # state → its per-token arrays' variables and their adjoints' (StateArrays)
        for st in self.p.states:
            s = n(st.name)
            names = {f.name: em.fresh(f"{s}_{f.name}") for f in fields(StateArrays)
                     if f.name not in ("signs", "value_signs")}
            t = compiled.decomposition.transition(st.name)
            signs = (em.fresh(f"{s}_signs"), em.fresh(f"{s}_signs_before")) if t.signed else None
            value_signs = (em.fresh(f"{s}_value_signs"), em.fresh(f"{s}_value_signs_before")) \
                if t.value_signed else None
            self.arrays[st.name] = StateArrays(**names, signs=signs, value_signs=value_signs)
        self.seeds: dict[str, str] = {}  # a per-token array's label → the code of its adjoint
        self.chunk = em.fresh("chunk")
        self.fused_result = em.fresh("fused")

    def readout_query(self, r) -> ir.Expr:
        """The expression of readout r's query array, which the scans take (the C backend's: without the
        constant factor its kernel applies, readout_scale)."""
        return r.query

    def readout_scale(self, r) -> ir.Expr | None:
        """The constant factor of readout r's query that the scans apply themselves (None: none)."""
        return None

    def key_factors(self, t) -> KeyFactors | None:
        """The transition's key-side vectors as the scans take them, factored into per-token scalars times the
        vectors they share (compiler.key_factors), or None: each slot its own array (the NumPy scans')."""
        return None

    def base_array(self, t, i: int, code: str) -> str:
        """The code of factored base i of the transition as the scans take it: its array (the C backward's may wrap
        it, c.normalized_rows)."""
        return code

    def query_array(self, r, code: str) -> str:
        """The code of readout r's query array as the scans take it (see base_array)."""
        return code

    def decay_factors(self, t) -> DecayFactors | None:
        """The transition's elementwise log-decay as the scans take it, factored into a rate the same for every
        token and a step per token (compiler.decay_factors), or None: one array [B, T, H, rows, cols] (the NumPy
        scans')."""
        return None

    def printer(self, token_index):
        base = self.em.printer(token_index, readout_vars=self.readout_vars)
        return AdjointPrinter(base.ref, lambda g: self.grad_name(g, token_index))

    def grad_name(self, g: GradRef, token_index):
        if g.kind == "quantity":
            return self.seeds[g.name]
        return super().grad_name(g, token_index)

    def accumulate(self, s: Accumulate, printer, token_index, final_reads=False) -> str:
        if s.target.kind == "readout":
            return f"{self.d[('readout', s.target.name)]} += {printer(s.value)}"
        return super().accumulate(s, printer, token_index, final_reads)

    def body(self) -> list[str]:
        em, p, n, d = self.em, self.p, self.em.name, self.c.decomposition
        prelude = self.printer(None)
        body = em.prologue()
        body += em.hoisted_lets(prelude, HOISTED)
        body += ["", f"{self.chunk} = {self.chunk_code()}"]
        self.helpers |= {"per_token"} | self.scans
        self.helpers.add("own_array")
        fused = self.calls_fused_forward = self.forward_fused()
        adjoint = self.adjoint_lines(prelude, fused)
        fwd = self.fused_result
        if fused:
            body += ["", "# the forward: one kernel of the whole program (the fused recurrent one), keeping the state "
                     "before each chunk; None: a call too small to be worth building it", f"{fwd} = fused_forward("
                     f"inputs, params, initial_state, dims, {self.chunk})"]
        for st in p.states:
            body += self.state_forward(st, prelude, fused)
        own = ["", "# outputs from the readouts"]
        for name, expr in d.outputs:
            out = next(o for o in p.outputs if o.name == name)
            dims = "".join(", " + n(x) for x in out.value.shape)
            code = prelude(em.refold(expr))
            fresh = _fresh(code) or code in self.readout_vars.values()  # (a scan's readout: its own array)
            own.append(f"{n(name)} = own_array({code}, (batch, tokens, heads{dims}), dtype, {fresh})")
        own += ["outputs = {" + ", ".join(f"\"{o.name}\": {n(o.name)}" for o in p.outputs) + "}",
                "final_state = {" + ", ".join(f"\"{s.name}\": {n(s.name)}" for s in p.states) + "}"]
        if fused:
            body += ["", f"if {fwd} is None:"] + ["    " + x for x in own[2:]] + \
                ["else:", f"    outputs, final_state = {fwd}[0], {fwd}[1]"] + \
                [f"    {n(o.name)} = outputs[\"{o.name}\"]" for o in p.outputs]
        else:
            body += own
        self.helpers |= prelude.helpers
        owned = tuple(f"{a.grads}." for a in self.arrays.values()) if self.scan_grads_owned else ()
        lines = in_place_products(first_contributions(shared_calls(shared_per_token(body + adjoint)), owned), owned)
        kept = unread_values_dropped(lines, [em.name(s.name) for s in p.steps
                                             if isinstance(s, ir.Let) and s.name in em.hoisted], HOISTED)
        # (a helper only a dropped value called is not imported: l2norm where the kernel normalizes itself)
        read = [x for x in kept if not x.lstrip().startswith("#")]
        self.helpers -= {h for h in self.helpers if any(re.search(rf"\b{h}\(", x) for x in lines if x not in kept)
                         and not any(re.search(rf"\b{h}\b", x) for x in read)}
        self.helpers |= {h for h in ("in_place", "negated") if any(f"{h}(" in x for x in kept)}
        return kept

    def forward_fused(self) -> bool:
        """Whether the module calls fused_forward (falling back on the states' forward scans when it gives None)."""
        # (the fused kernel gives the outputs, not the readouts q·S: a chain rule that reads one needs the scans)
        return self.fused_forward and self.fused_fits() and not self.chain_rule_reads_readouts()

    def chain_rule_reads_readouts(self) -> bool:
        """Whether an adjoint statement of the chain rule reads a readout's value (q·S itself, say through
        RetNet's groupnorm), not only its adjoint."""
        return any(isinstance(e, ir.ReadoutRef) for adj in (*self.decomposed.outputs, *self.decomposed.quantities)
                   for s in adj.statements for e in walk(s.value))

    def fused_fits(self) -> bool:
        """Whether the fused forward can stand for the states' forward scans (the structure; the chain rule
        reading no readout is checked apart): causal, every state a matrix in its declared layout."""
        d = self.c.decomposition
        return self.c.program.causal and all(len(st.shape) == 2 and st.name not in d.transposed
                                             and not d.transition(st.name).signed
                                             and not d.transition(st.name).value_signed for st in self.p.states)

    def adjoint_lines(self, prelude, fused: bool) -> list[str]:
        """The backward: the readouts' adjoints, each state's backward scan, the chain rule to the inputs."""
        p, n = self.p, self.em.name
        body = self.adjoint_arrays()
        for i, var in self.readout_vars.items():
            if fused:  # (no readout array: its shape, q·S over the state's columns)
                st = next(s for s in p.states if any(r.index == i and r.state == s.name
                                                     for r in self.c.decomposition.readouts))
                body.append(f"{self.d[('readout', str(i))]} = np.zeros((batch, tokens, heads, {n(st.shape[1])}), dtype)")
            else:
                body.append(f"{self.d[('readout', str(i))]} = np.zeros_like({var})")
        for adj in self.decomposed.outputs:
            body += self.step_adjoint(adj, prelude, None)
        for st in p.states:
            body += self.state_backward(st)
        body += ["", "# the per-token arrays' adjoints into the expressions they are computed from"]
        for adj in self.decomposed.quantities:
            body += self.step_adjoint(adj, prelude, None)
        return body + self.tail(prelude)

    def chunk_code(self) -> str:
        """The chunk's assignment: its value, and a comment."""
        if self.form == "parallel":
            return "max(tokens, 1)  # tokens per chunk  (parallel: one chunk)"
        return f"chunk_size or {DEFAULT_CHUNK}  # tokens per chunk"

    def state_forward(self, st: ir.State, prelude, fused: bool = False) -> list[str]:
        """The state's per-token arrays, and its forward scan (fused: its final state and the states before each
        chunk from the fused forward's)."""
        em, n = self.em, self.em.name
        t = self.c.decomposition.transition(st.name)
        a = self.arrays[st.name]
        decay, writes, queries, starts = a.log_decay, a.writes, a.queries, a.starts
        shape = tuple(reversed(st.shape)) if st.name in self.c.decomposition.transposed else st.shape
        rows, cols = n(shape[0]), ("1" if len(shape) == 1 else n(shape[1]))
        lines = ["", f"# {st.name}: {t.kind}", f"#   {st.name}_t = {canonical_text(t)}"]
        factored = self.decay_factors(t)
        if t.log_decay is None:
            lines.append(f"{decay} = {self.no_decay}")
        elif factored:  # (rate·diag(step) or diag(step)·rate: the rate [H, rows, cols], the step per token)
            self.helpers.add("factored_decay")
            step = per_token(prelude(em.refold(factored.step)), rows if factored.rows else cols, False)
            lines.append(f"{decay} = factored_decay({prelude(em.refold(factored.rate))}, {step}, (heads, {rows}, "
                         f"{cols}), rows={factored.rows})")
        else:
            # (an elementwise decay: one log-decay per element, [B, T, H, rows, cols])
            width = f"{rows}, {cols}" if t.elementwise else rows if t.log_decay.shape else "1"
            log = prelude(em.refold(t.log_decay))
            if not t.log_is_exact:  # log of the values: the runtime's log_decay, which refuses a negative decay by
                # name, as the forward's module does (np.log gave NaN, and the call a false 'NaN for these arguments')
                self.helpers.add("log_decay")
                log = f"log_decay({prelude(em.refold(t.magnitude))}, \"{st.name}\")"
            lines.append(f"{decay} = {per_token(log, width, not t.log_decay.shape)}")
        factors = self.key_factors(t)
        if factors:  # (the vectors the key-side slots share, each computed once)
            lines.append(f"# the vectors {st.name}'s key-side slots (u, w, keys) share: a slot is scaled(vector, its "
                         f"scalar per token or None), as the kernels take it")
            arrays = [self.base_array(t, i, per_token(prelude(em.refold(b)), rows, False))
                      for i, b in enumerate(factors.bases)]
            lines.append(f"{a.bases} = [" + ", ".join(arrays) + "]")
            self.helpers.add("scaled")

        def key_side(x, slot):  # a key-side vector: its array, or (factored) its base and its scalar
            if slot is None:
                return per_token(prelude(em.refold(x)), f"{rows}, {cols}" if len(x.shape) == 2 else rows, not x.shape)
            scale = "None" if slot.scale is None else per_token(prelude(em.refold(slot.scale)), "1", True)
            return f"scaled({a.bases}[{slot.base}], {scale})"
        pairs = []
        for j, (key, value) in enumerate(t.writes):
            val = per_token(prelude(em.refold(value)), cols, not value.shape) if value is not None else \
                "np.ones((batch, tokens, heads, 1), dtype)"
            pairs.append(f"({key_side(key, factors and factors.writes[j])}, {val})")
        if t.value_log_decay is not None:  # S·diag(e^m): one log-decay per value column (a scalar: the same for all)
            scalar = not t.value_log_decay.shape
            lines.append(f"{a.value_log_decay} = {per_token(prelude(em.refold(t.value_log_decay)), cols, scalar)}")
        lines.append(f"{writes} = [" + ", ".join(pairs) + "]")
        if t.corrections:  # (u and w: vectors over the rows, or beside an elementwise decay matrices, one per column)
            lines.append(f"{a.corrections} = [" + ", ".join(
                f"({key_side(u, factors and factors.corrections[j][0])}, "
                f"{key_side(w, factors and factors.corrections[j][1])})"
                for j, (u, w) in enumerate(t.corrections)) + "]")
        if t.value_corrections:  # + (D·S·a) ⊗ b: vectors over the columns
            lines.append(f"{a.value_corrections} = [" + ", ".join(
                f"({per_token(prelude(em.refold(x)), cols, not x.shape)}, "
                f"{per_token(prelude(em.refold(y)), cols, not y.shape)})" for x, y in t.value_corrections) + "]")
        reads = [r for r in self.c.decomposition.readouts if r.state == st.name]
        def query(r):  # (None: the vector state read as it is; a third item: the factor the scan applies)
            if r.is_value:
                return f"(None, {r.before_update})"
            q, scale = self.readout_query(r), self.readout_scale(r)
            array = self.query_array(r, per_token(prelude(em.refold(q)), rows, not q.shape))
            return f"({array}, {r.before_update}" + \
                ("" if scale is None else f", {prelude(scale)}") + ")"
        lines.append(f"{queries} = [" + ", ".join(query(r) for r in reads) + "]")
        if t.signed:  # (the scans carry S̃ = σ ⊙ S, whose decay is |D|; the readouts of a non-causal program are
            # read below from the state itself)
            after, before = a.signs
            self.helpers |= {"running_signs", "with_signs", "signed_state"} | ({"signed_reads"} if any(
                r.is_value for r in reads) else set())
            lines += running_signs_lines(st.name, a.signs, prelude(em.refold(t.decay)), rows, t.decay)
            causal = self.c.program.causal
            lines.append(f"{a.corrections if t.corrections else '_'}, {writes}, {queries if causal else '_'} = "
                         f"with_signs({after}, {before}, {a.corrections if t.corrections else '[]'}, {writes}, "
                         f"{queries if causal else '[]'})")
        if t.value_signed:  # (S̃ = S·diag(τ), whose value axis decays by |E|)
            after, before = a.value_signs
            self.helpers |= {"running_signs", "with_value_signs", "value_signed_reads", "value_signed_state"}
            held = a.value_corrections if t.value_corrections else None
            lines += running_signs_lines(st.name, a.value_signs, prelude(em.refold(t.value_decay)), cols, t.value_decay,
                                         value_axis=True)
            lines.append(f"{writes}, {held or '_'} = with_value_signs({after}, {before}, {writes}, {held or '[]'})")
        vector = len(st.shape) == 1
        s0 = self.carried(st, f"initial_state[\"{st.name}\"]")
        targets = ", ".join(self.readout_vars[r.index] for r in reads)
        if fused:  # (the fused kernel's states, or, for a small call, the forward scan's)
            fwd = self.fused_result
            return lines + [f"if {fwd} is None:", f"    [{targets}], {n(st.name)}, {starts} = {self.forward_scan}({s0}, "
                            f"{decay}, {writes}, {queries}, {self.chunk}{self.optional_arrays(st.name)})", "else:",
                            f"    {n(st.name)}, {starts} = {fwd}[1][\"{st.name}\"], {fwd}[2][\"{st.name}\"]"]
        # (a decay of either sign: the readouts of the state itself and the state back from S̃, as the forward's)
        signed = [f"{n(st.name)} = signed_state({n(st.name)}, {a.signs[0]})  # σ_T ⊙ {st.name}̃_T: the state itself"] \
            if t.signed else []
        if t.value_signed:
            signed.append(f"{n(st.name)} = value_signed_state({n(st.name)}, {a.value_signs[0]})  "
                          f"# {st.name}̃_T·diag(τ_T): the state itself")
        if self.c.program.causal:
            lines.append(f"[{targets}], {n(st.name)}, {starts} = {self.forward_scan}({s0}, {decay}, {writes}, "
                         f"{queries}, {self.chunk}{self.optional_arrays(st.name)})")
            if t.signed and any(r.is_value for r in reads):
                lines.append(f"[{targets}] = signed_reads([{targets}], {a.signs[0]}, {a.signs[1]}, {queries})")
            if t.value_signed:
                lines.append(f"[{targets}] = value_signed_reads([{targets}], {a.value_signs[0]}, {a.value_signs[1]}, "
                             f"{queries})")
            lines += signed
        else:  # every readout reads the final state: the scan runs without readouts, they read its result
            lines.append(f"[], {n(st.name)}, {starts} = {self.forward_scan}({s0}, {decay}, {writes}, [], "
                         f"{self.chunk}{self.optional_arrays(st.name)})")
            lines += signed
            for i, r in enumerate(reads):
                var = self.readout_vars[r.index]
                lines.append(f"{var} = np.broadcast_to({n(st.name)}[:, None, :, :, 0], (batch, tokens) + "
                             f"{n(st.name)}.shape[1:3])  # {st.name} itself, at every token" if r.is_value else
                             f"{var} = np.einsum('bthk,bhkv->bthv', {queries}[{i}][0], {n(st.name)})  # q·{st.name}_T")
        lines.append(f"{n(st.name)} = {self.declared(st, n(st.name))}")
        if vector:  # a vector state is carried as one column
            lines += [f"{self.readout_vars[r.index]} = {self.readout_vars[r.index]}[..., 0]" for r in reads
                      if not r.is_value]
        return lines

    def optional_arrays(self, state: str) -> str:
        """The scans' keyword arguments for the state's corrections and its value axis's decay, where it has
        them."""
        t, a = self.c.decomposition.transition(state), self.arrays[state]
        return (f", corrections={a.corrections}" if t.corrections else "") + \
            (f", value_log_decay={a.value_log_decay}" if t.value_log_decay is not None else "") + \
            (f", value_corrections={a.value_corrections}" if t.value_corrections else "")

    def decays_as_values(self, t) -> str:
        """The backward scan's keyword for a state whose log-decay is the log of a value (its gradient divided
        by that value in the chain rule: adjoint_arrays.BelowNormalRange; C's scans, c.small_decays)."""
        return ", decays_as_values=True" if t.decays_as_values else ""

    def carried(self, st: ir.State, code: str) -> str:
        """A state [B, H, *] as the scans carry it: a vector as one column, a state the decomposition
        transposes (compiler.transpose) transposed."""
        if len(st.shape) == 1:
            return f"{code}[..., None]"
        return f"np.swapaxes({code}, -1, -2)" if st.name in self.c.decomposition.transposed else code

    def declared(self, st: ir.State, code: str) -> str:
        """A carried state back in its declared layout."""
        if len(st.shape) == 1:
            return f"{code}[..., 0]"
        return f"np.swapaxes({code}, -1, -2)" if st.name in self.c.decomposition.transposed else code

    def state_backward(self, st: ir.State) -> list[str]:
        """The state's adjoint, run backwards chunk by chunk; the seeds of its per-token arrays' adjoints."""
        t = self.c.decomposition.transition(st.name)
        a = self.arrays[st.name]
        decay, writes, queries, starts, g = a.log_decay, a.writes, a.queries, a.starts, a.grads
        reads = [r for r in self.c.decomposition.readouts if r.state == st.name]
        column = "[..., None]" if len(st.shape) == 1 else ""
        grads = ", ".join(self.d[("readout", str(r.index))] + ("" if r.is_value else column) for r in reads)
        given = f"grad_final_state.get(\"{st.name}\")"
        final = given if self.carried(st, "x") == "x" else f"None if {given} is None else {self.carried(st, given)}"
        state = self.d[("state", st.name, "new")]
        s0 = self.carried(st, f"initial_state[\"{st.name}\"]")
        comment = " (its corrections: the UT transform's solve, transposed, per chunk)" if t.corrections else \
            " (its value-side corrections: those of its transpose's key side)" if t.value_corrections else ""
        lines = ["", f"# {st.name}'s adjoint: {self.backward_comment}" + comment]
        read_grads = {}  # the readouts' queries' gradients, where this code (not the scan) gives them
        if not self.c.program.causal:
            # the readouts read the final state: their writes q_t ⊗ ∂r_t join its adjoint, and ∂q_t = S_T·∂r_t
            end, total = self.carried(st, self.em.name(st.name)), self.em.fresh(f"d_{self.em.name(st.name)}_final")
            parts = [f"np.sum({self.d[('readout', str(r.index))]}, axis=1)[..., None]" if r.is_value else
                     f"np.einsum('bthk,bthv->bhkv', {queries}[{i}][0], {self.d[('readout', str(r.index))]}{column})"
                     for i, r in enumerate(reads)]
            lines.append(f"{total} = " + " + ".join(parts or ["0"]) +
                         f" + (0 if {given} is None else {self.carried(st, given)})")
            for i, r in enumerate(reads):
                if not r.is_value:
                    read_grads[i] = self.em.fresh(f"d_q{r.index}")
                    lines.append(f"{read_grads[i]} = np.einsum('bhkv,bthv->bthk', {end}, "
                                 f"{self.d[('readout', str(r.index))]}{column})")
            queries, grads, final = "[]", "", total
        if t.signed:  # (the scan's arrays are S̃'s, σ ⊙ S: the gradients of S's readouts and final state to S̃'s)
            after, before = a.signs
            final = f"signed_state({final}, {after})"
            if any(r.is_value for r in reads):
                grads = f"*signed_reads([{grads}], {after}, {before}, {queries})"
        if t.value_signed:  # (and those of S̃ = S·diag(τ))
            final = f"value_signed_state({final}, {a.value_signs[0]})"
            if self.c.program.causal:
                grads = f"*value_signed_reads([{grads}], {a.value_signs[0]}, {a.value_signs[1]}, {queries})"
        lines += [f"{g} = {self.backward_scan}({s0}, {decay}, {writes}, {queries}, {starts}, {self.chunk}, [{grads}], "
                  f"{final}{self.optional_arrays(st.name)}{self.decays_as_values(t)})",
                  f"{state} = {self.declared(st, g + '.initial_state')}"]
        if t.signed:
            self.helpers.add("signed_grads")
            lines.append(f"{g} = signed_grads({g}, {after}, {before}, {queries})  # the arrays' own, before with_signs")
        if t.value_signed:
            self.helpers.add("value_signed_grads")
            lines.append(f"{g} = value_signed_grads({g}, {a.value_signs[0]}, {a.value_signs[1]})  # (the same: "
                         f"before with_value_signs)")
        if self.decay_factors(t):  # (the rate's gradient summed over the batch rows and tokens: [H, rows, cols])
            self.seeds[f"{st.name}.log_decay.rate"] = f"{g}.log_decay.rate"
            self.seeds[f"{st.name}.log_decay.step"] = f"{g}.log_decay.step"
        elif t.log_decay is not None:
            self.seeds[f"{st.name}.log_decay"] = f"{g}.log_decay" + ("" if t.log_decay.shape else "[..., 0]")
        if t.value_log_decay is not None:
            self.seeds[f"{st.name}.value_log_decay"] = f"{g}.value_log_decay" + \
                ("" if t.value_log_decay.shape else ".sum(axis=-1)")  # (a scalar, broadcast over the columns)
        # (a scalar the scans took broadcast over a vector's width: its gradient is the sum over that width)
        def seed(code: str, x: ir.Expr) -> str:
            return code if x.shape else code + ".sum(axis=-1)"
        factors = self.key_factors(t)

        def key_side(label: str, code: str, x: ir.Expr, slot):  # (factored: its scalar's, and its base's)
            if slot is None:
                self.seeds[label] = seed(code, x)
                return
            if slot.scale is not None:
                self.seeds[f"{label}.scale"] = f"{code}.scale[..., 0]"
            if slot.owner:
                self.seeds[f"{label}.base"] = f"{code}.base"
        for j, (key, value) in enumerate(t.writes):
            key_side(f"{st.name}.key{j}", f"{g}.writes[{j}][0]", key, factors and factors.writes[j])
            if value is not None:
                self.seeds[f"{st.name}.value{j}"] = seed(f"{g}.writes[{j}][1]", value)
        for j, (u, w) in enumerate(t.corrections):
            slots = factors.corrections[j] if factors else (None, None)
            key_side(f"{st.name}.correction{j}_u", f"{g}.corrections[{j}][0]", u, slots[0])
            key_side(f"{st.name}.correction{j}_w", f"{g}.corrections[{j}][1]", w, slots[1])
        for j, (x, y) in enumerate(t.value_corrections):
            self.seeds[f"{st.name}.value_correction{j}_a"] = seed(f"{g}.value_corrections[{j}][0]", x)
            self.seeds[f"{st.name}.value_correction{j}_b"] = seed(f"{g}.value_corrections[{j}][1]", y)
        for i, r in enumerate(reads):
            if not r.is_value:  # (a state read as it is has no query)
                self.seeds[f"r{r.index}"] = seed(read_grads.get(i, f"{g}.queries[{i}]"), self.readout_query(r))
        return lines


HOISTED = "values that do not depend on a state, for all tokens at once"  # (their lines' heading)


def unread_values_dropped(lines: list[str], names: list[str], heading: str) -> list[str]:
    """The module's lines without the assignments `name = …` of those named values (computed for all tokens at
    once, under `# heading`) that no other line of code reads — the C backward's l2norm(x), say, where its kernel
    takes x and normalizes it itself — until none is left unread (a value read only by a dropped one goes too),
    and without the heading and the blank line before it where no value is left under it. Comments do not count
    as reads."""
    def code(line: str) -> str:
        return "" if line.lstrip().startswith("#") else line.split("  # ")[0]
    dropped = False
    while True:
        unread = [n for n in names if any(x.startswith(f"{n} = ") for x in lines) and not any(
            re.search(rf"\b{re.escape(n)}\b", code(x)) for x in lines if not x.startswith(f"{n} = "))]
        if not unread:
            break
        lines = [x for x in lines if not any(x.startswith(f"{n} = ") for n in unread)]
        names = [n for n in names if n not in unread]
        dropped = True
    if dropped and f"# {heading}" in lines:
        at = lines.index(f"# {heading}")
        if at + 1 == len(lines) or not lines[at + 1].strip():
            lines = lines[:at - 1 if at and not lines[at - 1].strip() else at] + lines[at + 1:]
    return lines


_ZEROS = re.compile(r"^(\w+) = np\.zeros_like\((\w+)\)$|^(\w+) = np\.zeros\((.+), dtype\)$")


def _fresh(code: str) -> bool:
    """Whether evaluating `code` makes a new array — an arithmetic result, a sum (np.einsum), a builtin's
    vector–Jacobian product (linrec.numpy.vjp's vjp_*, each a product with its upstream gradient) — rather
    than naming one that exists. (own_array checks what it gets all the same: a view is copied.)"""
    node = ast.parse(code, mode="eval").body
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        return name == "np.einsum" or name.startswith("vjp_")
    return isinstance(node, (ast.BinOp, ast.UnaryOp))


def first_contributions(lines: list[str], owned: tuple[str, ...] = ()) -> list[str]:
    """The module's lines with each adjoint array that starts as zeros (`d = np.zeros_like(x)`) and whose first
    use adds to it (`d += value`) made from that value instead (`d = own_array(value, …)`): over [B, T, H, *]
    arrays, a pass of zeros and one of adds less (no pass at all where the value itself can stand for it).
    `owned`: the prefixes of values that are arrays of their own (a scan's gradients), kept where read once.
    Lines inside blocks (indented) and comments are left as they are."""
    out = list(lines)
    for i, line in enumerate(lines):
        m = _ZEROS.match(line)
        if not m:
            continue
        var = m.group(1) or m.group(3)
        shape, dtype = (f"{m.group(2)}.shape", f"{m.group(2)}.dtype") if m.group(1) else (m.group(4), "dtype")
        word = re.compile(rf"\b{var}\b")
        j = next((j for j in range(i + 1, len(lines)) if not lines[j].lstrip().startswith("#")
                  and word.search(lines[j])), None)
        if j is None or not lines[j].startswith(f"{var} += "):
            continue
        value = lines[j][len(var) + 4:]
        if word.search(value):
            continue
        # the value itself may stand for the adjoint where it is a new array, or where the adjoint is only
        # read from here on (never added to, never returned: no caller's array is changed or handed back) and so
        # is the array the value names (nothing changes under the adjoint)
        named = re.match(r"\w+", value)
        root = named.group(0) if named else var
        only_read = not any(re.match(rf"\s*({var}|{root})\b[^=]*[-+*/]?= ", x)
                            or (x.startswith("grads = ") and word.search(x)) for x in lines[j + 1:])
        read_once = value.startswith(owned) and sum(value in x for x in lines) == 1 if owned else False
        out[i] = None
        # (only read and not an array of its own — the caller's upstream gradient, say: "read", the array itself
        # even where it is a view, as linrec.torch hands them over; own_array copies it otherwise)
        keep = repr(READ) if only_read and not (_fresh(value) or read_once) else _fresh(value) or read_once
        out[j] = f"{var} = own_array({value}, {shape}, {dtype}, {keep})"
        scaled = _in_place(value, owned, lines)
        if scaled:  # (a scan's gradient times a factor: the factor applied in its array, no new one)
            array, op, factor = scaled
            out[j] = [f"{var} = own_array({array}, {shape}, {dtype}, True)", f"{var} {op}= {factor}"]
    return [y for x in out if x is not None for y in ([x] if isinstance(x, str) else x)]


_IN_PLACE = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _in_place(value: str, owned: tuple[str, ...], lines: list[str]) -> tuple[str, str, str] | None:
    """(array, operator, factor) where `value` is `array op factor`, array a scan's gradient (`owned`) that
    nothing else reads (it appears once in the module), so that the adjoint may be that array, changed in
    place; else None."""
    if not owned:
        return None
    node = ast.parse(value, mode="eval").body
    if not (isinstance(node, ast.BinOp) and type(node.op) in _IN_PLACE):
        return None
    array = ast.get_source_segment(value, node.left)
    if not array or not array.startswith(owned) or sum(x.count(array) for x in lines) != 1:
        return None
    return array, _IN_PLACE[type(node.op)], ast.get_source_segment(value, node.right)


def emit_decomposed_backward(compiled: Compiled, form: str) -> str:
    """The parallel or chunkwise backward (see compiler.adjoint.why_no_decomposed_adjoint)."""
    return DecomposedEmitter(compiled, form).render()
