"""The NumPy backend: generated Python source that reads like hand-written NumPy, loaded as a module."""
from __future__ import annotations

import dataclasses
import types

from ..compiler import Compiled, ir
from ..compiler.analysis import children, inline_lets, rebuild, states_in, to_text, variance, walk
from ..compiler.transitions import split_exp

from ..compiler.identifiers import Namer
from ..compiler.stabilize import log_scale_keys, scale_degree, stabilized_states
from .printer import NumpyPrinter
from ..interface import DEFINITION
from ..templating import comment_lines, environment

from ..version import VERSION
SCAN_HELPERS = {"per_token", "log_decay", "parallel_scan", "chunkwise_scan", "recurrent_scan", "running_max",
                "scale_decay", "rescale"}
ATTENTION_HELPERS = {"visible_positions", "mask", "masked_softmax", "softmax", "online_softmax_step",
                     "lsh_attention_dense", "lsh_attention_bucketed"}


def source_comment(compiled: Compiled) -> str:
    """The program as comment lines (comments cannot be broken by what the program's own comments hold)."""
    return "# Source program:\n" + comment_lines(compiled.source.strip(), "#     ", c=False)


class Emitter:
    """Shared naming and printing for one generated module."""

    def __init__(self, compiled: Compiled):
        self.c = compiled
        self.p = compiled.program
        self.name = Namer()
        self.lets = self.p.lets
        # state-free values are computed for all tokens at once before any loop
        self.hoisted = {n for n, v in self.lets.items() if not states_in(inline_lets(v, self.lets))}
        # derived expressions come with lets inlined: fold them back to the user's names
        self._folds = {inline_lets(self.lets[n], self.lets): ir.LetRef(self.lets[n].shape, n) for n in self.hoisted}
        # of those, the ones that change from token to token ([B, T, H, *]); the others are fixed per head
        # ([H, *]) or constants, arrays in the call's dtype that a token's code uses whole
        self.per_token = {n for n in self.hoisted if variance(inline_lets(self.lets[n], self.lets)) == "token"}

    def refold(self, e: ir.Expr) -> ir.Expr:
        if e in self._folds:
            return self._folds[e]
        kids = children(e)
        if not kids:
            return e
        if isinstance(e, ir.Apply):
            return dataclasses.replace(e, args=tuple(self.refold(a) for a in e.args))
        fields = [f.name for f in dataclasses.fields(e) if isinstance(getattr(e, f.name), ir.Expr)]
        return dataclasses.replace(e, **{f: self.refold(getattr(e, f)) for f in fields})

    def printer(self, token_index: str | None, state_vars: dict[str, str] | None = None,
                readout_vars: dict[int, str] | None = None) -> NumpyPrinter:
        """token_index: None → arrays over all tokens ([B, T, H, *]); "t" → one token ([B, H, *])."""
        def ref(node: ir.Expr) -> str:
            if isinstance(node, ir.DimSize):
                return self.name(node.dim)
            if isinstance(node, ir.HeadIndex):
                return "h"
            if isinstance(node, ir.ParamRef):
                return self.name(node.name)
            if isinstance(node, ir.InputRef) or (isinstance(node, ir.LetRef) and node.name in self.per_token):
                return self.name(node.name) + (f"[:, {token_index}]" if token_index else "")
            if isinstance(node, ir.LetRef):
                return self.name(node.name)
            if isinstance(node, ir.StateRef):
                return (state_vars or {}).get(node.name, self.name(node.name))
            if isinstance(node, ir.ReadoutRef):
                return readout_vars[node.index]
            raise TypeError(node)
        return NumpyPrinter(ref)

    # ---- pieces every form shares ----
    def param_lines(self, helpers: set[str]) -> list[str]:
        lines = ["h = np.arange(heads)"] if any(p.per_head for p in self.p.params) else []
        lines += [f"{self.name(d.name)} = dims[\"{d.name}\"]" for d in self.p.dims
                  if any(d.name in p.shape or _uses_dim(p.default, d.name) for p in self.p.params)]
        printer = self.printer(None)
        for prm in self.p.params:
            var = self.name(prm.name)
            if prm.default is None:
                lines.append(f"{var} = given.get(\"{prm.name}\")  # no default: the caller must pass '{prm.name}'")
                continue
            dims = (["heads"] if prm.per_head else []) + [self.name(d) for d in prm.shape]
            shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
            code = _print_param(prm.default, printer, shape, prm.per_head)
            if prm.shape and not prm.default.shape and variance(prm.default) != "const":
                code = f"({code})" + "[..., " + ", ".join(["None"] * len(prm.shape)) + "]"  # per head → [H, 1…]
            code = f"np.broadcast_to({code}, {shape}).astype(np.float64)"
            lines.append(f"# {prm.name} = {to_text(prm.default)}")
            lines.append(f"{var} = given[\"{prm.name}\"] if \"{prm.name}\" in given else {code}")
        helpers |= printer.helpers
        return lines

    def prologue(self) -> list[str]:
        """Bind inputs, params, sizes and initial states to local names."""
        p, n = self.p, self.name
        lines = []
        for x in p.inputs:
            lines.append(f"{n(x.name)} = inputs[\"{x.name}\"]  # [B, T, H{''.join(', ' + d for d in x.shape)}]")
        first = n(p.inputs[0].name) if p.inputs else None
        lines.append(f"batch, tokens, heads = {first}.shape[:3]")
        lines.append(f"dtype = {first}.dtype")
        for d in p.dims:
            lines.append(f"{n(d.name)} = dims[\"{d.name}\"]")
        for prm in p.params:
            lines.append(f"{n(prm.name)} = params[\"{prm.name}\"]" + ("  # per head" if prm.per_head else ""))
        return lines

    def hoisted_lets(self, printer: NumpyPrinter) -> list[str]:
        lines = []
        for step in self.p.steps:
            if isinstance(step, ir.Let) and step.name in self.hoisted:
                code = printer(step.value)
                if step.name not in self.per_token:  # (a constant may print as a Python number)
                    code = f"np.asarray({code}, dtype=dtype)"
                lines.append(f"{self.name(step.name)} = {code}  # {step.name} = {to_text(step.value)}")
        return lines

    def output_alloc(self) -> list[str]:
        lines = []
        for out in self.p.outputs:
            dims = "".join(", " + self.name(d) for d in out.value.shape)
            lines.append(f"{self.name(out.name)} = np.empty((batch, tokens, heads{dims}), dtype=dtype)")
        return lines

    def returns(self) -> str:
        outs = ", ".join(f"\"{o.name}\": {self.name(o.name)}" for o in self.p.outputs)
        states = ", ".join(f"\"{s.name}\": {self.name(s.name)}" for s in self.p.states)
        return f"return {{{outs}}}, {{{states}}}"

    def render(self, form: str, body: list[str], helpers: set[str], scan_module: str = "linrec.numpy.scan") -> str:
        param_lines = self.param_lines(helpers)
        return environment(__package__).get_template("module.py.j2").render(
            name=self.p.name, form=form, version=VERSION, filename=self.c.filename,
            source_comment=source_comment(self.c),
            runtime_helpers=sorted(helpers - SCAN_HELPERS - ATTENTION_HELPERS),
            scan_helpers=sorted(helpers & SCAN_HELPERS), attention_helpers=sorted(helpers & ATTENTION_HELPERS),
            scan_module=scan_module, param_lines=param_lines,
            param_names=[(prm.name, self.name(prm.name)) for prm in self.p.params], body=body)


def _uses_dim(e, dim) -> bool:
    return e is not None and any(isinstance(n, ir.DimSize) and n.dim == dim for n in walk(e))


def _print_param(e: ir.Expr, printer: NumpyPrinter, shape: str, per_head: bool) -> str:
    """Param defaults may hold seeded random draws; everything else prints as usual."""
    if not any(isinstance(n, ir.Random) for n in walk(e)):
        return printer(e)
    draws = {}

    def swap(node):
        if isinstance(node, ir.Random):
            opts = dict(node.options)
            full = shape
            if node.kind == "normal":
                code = f"np.random.default_rng({node.seed}).standard_normal({full}) * {opts['std']!r}"
            elif node.kind == "features":
                printer.helpers.add("random_features")
                code = f"random_features({node.seed}, {full}, orthogonal={bool(opts['orthogonal'])})"
            else:
                code = f"np.random.default_rng({node.seed}).uniform({opts['low']!r}, {opts['high']!r}, {full})"
            key = f"__draw{len(draws)}"
            draws[key] = code
            return ir.LetRef(node.shape if not per_head else node.shape, key)
        return node
    swapped = rebuild(e, swap)
    base_ref = printer.ref

    def ref(node):
        if isinstance(node, ir.LetRef) and node.name in draws:
            return draws[node.name]
        return base_ref(node)
    printer.ref = ref
    try:
        return printer(swapped)
    finally:
        printer.ref = base_ref


def emit_recurrent(compiled: Compiled) -> str:
    """The recurrent form, statement by statement as the user wrote them: the living definition."""
    em = Emitter(compiled)
    p, n = em.p, em.name
    helpers: set[str] = set()
    prelude = em.printer(None)
    loop = em.printer("t")
    body = em.prologue()
    hoisted = em.hoisted_lets(prelude)
    if hoisted:
        body += ["", "# values that do not depend on a state, for all tokens at once"] + hoisted
    body += ["", "# states [B, H, *]"]
    body += [f"{n(s.name)} = initial_state[\"{s.name}\"]" for s in p.states]
    body += em.output_alloc()

    def step_lines(steps, with_outputs=True, with_updates=True):
        lines = []
        for step in steps:
            if isinstance(step, ir.Let) and step.name not in em.hoisted:
                lines.append(f"{n(step.name)} = {loop(step.value)}")
            elif isinstance(step, ir.Update) and with_updates:
                lines.append(f"# {step.state}: {compiled.derivation.transition(step.state).kind}")
                lines.append(f"{n(step.state)} = {loop(step.value)}")
            elif isinstance(step, ir.Output) and with_outputs:
                lines.append(f"{n(step.name)}[:, t] = {loop(step.value)}")
        return lines

    if p.causal:
        body += ["", "for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps)]
    else:
        body += ["", "# non-causal: every output reads the final state, so run the updates first",
                 "for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps, with_outputs=False)]
        body += ["for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps, with_updates=False)]
    body += ["", em.returns()]
    helpers |= prelude.helpers | loop.helpers
    return em.render("recurrent", body, helpers)


def emit_recurrent_form(compiled: Compiled) -> str:
    """Statement by statement; programs with exponential feature maps use the stabilized decomposition."""
    if stabilized_states(compiled):
        return emit_scan(compiled, "recurrent")
    return emit_recurrent(compiled)


def emit(compiled: Compiled, form: str) -> str:
    """The module of a form of a recurrence (programs that read the sequence are sequence.py's)."""
    if form == DEFINITION:
        return emit_recurrent(compiled)
    if form == "recurrent":
        return emit_recurrent_form(compiled)
    return emit_scan(compiled, form)


def module_from_source(source: str, compiled: Compiled, form: str, what: str = "") -> types.ModuleType:
    """Generated source as a module object (no files written); its source at `__source__`. `what` tells
    tracebacks which code it is (say, "C scan": the NumPy glue of C kernels)."""
    module = types.ModuleType(f"linrec_generated_{compiled.name}_{form}")
    module.__dict__["__source__"] = source
    where = f"<linrec {compiled.filename} {form}" + (f" ({what})>" if what else ">")
    exec(compile(source, where, "exec"), module.__dict__)
    return module


def _scale_seen(running: str, causal: bool, before_update: bool) -> tuple[str, str | None]:
    """The log-scale M a readout of a state carried as S·exp(−M) sees, as (variable, its code or None when
    it is `running` itself, M_t). A readout before the update reads S_(t−1)·exp(−M_(t−1)): one token behind
    (the first token's is the initial state's, brought to M_1); a non-causal one reads S_T·exp(−M_T) at
    every token."""
    if not causal:
        return f"{running}_end", f"np.broadcast_to({running}[:, -1:], {running}.shape)  # M_T"
    if before_update:
        return f"{running}_before", f"np.concatenate([{running}[:, :1], {running}[:, :-1]], axis=1)  # M_(t−1)"
    return running, None


def _factor(code: str, c: ir.Expr, alpha: ir.Expr) -> str:
    """The factor c of a key or query c·exp(α), shaped to multiply exp(α − M): a scalar c that varies per
    token or head ([B, T, H] or [H]) against a vector α takes α's axis."""
    if not c.shape and alpha.shape and variance(c) != "const":
        return f"({code})[..., None]"
    return code


def _shifted_exp(exponent: str, shift: str, alpha: ir.Expr, product: ir.Expr) -> str:
    """exp(α − M) in NumPy, M [B, T, H] a per-token shift, shaped to multiply into `product` (a key or query
    c·exp(α)): a vector α takes M along its last axis; a scalar α times a vector c gets that axis itself."""
    if alpha.shape:
        return f"np.exp({exponent} - {shift}[..., None])"
    return f"np.exp({exponent} - {shift})" + ("[..., None]" if product.shape else "")


def emit_scan(compiled: Compiled, form: str, scan_module: str = "linrec.numpy.scan") -> str:
    """The parallel, chunkwise (or, for stabilized programs, recurrent) form from the derived decomposition
    of every state's update. `scan_module` provides parallel_scan, chunkwise_scan and recurrent_scan (the
    C backend passes its compiled twins); the per-token values stay NumPy."""
    em = Emitter(compiled)
    p, n, d = em.p, em.name, compiled.derivation
    base = em.printer(None)
    prelude = lambda e: base(em.refold(e))  # noqa: E731
    body = em.prologue()
    hoisted = em.hoisted_lets(base)
    if hoisted:
        body += ["", "# values that do not depend on a state, for all tokens at once"] + hoisted
    scan = {"parallel": "parallel_scan", "chunkwise": "chunkwise_scan", "recurrent": "recurrent_scan"}[form]
    helpers = {"per_token", scan}
    stable = stabilized_states(compiled)
    scale_keys = log_scale_keys(compiled)
    groups: dict[tuple, str] = {}   # α of a group of states → the prefix of its variables (S → S_max, S_scale)
    exponents: dict[ir.Expr, str] = {}  # an exponent α or β → its variable
    query_max: dict[ir.Expr, str] = {}  # a query exponent β → the variable of its per-token maximum
    scale_of: dict[int, str] = {}   # readout → the code of its log-scale
    lagged: set[str] = set()        # the variables of M_(t−1) and M_T defined so far
    readout_vars = {}
    bound: dict[str, str] = {}      # the code of a stabilized key or query → its variable (states share them)

    def bind(code: str, name: str) -> str:
        """code into a variable, once: the states of a group (S and z) write and read the same ones."""
        if code not in bound:
            bound[code] = f"{name}{sum(v.startswith(name) for v in bound.values())}"
            body.append(f"{bound[code]} = {code}")
        return bound[code]

    def tok(e, width):
        return f"per_token({prelude(e)}, (batch, tokens, heads, {width}), dtype, scalar={not e.shape})"

    for st in p.states:
        t = d.transition(st.name)
        flipped = st.name in d.transposed  # carried as Sᵀ (compiler.transpose): rows and columns swap
        shape = tuple(reversed(st.shape)) if flipped else st.shape
        s, rows = n(st.name), n(shape[0])
        cols = "1" if len(shape) == 1 else n(shape[1])
        body += ["", f"# {st.name}: {t.kind}" + (f", carried transposed ({st.name}ᵀ below)" if flipped else ""),
                 f"#   {st.name}{'ᵀ' if flipped else ''}_t = {_canonical_text(t)}"]
        running = scale = None
        if st.name in stable:
            alphas = stable[st.name]
            if alphas not in groups:
                groups[alphas] = s
                helpers.add("running_max")
                body += [f"# exponential features: keep {st.name}·exp(−M) with M the running maximum of the "
                         f"exponents, so every exp(α − M) ≤ 1"]
                for a in alphas:
                    if a not in exponents:
                        exponents[a] = f"{s}_exponent{len(exponents)}"
                        body.append(f"{exponents[a]} = {prelude(a)}")
                joined = ", ".join(exponents[a] + ("" if a.shape or len(alphas) == 1 else "[..., None]")
                                   for a in alphas)
                joined = joined if len(alphas) == 1 else f"np.concatenate([{joined}], axis=-1)"
                key = scale_keys[st.name]
                body += ["# a state handed over with its log-scale (a decode loop) is S·exp(−m): start M from m",
                         f"{s}_scale = initial_state.get(\"{key}\")  # [B, H] or None (then S is unscaled)",
                         f"{s}_max = running_max({joined}, {s}_scale)  # M_t [B, T, H]"]
            running, scale = f"{groups[alphas]}_max", f"{groups[alphas]}_scale"
        decay_terms = []
        if t.log_decay is not None:
            width = rows if t.log_decay.shape else "1"
            decay_terms.append(tok(t.log_decay, width) if t.log_is_exact else
                               f"per_token(log_decay({prelude(t.decay)}, \"{st.name}\"), "
                               f"(batch, tokens, heads, {width}), dtype, scalar={not t.decay.shape})")
            if not t.log_is_exact:
                helpers.add("log_decay")
        if running:
            decay_terms.append(f"scale_decay({running})  # M_(t−1) − M_t")
            helpers.add("scale_decay")
        if not (decay_terms or t.corrections or t.writes or t.value_log_decay is not None):
            # (a state left as it is, `z = z`: no per-token array would tell the scan how many tokens there are)
            decay_terms.append("per_token(0.0, (batch, tokens, heads, 1), dtype, scalar=True)  # a decay of 1")
        body.append(f"{s}_log_decay = " + (" + ".join(decay_terms) if decay_terms else "None"))
        value_decay = ""  # (the scan's keyword argument, only where the value axis decays)
        if t.value_log_decay is not None:
            body.append(f"{s}_value_log_decay = " + (tok(t.value_log_decay, cols) if t.value_log_is_exact else
                        f"per_token(log_decay({prelude(t.value_decay)}, \"{st.name}\"), "
                        f"(batch, tokens, heads, {cols}), dtype, scalar=False)"))
            helpers.update(() if t.value_log_is_exact else ("log_decay",))
            value_decay = f", value_log_decay={s}_value_log_decay"
        body.append(f"{s}_corrections = [" + ", ".join(
            f"({tok(u, rows)}, {tok(w, rows)})" for u, w in t.corrections) + "]")
        writes = []
        for key, value in t.writes:
            if running:
                c, alpha = split_exp(key)
                key_code = bind(f"per_token({_factor(prelude(c), c, alpha)} * "
                                f"{_shifted_exp(exponents[alpha], running, alpha, key)}, "
                                f"(batch, tokens, heads, {rows}), dtype, scalar={not key.shape})", "stable_key")
            else:
                key_code = tok(key, rows)
            val = tok(value, cols) if value is not None else "np.ones((batch, tokens, heads, 1), dtype)"
            writes.append(f"({key_code}, {val})")
        body.append(f"{s}_writes = [" + ", ".join(writes) + "]")
        mine = [r for r in d.readouts if r.state == st.name]
        queries = []
        for r in mine:
            readout_vars[r.index] = f"r{r.index}" + ("[..., 0]" if len(st.shape) == 1 and not r.is_value else "")
            c, beta = split_exp(r.query) if not r.is_value else (None, None)
            terms = []  # the readout's log-scale: the state's M as the readout sees it, and the query's max
            if running:
                name, code = _scale_seen(running, p.causal, r.before_update)
                if code and name not in lagged:
                    lagged.add(name)
                    body.append(f"{name} = {code}")
                terms.append(name)
            if r.is_value:
                queries.append(f"(None, {r.before_update})")  # the state itself
            elif running and beta is not None and variance(beta) == "token":
                # a per-token constant factored out of an exponential query cancels in ratios
                if beta not in query_max:
                    exponents.setdefault(beta, f"query_exponent{len(query_max)}")
                    query_max[beta] = f"query_max{len(query_max)}"
                    body.append(f"{exponents[beta]} = {prelude(beta)}")
                    body.append(f"{query_max[beta]} = " + (f"np.max({exponents[beta]}, axis=-1)" if beta.shape
                                                             else exponents[beta]))
                mu = query_max[beta]
                query = bind(f"per_token({_factor(prelude(c), c, beta)} * "
                             f"{_shifted_exp(exponents[beta], mu, beta, r.query)}, "
                             f"(batch, tokens, heads, {rows}), dtype, scalar={not r.query.shape})", "stable_query")
                queries.append(f"({query}, {r.before_update})")
                terms.append(mu)
            else:
                queries.append(f"({tok(r.query, rows)}, {r.before_update})")
            if terms:
                scale_of[r.index] = " + ".join(terms)
        init = f"initial_state[\"{st.name}\"]" + ("[..., None]" if len(st.shape) == 1 else "")
        if flipped:
            init = f"np.swapaxes({init}, -1, -2)"
        if running:  # the state enters scaled like the first token's keys
            init = f"rescale({init}, {scale}, {running}[:, 0], dtype)"
            helpers.add("rescale")
        if any(r.is_value for r in mine):
            body.append(f"# readouts (query, before the update): a query None reads {st.name} itself")
        targets = ", ".join(f"r{r.index}" for r in mine)  # (none for a state no output reads: `[], S = …`)
        body.append(f"[{targets}], {s} = {scan}({init}, {s}_log_decay, {s}_corrections, {s}_writes, "
                    f"[{', '.join(queries)}], causal={p.causal}, chunk_size=chunk_size{value_decay})")
        if running:
            body += [f"if {scale} is None:  # back to the true scale",
                     f"    {s} = rescale({s}, {running}[:, -1], None, dtype)"]
        if len(st.shape) == 1:
            body.append(f"{s} = {s}[..., 0]")
        if flipped:
            back = ", ".join(st.shape)
            body.append(f"{s} = np.ascontiguousarray(np.swapaxes({s}, -1, -2))  # back to [B, H, {back}]")
    body += ["", "# outputs from the readouts"]
    for name, expr in d.outputs:
        out = next(o for o in p.outputs if o.name == name)
        degrees = scale_degree(expr, scale_of)
        vars_here = dict(readout_vars)
        if scale_of and (degrees is None or any(degrees.values())):
            for i, sc in scale_of.items():  # the scales do not cancel: put them back
                vars_here[i] = f"({readout_vars[i]} * np.exp({sc})" + ("" if vars_here[i].endswith("[..., 0]")
                                                                      else "[..., None]") + ")"
        elif scale_of:
            body.append(f"# the scales exp(M + mu) of the readouts cancel in {name}")
        out_printer = em.printer(None, readout_vars=vars_here)
        code = out_printer(em.refold(expr))
        helpers |= out_printer.helpers
        body.append(f"{n(name)} = np.broadcast_to({code}, (batch, tokens, heads"
                    + "".join(", " + n(x) for x in out.value.shape) + ")).astype(dtype)")
    returns = em.returns()
    if stable:
        body += ["", "# states handed over with a log-scale go on with their new one (a decode loop)",
                 "final_state_scales = {}"]
        for key, group in {scale_keys[st]: groups[stable[st]] for st in stable}.items():
            body += [f"if {group}_scale is not None:", f"    final_state_scales[\"{key}\"] = {group}_max[:, -1]"]
        returns = returns[:-1] + ", **final_state_scales}"  # inside the states dict
    body += ["", returns]
    helpers |= base.helpers
    # these are NumPy helpers whatever module runs the scan
    numpy_only = ({"per_token", "log_decay", "running_max", "scale_decay", "rescale"} & helpers
                  if scan_module != "linrec.numpy.scan" else set())
    source = em.render(form, body, helpers - numpy_only, scan_module)
    if numpy_only:
        source = source.replace("import numpy as np\n", "import numpy as np\nfrom linrec.numpy.scan import "
                                + ", ".join(sorted(numpy_only)) + "\n", 1)
    return source


def _canonical_text(t) -> str:
    parts = []
    state = f"{t.state}_(t−1)" + ("" if t.value_decay is None else f"·diag({to_text(t.value_decay)})")
    if t.decay is None:
        parts.append(state)
    else:
        parts.append(f"{'diag(' + to_text(t.decay) + ')' if t.decay.shape else to_text(t.decay)}·{state}")
    for u, w in t.corrections:
        parts.append(f"({to_text(u)})⊗(({to_text(w)})·{t.state}_(t−1))")
    for key, value in t.writes:
        parts.append(f"({to_text(key)})" + (f"⊗({to_text(value)})" if value is not None else ""))
    return " + ".join(parts)


