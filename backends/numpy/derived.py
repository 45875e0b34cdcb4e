"""The derived forms of a recurrence as NumPy modules (docs/forms.md): the parallel and chunkwise forms (and
the recurrent form of programs with exponential feature maps) from the canonical decomposition of every
state's update, computed as per-token arrays and handed to a scan — linrec.numpy.scan's, or the compiled twins
in linrec.c.scan.

forward() reads, in order:
    the prologue     inputs, sizes, params; the values that do not depend on a state
    each state       its decomposition as per-token arrays (log-decay, corrections, writes); for exponential
                     keys, their stabilization (the running maximum M of their exponents, keys and queries
                     scaled down by it); its readouts' queries; the call of the scan; the final state back in
                     its layout and at its scale
    the outputs      from the readouts, with the readouts' scales multiplied back or cancelled
    the return       the final states, and the log-scales of the stabilized ones (a decode loop)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..compiler import Compiled, ir
from ..compiler.analysis import to_text, variance
from ..compiler.stabilize import log_scale_keys, scale_degree, stabilized_states
from ..compiler.transitions import Transition, split_exp
from .emitter import NUMPY_MODULES, PER_TOKEN_HELPERS, SCAN, SCANS, Emitter
from .printer import NumpyPrinter
from .shared_arrays import shared_calls, shared_per_token

SCAN_OF_FORM = {"parallel": "parallel_scan", "chunkwise": "chunkwise_scan", "recurrent": "recurrent_scan"}


# ---- what the pieces hand each other ---------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """How a group of stabilized states (those whose keys have the same exponents: S and z of Performer) is
    carried, as S·exp(−M): the variables of M [B, T, H], the running maximum of the exponents, and of the
    log-scale m handed over with the initial state ([B, H], or None at run time: the state is unscaled)."""
    running: str
    given: str


@dataclass
class Stabilization:
    """The stabilization of a module's exponential keys (compiler.stabilize), and the variables its states
    share."""
    states: dict[str, tuple]   # stabilized state → the exponents α of its write keys
    keys: dict[str, str]       # stabilized state → the name its log-scale is handed over under ("S.log_scale")
    groups: dict[tuple, Scale] = field(default_factory=dict)       # the exponents of a group → its scale
    exponents: dict[ir.Expr, str] = field(default_factory=dict)    # an exponent α or β → its variable
    query_max: dict[ir.Expr, str] = field(default_factory=dict)    # a query's exponent β → its per-token max
    lagged: set[str] = field(default_factory=set)                  # the variables of M_(t−1) and M_T so far
    bound: dict[str, str] = field(default_factory=dict)            # a scaled key's or query's code → variable


@dataclass
class Module:
    """One generated module as its pieces write it: names and printers (em), the lines of forward() so far,
    the helpers they call, and the readouts the outputs read."""
    em: Emitter
    scan: str                 # the scan it calls: parallel_scan, chunkwise_scan or recurrent_scan
    base: NumpyPrinter        # values over all tokens [B, T, H, *]
    stable: Stabilization
    body: list[str] = field(default_factory=list)
    helpers: set[str] = field(default_factory=set)
    readouts: dict[int, str] = field(default_factory=dict)  # readout → its code [B, T, H, *]
    scales: dict[int, str] = field(default_factory=dict)    # readout of a stabilized state → its log-scale

    def code(self, e: ir.Expr) -> str:
        """A derived expression (lets inlined) as code over all tokens, in the user's names."""
        return self.base(self.em.refold(e))

    def per_token(self, e: ir.Expr, width: str) -> str:
        """A derived expression as an array [B, T, H, width]."""
        return per_token(self.code(e), width, scalar=not e.shape)


@dataclass(frozen=True)
class Layout:
    """A state as the scan carries it, [B, H, rows, cols]: transposed where the decomposition carries Sᵀ
    (compiler.transpose), a vector state as one column."""
    name: str                 # the program's name of the state
    var: str                  # its variable
    shape: tuple[str, ...]    # its declared shape
    rows: str                 # the sizes of the carried rows and columns, as code
    cols: str
    flipped: bool             # carried as Sᵀ
    vector: bool


@dataclass(frozen=True)
class ScanArrays:
    """The variables of a state's decomposition as per-token arrays, handed to the scan."""
    log_decay: str
    corrections: str
    writes: str
    value_log_decay: str | None  # only where the value axis decays
    value_corrections: str | None = None  # only where a correction acts on the value side
    signs: tuple[str, str] | None = None  # a decay of either sign: σ_t and σ_(t−1) (scan.running_signs)
    value_signs: tuple[str, str] | None = None  # the same of a decay of the value axis: τ_t and τ_(t−1)


@dataclass(frozen=True)
class Reads:
    """A state's readouts as the scan takes and returns them."""
    targets: list[str]        # the variables it returns them in (none for a state no output reads)
    queries: list[str]        # the code of each (query, before the update); a query None reads the state
    reads_itself: bool        # some readout reads the state itself


# ---- the module ------------------------------------------------------------------------------------------
def emit_derived(compiled: Compiled, form: str, scan_module: str = SCAN) -> str:
    """The parallel, chunkwise (or, for stabilized programs, recurrent) form from the derived decomposition
    of every state's update. `scan_module` provides parallel_scan, chunkwise_scan and recurrent_scan (the
    C backend passes its compiled twins); the per-token values stay NumPy."""
    em = Emitter(compiled)
    mod = Module(em, SCAN_OF_FORM[form], em.printer(None),
                 Stabilization(stabilized_states(compiled), log_scale_keys(compiled)))
    mod.body = em.prologue() + em.hoisted_lets(mod.base, "values that do not depend on a state, for all tokens at once")
    mod.helpers = {"per_token", mod.scan}
    for st in em.p.states:
        emit_state(mod, st)
    emit_outputs(mod)
    mod.body += return_lines(mod)
    mod.helpers |= mod.base.helpers
    return em.render(form, shared_calls(shared_per_token(mod.body)), mod.helpers, helper_modules(scan_module))


def helper_modules(scan_module: str) -> dict[str, frozenset[str] | None]:
    """Where a module's helpers come from: NumPy's runtime modules, but the scans from `scan_module` when it is
    another. The per-token arrays and their stabilization stay NumPy; their import line comes first (where the
    C backend's glue has always had it)."""
    if scan_module == SCAN:
        return NUMPY_MODULES
    others = {module: names for module, names in NUMPY_MODULES.items() if module != SCAN}
    return {SCAN: PER_TOKEN_HELPERS, **others, scan_module: SCANS}


def emit_state(mod: Module, st: ir.State) -> None:
    """One state: its decomposition as per-token arrays (stabilized where its keys are exponential), its
    readouts, the call of the scan and its final state."""
    t = mod.em.c.decomposition.transition(st.name)
    lay = layout(mod.em, st)
    mod.body += header(lay, t)
    scale = running_max(mod, lay) if st.name in mod.stable.states else None
    arrays = scan_arrays(mod, lay, t, scale)
    reads = readouts(mod, lay, scale)
    mod.body += scan_call(mod, lay, arrays, reads, scale)
    mod.body += final_state(lay, scale)


def layout(em: Emitter, st: ir.State) -> Layout:
    """The state as the scan carries it."""
    flipped = st.name in em.c.decomposition.transposed
    shape = tuple(reversed(st.shape)) if flipped else st.shape
    return Layout(name=st.name, var=em.name(st.name), shape=st.shape, rows=em.name(shape[0]),
                  cols="1" if len(shape) == 1 else em.name(shape[1]), flipped=flipped, vector=len(st.shape) == 1)


def header(lay: Layout, t: Transition) -> list[str]:
    """The state's comment: its kind and its canonical decomposition."""
    return ["", f"# {lay.name}: {t.kind}" + (f", carried transposed ({lay.name}ᵀ below)" if lay.flipped else ""),
            f"#   {lay.name}{'ᵀ' if lay.flipped else ''}_t = {canonical_text(t)}"]


def canonical_text(t: Transition) -> str:
    """S_t = D·S_(t−1)·E + Σ u⊗(w·S_(t−1)) + Σ key⊗value, in the program's terms."""
    parts = []
    state = f"{t.state}_(t−1)" + ("" if t.value_decay is None else f"·diag({to_text(t.value_decay)})")
    if t.decay is None:
        parts.append(state)
    elif t.elementwise:
        parts.append(f"({to_text(t.decay)})⊙{state}")
    else:
        parts.append(f"{'diag(' + to_text(t.decay) + ')' if t.decay.shape else to_text(t.decay)}·{state}")
    after = "" if t.value_decay is None else f"·diag({to_text(t.value_decay)})"
    for u, w in t.corrections:  # (a matrix u or w: a vector per column, beside an elementwise decay)
        read = f"Σ_rows(({to_text(w)})⊙{t.state}_(t−1))" if len(w.shape) == 2 else \
            f"({to_text(w)})·{t.state}_(t−1){after}"
        parts.append(f"({to_text(u)})⊙(1⊗({read}))" if len(u.shape) == 2 else f"({to_text(u)})⊗({read})")
    before = "" if t.decay is None or t.elementwise else f"diag({to_text(t.decay)})·"  # (an elementwise one: none)
    for a, b in t.value_corrections:
        parts.append(f"({before}{t.state}_(t−1)·({to_text(a)}))⊗({to_text(b)})")
    for key, value in t.writes:
        parts.append(f"({to_text(key)})" + (f"⊗({to_text(value)})" if value is not None else ""))
    return " + ".join(parts)


# ---- a state's decomposition as per-token arrays -----------------------------------------------------------
def per_token(code: str, width: str, scalar: bool) -> str:
    """The runtime's per_token: `code` (over all tokens; one number per token where `scalar`) as an array
    [B, T, H, width]."""
    return f"per_token({code}, (batch, tokens, heads, {width}), dtype, scalar={scalar})"


def scan_arrays(mod: Module, lay: Layout, t: Transition, scale: Scale | None) -> ScanArrays:
    """The state's canonical decomposition as per-token arrays: the log-decay of its rows (and of its columns,
    where they decay), its corrections (u, w) and its writes (key, value)."""
    s = lay.var
    decay, corrections, writes = (mod.em.fresh(f"{s}_{what}") for what in ("log_decay", "corrections", "writes"))
    terms = []
    if t.log_decay is not None:
        # one log-decay per token, per row, or per element ([B, T, H, rows, cols]: an elementwise decay)
        width = f"{lay.rows}, {lay.cols}" if t.elementwise else lay.rows if t.log_decay.shape else "1"
        terms.append(log_of_decay(mod, lay, t.log_decay, t.log_is_exact, t.magnitude, width, not t.decay.shape))
    if scale:
        terms.append(f"scale_decay({scale.running})" + ("[..., None]" if t.elementwise else "") + "  # M_(t−1) − M_t")
        mod.helpers.add("scale_decay")
    if not (terms or t.corrections or t.value_corrections or t.writes or t.value_log_decay is not None):
        # (a state left as it is, `z = z`: no per-token array would tell the scan how many tokens there are)
        terms.append("per_token(0.0, (batch, tokens, heads, 1), dtype, scalar=True)  # a decay of 1")
    mod.body.append(f"{decay} = " + (" + ".join(terms) if terms else "None"))
    value_decay = None
    if t.value_log_decay is not None:
        value_decay = mod.em.fresh(f"{s}_value_log_decay")
        mod.body.append(f"{value_decay} = " + log_of_decay(mod, lay, t.value_log_decay, t.value_log_is_exact,
                                                           t.value_magnitude, lay.cols, not t.value_decay.shape))
    along = lambda x: f"{lay.rows}, {lay.cols}" if len(x.shape) == 2 else lay.rows  # noqa: E731 (a vector per column)
    mod.body.append(f"{corrections} = [" + ", ".join(
        f"({mod.per_token(u, along(u))}, {mod.per_token(w, along(w))})" for u, w in t.corrections) + "]")
    pairs = []
    for key, value in t.writes:
        val = mod.per_token(value, lay.cols) if value is not None else "np.ones((batch, tokens, heads, 1), dtype)"
        pairs.append(f"({write_key(mod, lay, key, scale)}, {val})")
    mod.body.append(f"{writes} = [" + ", ".join(pairs) + "]")
    value_corrections = None
    if t.value_corrections:  # (S_(t−1)·a)⊗b: a and b both run along the columns
        value_corrections = mod.em.fresh(f"{s}_value_corrections")
        mod.body.append(f"{value_corrections} = [" + ", ".join(
            f"({mod.per_token(a, lay.cols)}, {mod.per_token(b, lay.cols)})" for a, b in t.value_corrections) + "]")
    signs = None
    if t.signed:
        signs = (mod.em.fresh(f"{s}_signs"), mod.em.fresh(f"{s}_signs_before"))
        mod.helpers |= {"running_signs", "with_signs", "signed_state"}
        mod.body += running_signs_lines(lay.name, signs, mod.code(t.decay), lay.rows, t.decay)
    value_signs = None
    if t.value_signed:
        value_signs = (mod.em.fresh(f"{s}_value_signs"), mod.em.fresh(f"{s}_value_signs_before"))
        mod.helpers |= {"running_signs", "with_value_signs", "value_signed_reads", "value_signed_state"}
        mod.body += running_signs_lines(lay.name, value_signs, mod.code(t.value_decay), lay.cols, t.value_decay,
                                        value_axis=True)
        mod.body.append(f"{writes}, {value_corrections or '_'} = with_value_signs({value_signs[0]}, {value_signs[1]}, "
                        f"{writes}, {value_corrections or '[]'})")
    return ScanArrays(decay, corrections, writes, value_decay, value_corrections, signs, value_signs)


def running_signs_lines(state: str, signs: tuple[str, str], code: str, width: str, decay: ir.Expr,
                        value_axis: bool = False) -> list[str]:
    """A decay of either sign's running signs σ_t, σ_(t−1) (`signs`; linrec.numpy.scan.running_signs) from its
    `code`, one per token or per row of `width` (of the columns on the value axis), and the comment that says
    what the scans carry (the forward's module and the backward's)."""
    what, carried, helper = (f"the decay of {state}'s value axis", f"{state}_t·diag(τ_t), τ_t", "with_value_signs") \
        if value_axis else (f"{state}'s decay", f"σ_t ⊙ {state}_t, σ_t", "with_signs")
    per_row = per_token(code, width if decay.shape else "1", not decay.shape)
    return [f"# {what} may be negative: the scans carry {carried} the running product of its signs, which decays by "
            f"|decay| ({helper})", f"{signs[0]}, {signs[1]} = running_signs({per_row})"]


def log_of_decay(mod: Module, lay: Layout, log: ir.Expr, exact: bool, decay: ir.Expr, width: str,
                 scalar: bool) -> str:
    """A decay's log per token, [B, T, H, width]: the decomposition's log where it is exact, else the runtime's
    log_decay of the decay itself."""
    if exact:
        return mod.per_token(log, width)
    mod.helpers.add("log_decay")
    return per_token(f"log_decay({mod.code(decay)}, \"{lay.name}\")", width, scalar)


def write_key(mod: Module, lay: Layout, key: ir.Expr, scale: Scale | None) -> str:
    """A write's key over all tokens; a state carried as S·exp(−M) writes c·exp(α) as c·exp(α − M), ≤ c."""
    if scale is None:
        return mod.per_token(key, lay.rows)
    c, alpha = split_exp(key)
    shifted = shifted_exp(mod.stable.exponents[alpha], scale.running, alpha, key)
    return bind(mod, per_token(f"{factor(mod, c, alpha)} * {shifted}", lay.rows, not key.shape),
                "stable_key")


# ---- the stabilization of exponential keys and queries ------------------------------------------------------
def running_max(mod: Module, lay: Layout) -> Scale:
    """The scale of the state's group, written at its first state: the exponents α of its keys and their
    running maximum M, started from the log-scale handed over with the initial state."""
    stable, fresh, s = mod.stable, mod.em.fresh, lay.var
    alphas = stable.states[lay.name]
    if alphas in stable.groups:
        return stable.groups[alphas]
    mod.helpers.add("running_max")
    mod.body.append(f"# exponential features: keep {lay.name}·exp(−M) with M the running maximum of the "
                    f"exponents, so every exp(α − M) ≤ 1")
    for a in alphas:
        if a not in stable.exponents:
            stable.exponents[a] = fresh(f"{s}_exponent{len(stable.exponents)}")
            mod.body.append(f"{stable.exponents[a]} = {mod.code(a)}")
    joined = ", ".join(stable.exponents[a] + ("" if a.shape or len(alphas) == 1 else "[..., None]") for a in alphas)
    joined = joined if len(alphas) == 1 else f"np.concatenate([{joined}], axis=-1)"
    scale = stable.groups[alphas] = Scale(fresh(f"{s}_max"), fresh(f"{s}_scale"))
    key = stable.keys[lay.name]
    mod.body += ["# a state handed over with its log-scale (a decode loop) is S·exp(−m): start M from m",
                 f"{scale.given} = initial_state.get(\"{key}\")  # [B, H] or None (then S is unscaled)",
                 f"{scale.running} = running_max({joined}, {scale.given})  # M_t [B, T, H]"]
    return scale


def factor(mod: Module, c: ir.Expr, alpha: ir.Expr) -> str:
    """The factor c of a key or query c·exp(α), shaped to multiply exp(α − M): a scalar c that varies per
    token or head ([B, T, H] or [H]) against a vector α takes α's axis; any other c is printed as a factor (a
    sum such as 1 − sigmoid(a) in parentheses: the caller writes `{factor} * exp(…)`)."""
    if not c.shape and alpha.shape and variance(c) != "const":
        return f"({mod.code(c)})[..., None]"
    return mod.base.factor(mod.em.refold(c))


def shifted_exp(exponent: str, shift: str, alpha: ir.Expr, product: ir.Expr) -> str:
    """exp(α − M) in NumPy, M [B, T, H] a per-token shift, shaped to multiply into `product` (a key or query
    c·exp(α)): a vector α takes M along its last axis; a scalar α times a vector c gets that axis itself."""
    if alpha.shape:
        return f"np.exp({exponent} - {shift}[..., None])"
    return f"np.exp({exponent} - {shift})" + ("[..., None]" if product.shape else "")


def bind(mod: Module, code: str, name: str) -> str:
    """code into a variable, once: the states of a group (S and z) write and read the same ones."""
    bound = mod.stable.bound
    if code not in bound:
        bound[code] = mod.em.fresh(f"{name}{sum(v.startswith(name) for v in bound.values())}")
        mod.body.append(f"{bound[code]} = {code}")
    return bound[code]


def scale_seen(mod: Module, scale: Scale, before_update: bool) -> str:
    """The variable of the log-scale M that a readout of a state carried as S·exp(−M) sees, written at its
    first use. A readout before the update reads S_(t−1)·exp(−M_(t−1)): one token behind (the first token's
    is the initial state's, brought to M_1); a non-causal one reads S_T·exp(−M_T) at every token."""
    running, fresh = scale.running, mod.em.fresh
    if not mod.em.p.causal:
        name = fresh(f"{running}_end", key=(running, "end"))
        code = f"np.broadcast_to({running}[:, -1:], {running}.shape)  # M_T"
    elif before_update:
        name = fresh(f"{running}_before", key=(running, "before"))
        code = f"np.concatenate([{running}[:, :1], {running}[:, :-1]], axis=1)  # M_(t−1)"
    else:
        return running
    if name not in mod.stable.lagged:
        mod.stable.lagged.add(name)
        mod.body.append(f"{name} = {code}")
    return name


def scaled_query(mod: Module, lay: Layout, query: ir.Expr) -> tuple[str, str] | None:
    """An exponential query c·exp(β), β varying per token, read as c·exp(β − μ) with μ the per-token maximum
    of β: (its variable, μ's). μ is a per-token constant factored out, which cancels in ratios. None for
    any other query."""
    c, beta = split_exp(query)
    if beta is None or variance(beta) != "token":
        return None
    stable, fresh = mod.stable, mod.em.fresh
    if beta not in stable.query_max:
        if beta not in stable.exponents:
            stable.exponents[beta] = fresh(f"query_exponent{len(stable.query_max)}")
        stable.query_max[beta] = fresh(f"query_max{len(stable.query_max)}")
        mod.body.append(f"{stable.exponents[beta]} = {mod.code(beta)}")
        mod.body.append(f"{stable.query_max[beta]} = " + (f"np.max({stable.exponents[beta]}, axis=-1)" if beta.shape
                                                           else stable.exponents[beta]))
    mu = stable.query_max[beta]
    shifted = shifted_exp(stable.exponents[beta], mu, beta, query)
    return bind(mod, per_token(f"{factor(mod, c, beta)} * {shifted}", lay.rows, not query.shape),
                "stable_query"), mu


# ---- the readouts, the scan, the final state -----------------------------------------------------------------
def readouts(mod: Module, lay: Layout, scale: Scale | None) -> Reads:
    """The state's readouts as the scan takes them, and each one's code and log-scale for the outputs (the
    log-scale of a stabilized state's readout: the state's M as the readout sees it, plus its query's μ)."""
    mine = [r for r in mod.em.c.decomposition.readouts if r.state == lay.name]
    targets = [mod.em.fresh(f"r{r.index}") for r in mine]
    queries = []
    for r, target in zip(mine, targets):
        mod.readouts[r.index] = target + ("[..., 0]" if lay.vector and not r.is_value else "")
        terms = [scale_seen(mod, scale, r.before_update)] if scale else []
        if r.is_value:
            query = "None"  # the state itself
        elif scale and (scaled := scaled_query(mod, lay, r.query)):
            query, mu = scaled
            terms.append(mu)
        else:
            query = mod.per_token(r.query, lay.rows)
        queries.append(f"({query}, {r.before_update})")
        if terms:
            mod.scales[r.index] = " + ".join(terms)
    return Reads(targets, queries, any(r.is_value for r in mine))


def scan_call(mod: Module, lay: Layout, arrays: ScanArrays, reads: Reads, scale: Scale | None) -> list[str]:
    """The call of the scan: the initial state in the scan's layout (scaled like the first token's keys, for
    a state carried as S·exp(−M)) and the per-token arrays in, the readouts and the final state out."""
    init = f"initial_state[\"{lay.name}\"]" + ("[..., None]" if lay.vector else "")
    if lay.flipped:
        init = f"np.swapaxes({init}, -1, -2)"
    if scale:
        init = f"rescale({init}, {scale.given}, {scale.running}[:, 0], dtype)"
        mod.helpers.add("rescale")
    lines = []
    if reads.reads_itself:
        lines.append(f"# readouts (query, before the update): a query None reads {lay.name} itself")
    value_decay = f", value_log_decay={arrays.value_log_decay}" if arrays.value_log_decay else ""
    if arrays.value_corrections:
        value_decay += f", value_corrections={arrays.value_corrections}"
    queries = f"[{', '.join(reads.queries)}]"
    if arrays.signs:
        after, before = arrays.signs
        queries = mod.em.fresh(f"{lay.var}_readouts")
        lines.append(f"{arrays.corrections}, {arrays.writes}, {queries} = with_signs({after}, {before}, "
                     f"{arrays.corrections}, {arrays.writes}, [{', '.join(reads.queries)}], causal={mod.em.p.causal})")
    elif arrays.value_signs:
        queries = mod.em.fresh(f"{lay.var}_readouts")
        lines.append(f"{queries} = [{', '.join(reads.queries)}]")
    lines.append(f"[{', '.join(reads.targets)}], {lay.var} = {mod.scan}({init}, {arrays.log_decay}, "
                 f"{arrays.corrections}, {arrays.writes}, {queries}, causal={mod.em.p.causal}, "
                 f"chunk_size=chunk_size{value_decay})")
    if arrays.signs:
        if reads.reads_itself:
            mod.helpers.add("signed_reads")
            lines.append(f"[{', '.join(reads.targets)}] = signed_reads([{', '.join(reads.targets)}], {after}, "
                         f"{before}, {queries}, causal={mod.em.p.causal})")
        lines.append(f"{lay.var} = signed_state({lay.var}, {after})  # σ_T ⊙ {lay.name}̃_T: the state itself")
    if arrays.value_signs:
        after, before = arrays.value_signs
        lines += [f"[{', '.join(reads.targets)}] = value_signed_reads([{', '.join(reads.targets)}], {after}, "
                  f"{before}, {queries}, causal={mod.em.p.causal})",
                  f"{lay.var} = value_signed_state({lay.var}, {after})  # {lay.name}̃_T·diag(τ_T): the state itself"]
    return lines


def final_state(lay: Layout, scale: Scale | None) -> list[str]:
    """The final state as the program declares it, [B, H, *]: at its true scale unless it came with a
    log-scale (then it goes on with the new one), a vector without its column, untransposed."""
    s, lines = lay.var, []
    if scale:
        lines += [f"if {scale.given} is None:  # back to the true scale",
                  f"    {s} = rescale({s}, {scale.running}[:, -1], None, dtype)"]
    if lay.vector:
        lines.append(f"{s} = {s}[..., 0]")
    if lay.flipped:
        lines.append(f"{s} = np.ascontiguousarray(np.swapaxes({s}, -1, -2))  # back to [B, H, {', '.join(lay.shape)}]")
    return lines


# ---- the outputs and the return --------------------------------------------------------------------------
def emit_outputs(mod: Module) -> None:
    """Every output from the readouts, over all tokens."""
    em = mod.em
    mod.body += ["", "# outputs from the readouts"]
    for name, expr in em.c.decomposition.outputs:
        out = next(o for o in em.p.outputs if o.name == name)
        printer = em.printer(None, readout_vars=readouts_at_scale(mod, name, expr))
        code = printer(em.refold(expr))
        mod.helpers |= printer.helpers
        mod.body.append(f"{em.name(name)} = np.broadcast_to({code}, (batch, tokens, heads"
                        + "".join(", " + em.name(x) for x in out.value.shape) + ")).astype(dtype)")


def readouts_at_scale(mod: Module, name: str, expr: ir.Expr) -> dict[int, str]:
    """The readouts as output `name` = `expr` reads them: with the log-scales of stabilized states' readouts
    multiplied back, unless they cancel in it (a ratio such as (φ(q)·S)/(φ(q)·z))."""
    degrees = scale_degree(expr, mod.scales)
    if mod.scales and (degrees is None or any(degrees.values())):
        scaled = dict(mod.readouts)
        for i, log_scale in mod.scales.items():  # a readout [B, T, H, *] times exp of its scale [B, T, H]
            code = mod.readouts[i]
            scaled[i] = f"({code} * np.exp({log_scale})" + ("" if code.endswith("[..., 0]") else "[..., None]") + ")"
        return scaled
    if mod.scales:
        mod.body.append(f"# the scales exp(M + mu) of the readouts cancel in {name}")
    return mod.readouts


def return_lines(mod: Module) -> list[str]:
    """The return: outputs and final states, and beside the states the new log-scale of each stabilized group
    whose state came with one (a decode loop goes on with it)."""
    em, stable = mod.em, mod.stable
    returns = em.returns()
    if not stable.states:
        return ["", returns]
    scales = em.fresh("final_state_scales")
    lines = ["", "# states handed over with a log-scale go on with their new one (a decode loop)", f"{scales} = {{}}"]
    for key, scale in {stable.keys[st]: stable.groups[alphas] for st, alphas in stable.states.items()}.items():
        lines += [f"if {scale.given} is not None:", f"    {scales}[\"{key}\"] = {scale.running}[:, -1]"]
    return lines + ["", returns[:-1] + f", **{scales}}}"]  # inside the states dict
