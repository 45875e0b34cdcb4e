"""What every generated NumPy module shares: the names (the program's, then the module's own), the printers
of IR expressions, the prologue and the parameters' defaults, and the module template with its imports."""
from __future__ import annotations

import dataclasses

from ..compiler import Compiled, ir
from ..compiler.analysis import children, inline_lets, rebuild, refs, states_in, to_text, variance, walk
from ..compiler.identifiers import INTERNAL, Namespace, user_names
from ..templating import comment_lines, environment
from ..version import VERSION
from .printer import NumpyPrinter

# The modules generated code imports its helpers from. runtime.py provides every helper the others do not.
RUNTIME, ATTENTION, SCAN = "linrec.numpy.runtime", "linrec.numpy.attention", "linrec.numpy.scan"
# the per-token arrays of a derived form and their stabilization: NumPy, whatever module runs the scans
PER_TOKEN_HELPERS = frozenset({"per_token", "log_decay", "running_max", "scale_decay", "rescale", "running_signs",
                               "with_signs", "signed_state", "signed_reads", "signed_grads",
                               "with_value_signs", "value_signed_reads", "value_signed_state", "value_signed_grads"})
SCANS = frozenset({"parallel_scan", "chunkwise_scan", "recurrent_scan"})
ATTENTION_HELPERS = frozenset({"visible_positions", "mask", "masked_softmax", "masked_mean", "masked_rmsnorm",
                               "masked_groupnorm", "softmax", "online_softmax_step",
                               "flash_attention", "flash_attention_backward",
                               "lsh_attention_dense", "lsh_attention_bucketed"})
# module → the helpers it provides (None: every helper no other module of the mapping lists), in the order of
# the import lines
NUMPY_MODULES: dict[str, frozenset[str] | None] = {RUNTIME: None, ATTENTION: ATTENTION_HELPERS,
                                                   SCAN: PER_TOKEN_HELPERS | SCANS}


def source_comment(compiled: Compiled) -> str:
    """The program as comment lines (comments cannot be broken by what the program's own comments hold)."""
    return "# Source program:\n" + comment_lines(compiled.source.strip(), "#     ", c=False)


def imports(helpers: set[str], modules: dict[str, frozenset[str] | None]) -> list[tuple[str, list[str]]]:
    """The import lines of a generated module as data: (module, the helpers imported from it, sorted) for each
    module of `modules` that gives any, in its order; a helper two modules list comes from the first. Each
    helper must be a reserved word of every module's namespace (compiler.identifiers.INTERNAL), or a user name
    could shadow it."""
    unreserved = helpers - INTERNAL
    if unreserved:
        raise RuntimeError(f"internal error: the helpers {sorted(unreserved)} are imported by generated modules "
                           f"but not reserved in compiler.identifiers.INTERNAL")
    listed = set().union(*(names for names in modules.values() if names is not None))
    lines, left = [], set(helpers)
    for module, names in modules.items():
        mine = left & names if names is not None else left - listed
        left -= mine
        if mine:
            lines.append((module, sorted(mine)))
    return lines


class Emitter:
    """Shared naming and printing for one generated module. Its names: self.name(dsl_name) for the program's
    names, all bound first; self.fresh(wanted) for every name the module makes of its own (compiler.identifiers)."""

    def __init__(self, compiled: Compiled):
        self.c = compiled
        self.p = compiled.program
        self.names = Namespace(INTERNAL)
        self.names.bind(user_names(self.p))
        self.name, self.fresh = self.names.user, self.names.fresh
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
            if isinstance(node, ir.HeadCount):
                return "heads"
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
        if any(isinstance(n, ir.Identity) for p in self.p.params if p.default is not None for n in walk(p.default)):
            lines.append("dtype = np.float64  # (the defaults' own: I is an eye of it)")
        lines += [f"{self.name(d.name)} = dims[\"{d.name}\"]" for d in self.p.dims
                  if any(d.name in p.shape or _uses_dim(p.default, d.name) for p in self.p.params)]
        printer = self.printer(None)
        unset: set[str] = set()  # params that may be None here: no default, or a default that reads such a param
        for prm in self.p.params:
            var = self.name(prm.name)
            if prm.default is None:
                unset.add(prm.name)
                lines.append(f"{var} = given.get(\"{prm.name}\")  # no default: the caller must pass '{prm.name}'")
                continue
            dims = (["heads"] if prm.per_head else []) + [self.name(d) for d in prm.shape]
            shape = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
            code = _print_param(prm.default, printer, shape, prm.per_head)
            if prm.shape and not prm.default.shape and variance(prm.default) != "const":
                code = f"({code})" + "[..., " + ", ".join(["None"] * len(prm.shape)) + "]"  # per head → [H, 1…]
            code = f"np.broadcast_to({code}, {shape}).astype(np.float64)"
            lines.append(f"# {prm.name} = {to_text(prm.default)}")
            code = self._unless_unset(prm, code, unset, lines)
            lines.append(f"{var} = given[\"{prm.name}\"] if \"{prm.name}\" in given else {code}")
        helpers |= printer.helpers
        return lines

    def _unless_unset(self, prm: ir.Param, code: str, unset: set[str], lines: list[str]) -> str:
        """A default computed from params the caller may leave out (`unset`, None then): None while one of
        them is (the caller is told the one without a default is missing, not a NumPy TypeError), and the
        param joins `unset`."""
        reads = [name for name in refs(prm.default, ir.ParamRef) if name in unset]
        if not reads:
            return code
        unset.add(prm.name)
        lines.append(f"# (None while {', '.join(repr(n) for n in reads)} is: no default, and not given)")
        return f"(None if {' or '.join(f'{self.name(n)} is None' for n in reads)} else {code})"

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

    def hoisted_lets(self, printer: NumpyPrinter, heading: str) -> list[str]:
        """The values that do not depend on a state, for all tokens at once, under a comment `heading` (no
        lines where there are none)."""
        lines = [f"{self.name(step.name)} = {self._hoisted_code(step, printer)}  # {step.name} = {to_text(step.value)}"
                 for step in self.p.steps if isinstance(step, ir.Let) and step.name in self.hoisted]
        return ["", f"# {heading}"] + lines if lines else []

    def _hoisted_code(self, step: ir.Let, printer: NumpyPrinter) -> str:
        code = printer(step.value)
        if step.name not in self.per_token:  # (a constant may print as a Python number)
            code = f"np.asarray({code}, dtype=dtype)"
        return code

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

    def render(self, form: str, body: list[str], helpers: set[str],
               modules: dict[str, frozenset[str] | None] = NUMPY_MODULES) -> str:
        """The module: default_params and forward (whose lines are `body`), importing `helpers` from `modules`
        (see imports)."""
        param_lines = self.param_lines(helpers)
        return environment(__package__).get_template("module.py.j2").render(
            name=self.p.name, form=form, version=VERSION, filename=self.c.filename,
            source_comment=source_comment(self.c), imports=imports(helpers, modules), param_lines=param_lines,
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
            key = f"<draw {len(draws)}>"  # (no DSL name: those are identifiers)
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
