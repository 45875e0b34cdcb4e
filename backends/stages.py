"""Programs derived in stages (compiler.stages), run stage after stage on any backend.

A program whose states read each other in one direction has its parallel and chunkwise forms stage by stage:
each stage is a program of its own, whose form the backend builds as it builds any other program's. The
values a stage hands on (a vector state's value, a readout q·S) are per-token outputs of its form and
per-token inputs of the next stage's. `Staged` wraps a backend so that the driver asks it about a staged
program as about any other (registry.BACKENDS are wrapped): which forms it builds (those it builds for every
stage), their source and the loaded form (`StagedModule`, which chains the stages' modules). The backward of a
staged form (`StagedGradient`) runs the stages' backwards from the last. The source of a staged form or
backward is one module (`_join`): the stages' generated modules, their functions renamed stage1_forward, …,
and the program's `default_params` and `forward` (or `backward`) chaining them as `StagedModule` (or
`StagedGradient`) does — printed one after another, the stages' modules would define `forward` once per stage
and the last would win; a C forward is kernels to read (no module), and stays the stages' in order. The
recurrent form and the decode step run the program as written: they need no stages; so does the recurrent
backward, but where a backend's is derived from the decomposition (which such a program has per stage: the C
backward, `staged_gradient_forms`) it runs stage by stage too.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .compiler import Compiled, stage_compiled
from .compiler.stages import run_in_order
from .dsl.errors import LinrecError
from .interface import Backend, Capabilities, Refusal
from .numpy import BACKEND as NUMPY
from .templating import comment_lines
from .version import VERSION

STAGED_FORMS = ("parallel", "chunkwise")  # the forms a staged program runs stage by stage


def in_stages(compiled: Compiled, form: str, forms: tuple[str, ...] = STAGED_FORMS) -> bool:
    """The form of this program runs stage after stage (`forms`: those that do, where it has stages)."""
    return bool(compiled.decomposition.stages) and form in forms


class Staged:
    """A backend (interface.Backend) that runs the parallel and chunkwise forms of staged programs stage by
    stage; everything else is the wrapped backend's."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, attribute):  # (emit_gradient, load_gradient, …: the wrapped backend's)
        return getattr(self.inner, attribute)

    def why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if not in_stages(compiled, form):
            return self.inner.why_not(compiled, form)
        why = compiled.decomposition.why_not(form)
        if why:
            return Refusal(f"'{compiled.name}' has no {form} form: {why}")
        for stage in compiled.decomposition.stages:
            refused = self.inner.why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"stage {stage.number} of '{compiled.name}' (state(s) {', '.join(stage.states)}): "
                               f"{refused.reason}", refused.advice)
        return None

    def emit(self, compiled: Compiled, form: str, **options) -> str:
        if not in_stages(compiled, form):
            return self.inner.emit(compiled, form, **options)
        refused = self.why_not(compiled, form)
        if refused:
            _refuse(self.name, compiled, form, refused)
        stages = compiled.decomposition.stages
        sources = [self.inner.emit(stage_compiled(compiled, stage), form, **options) for stage in stages]
        if _in_c(sources[0]):  # (kernels to read, no module to run: the stages' in order)
            return "\n\n".join(_comment(source, stage.header()) + "\n" + source
                                 for stage, source in zip(stages, sources))
        return staged_form_source(compiled, form, sources)

    def load(self, compiled: Compiled, form: str):
        if not in_stages(compiled, form):
            return self.inner.load(compiled, form)
        refused = self.why_not(compiled, form)
        if refused:
            _refuse(self.name, compiled, form, refused)
        stages = compiled.decomposition.stages
        return StagedModule(form, compiled, tuple(self.inner.load(stage_compiled(compiled, s), form) for s in stages))

    def recurrent_kernel(self, compiled: Compiled) -> str:
        return self.inner.recurrent_kernel(compiled)

    # ---- gradients: the stages' backwards in reverse stage order (docs/gradients.md) ----
    def gradient_in_stages(self, compiled: Compiled, form: str) -> bool:
        """The backward of this form runs stage by stage: the wrapped backend's backwards of that form are
        derived from the decomposition (`staged_gradient_forms`; the parallel and chunkwise ones by default)."""
        return in_stages(compiled, form, getattr(self.inner, "staged_gradient_forms", STAGED_FORMS))

    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if not self.gradient_in_stages(compiled, form):
            return self.inner.gradient_why_not(compiled, form)
        refused = self.why_not(compiled, form)  # (the backward of a form needs the form)
        if refused:
            return refused
        for stage in compiled.decomposition.stages[:-1]:  # (the backward runs these stages' forwards)
            refused = self.inner.why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"stage {stage.number} of '{compiled.name}' (state(s) {', '.join(stage.states)}): "
                               f"{refused.reason}", refused.advice)
        for stage in compiled.decomposition.stages:
            refused = self.inner.gradient_why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"'{compiled.name}' runs its {form} backward in stages, and the {form} backward of "
                               f"stage {stage.number} (state(s) {', '.join(stage.states)}) is not derived: "
                               f"{refused.reason}", refused.advice or
                               "the recurrent backward (form='recurrent') differentiates the program as written")
        return None

    def emit_gradient(self, compiled: Compiled, form: str) -> str:
        if not self.gradient_in_stages(compiled, form):
            return self.inner.emit_gradient(compiled, form)
        stages = compiled.decomposition.stages
        backwards = [self.inner.emit_gradient(stage_compiled(compiled, stage), form) for stage in reversed(stages)]
        # the forwards of the stages but the last (for the values they hand on) are NumPy's generated modules on
        # every backend: a backward module is Python on every backend, while a C forward is a kernel that linrec
        # builds and loads (its source is C to read); NumPy's gives the same values, to rounding
        forwards = [NUMPY.emit(stage_compiled(compiled, stage), form) for stage in stages[:-1]]
        return staged_gradient_source(compiled, form, backwards, forwards)

    def load_gradient(self, compiled: Compiled, form: str):
        if not self.gradient_in_stages(compiled, form):
            return self.inner.load_gradient(compiled, form)
        refused = self.gradient_why_not(compiled, form)
        if refused:
            raise LinrecError(f"the {self.name} backend does not build the {form} backward of '{compiled.name}': "
                              f"{refused}")
        stages = compiled.decomposition.stages
        forwards = tuple(self.inner.load(stage_compiled(compiled, s), form) for s in stages[:-1])
        backwards = tuple(self.inner.load_gradient(stage_compiled(compiled, s), form) for s in stages)
        return StagedGradient(form, compiled, forwards, backwards)


def _refuse(backend: str, compiled: Compiled, form: str, refused: Refusal):
    """(The driver asks why_not before it emits or loads: this is for direct callers.)"""
    raise LinrecError(f"the {backend} backend does not build the {form} form of '{compiled.name}': {refused}")


def _in_c(source: str) -> bool:
    """Whether generated source is C (it opens with a /* comment; Python's does not)."""
    return source.lstrip().startswith("/*")


def _comment(source: str, text: str) -> str:
    """`text` as a comment of the source's language."""
    return f"/* ==== {text} ==== */" if _in_c(source) else f"# ==== {text} ===="


class StagedModule:
    """A form of a staged program: the stages' modules run in order, each given the values the earlier ones
    handed on as inputs; the outputs and final states are gathered from the stages that compute them."""

    def __init__(self, form: str, compiled: Compiled, modules: tuple):
        self.form = form
        self.stages = compiled.decomposition.stages
        self.modules = modules
        self.output_names = tuple(o.name for o in compiled.program.outputs)
        counts = [m.capabilities.largest_count for m in modules if m.capabilities.largest_count is not None]
        # (ranges: the driver checks the program's inputs; zero states: the driver makes them, per stage here)
        self.capabilities = Capabilities(largest_count=min(counts) if counts else None)

    def forward(self, inputs: dict, params: dict, initial_state: dict | None, dims: dict[str, int],
                chunk_size: int | None = None) -> tuple[dict, dict]:
        outputs, final, _ = run_in_order(self.stages, inputs, params, initial_state, lambda stage, *arguments:
                                         self.modules[stage.number - 1].forward(*arguments, dims,
                                                                                chunk_size=chunk_size))
        return {name: outputs[name] for name in self.output_names}, final


class StagedGradient:
    """The backward of a staged form. The forward runs the stages but the last in order, for the values each
    hands on; then the stages' backwards run from the last: a stage's backward gives, besides the gradients of
    its inputs, params and initial states, the gradients of the values earlier stages handed it, which are
    upstream gradients of those stages' outputs of the same name (added to what the program's outputs there
    get, and summed over the stages that take them). A param several stages use gets the sum of their
    gradients (a default computed from other params passes each stage's share on: the chain rule is linear
    in it)."""

    def __init__(self, form: str, compiled: Compiled, forwards: tuple, backwards: tuple):
        self.form = form
        self.program = compiled.program
        self.stages = compiled.decomposition.stages
        self.forwards = forwards
        self.backwards = backwards

    def backward(self, inputs: dict, params: dict, initial_state: dict, dims: dict[str, int], grad_outputs: dict,
                 grad_final_state: dict, derived_params=(), chunk_size: int | None = None):
        # the stages but the last, for the values they hand on (values: the inputs and those)
        _, _, values = run_in_order(self.stages[:-1], inputs, params, initial_state, lambda stage, *arguments:
                                    self.forwards[stage.number - 1].forward(*arguments, dims, chunk_size=chunk_size))
        upstream = dict(grad_outputs)  # the program's outputs' gradients, and those of the values handed on
        outputs, final, grads = {}, {}, {}
        for stage, module in zip(reversed(self.stages), reversed(self.backwards)):
            program = stage.program
            given, used, state0 = stage.arguments(values, params, initial_state)
            seeds = {o.name: upstream.get(o.name) for o in program.outputs}
            for name, seed in seeds.items():
                if seed is None:  # (a value handed on that no later stage's gradient reached: none does)
                    seeds[name] = np.zeros_like(values[name])
            ends = {s.name: grad_final_state[s.name] for s in program.states if s.name in grad_final_state}
            derived = tuple(p.name for p in program.params if p.name in derived_params)
            out, fin, got = module.backward(given, used, state0, dims, seeds, ends, derived, chunk_size=chunk_size)
            outputs.update((name, out[name]) for name in stage.outputs)
            final.update(fin)
            for name, g in got.items():
                target = upstream if name in stage.takes else grads
                target[name] = g if name not in target else target[name] + g
        # an input, param or initial state no stage reads has gradient zero (the stages' modules list only theirs)
        for given in (inputs, params, initial_state):
            for name, value in given.items():
                grads.setdefault(name, np.zeros(np.shape(value), np.result_type(value, np.float32)))
        order = [x.name for x in self.program.inputs] + [p.name for p in self.program.params] + \
            [s.name for s in self.program.states]
        grads = {name: grads[name] for name in order if name in grads}
        return {o.name: outputs[o.name] for o in self.program.outputs}, \
            {s.name: final[s.name] for s in self.program.states}, grads


# ---- the source of a staged form or backward: one module ------------------------------------------------------
def staged_form_source(compiled: Compiled, form: str, sources: list[str]) -> str:
    """The generated module of a staged form: the stages' modules (`sources`, in stage order), each's forward
    named stage1_forward, …; the program's default_params; forward, which runs them as StagedModule does."""
    stages = compiled.decomposition.stages
    parts = [_defaults_part(compiled)] + [_Part(f"# ==== {stage.header()} ====", source, f"stage{stage.number}_",
                                                ("forward",)) for stage, source in zip(stages, sources)]
    title = (f"{compiled.name} — {form} form, stage by stage, generated by linrec {VERSION}. Do not edit.\n\n"
             f"Each stage's functions are named stage1_…, stage2_…; forward chains them.")
    return _join(title, compiled, parts, lambda names: _forward_chain(compiled, [n["forward"] for n in names[1:]]))


def staged_gradient_source(compiled: Compiled, form: str, backwards: list[str], forwards: list[str]) -> str:
    """The generated module of a staged backward: the stages' backward modules (`backwards`, from the last
    stage), each's backward named stage2_backward, …, and the forward modules of the stages but the last
    (`forwards`, in stage order), each's forward named stage1_forward, …; the program's default_params;
    backward, which runs them as StagedGradient does."""
    stages = compiled.decomposition.stages
    parts = [_defaults_part(compiled)]
    parts += [_Part(f"# ==== backward of {stage.header()} ====", source, f"stage{stage.number}_", ("backward",))
              for stage, source in zip(reversed(stages), backwards)]
    parts += [_Part(f"# ---- forward of stage {stage.number}, for the values it hands on (NumPy's, on every "
                    f"backend) ----", source, f"stage{stage.number}_", ("forward",))
              for stage, source in zip(stages, forwards)]
    title = (f"{compiled.name} — {form} backward, stage by stage, generated by linrec {VERSION}. Do not edit.\n\n"
             f"Each stage's functions are named stage1_…, stage2_…; backward chains them.")

    def chain(names: list[dict[str, str]]) -> str:
        backward = {stage.number: n["backward"] for stage, n in zip(reversed(stages), names[1:])}
        forward = {stage.number: n["forward"] for stage, n in zip(stages, names[1 + len(stages):])}
        return _backward_chain(compiled, forward, backward)
    return _join(title, compiled, parts, chain)


def _defaults_part(compiled: Compiled) -> _Part:
    """The program's default_params: the NumPy module's of its first form (the program as written), which
    Recurrence.default_params runs on every backend."""
    return _Part("# ---- the params' defaults: the program's, as Recurrence.default_params computes them ----",
                 NUMPY.emit(compiled, compiled.decomposition.forms[0]), "", ("default_params",))


# the names the chaining functions bind and read at the module's top level (they import numpy as np)
_CHAIN_IMPORT = (None, "numpy", "np")
_CHAIN_NAMES = frozenset({"forward", "backward", "np"})


@dataclass(frozen=True)
class _Part:
    """A generated module to take into the joined one: the comment line above it, its source, the prefix of
    the names its definitions get there, and the functions the chaining calls (it keeps what they reach)."""
    header: str
    source: str
    prefix: str
    roots: tuple[str, ...]


class _Parsed:
    """A part's top-level statements: those kept (the roots and what they reach), the names they define, use
    and bind anywhere, and the imports they use, as (module or None for `import name`, name, bound name)."""

    def __init__(self, part: _Part):
        self.part = part
        tree = ast.parse(part.source)
        self.body = tree.body
        imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
        docstring = tree.body[:1] if tree.body and isinstance(tree.body[0], ast.Expr) and \
            isinstance(tree.body[0].value, ast.Constant) and isinstance(tree.body[0].value.value, str) else []
        self.kept = _reached([s for s in tree.body if s not in imports and s not in docstring], part.roots)
        self.defined = [name for s in self.kept for name in _bound(s)]
        self.used = {n.id for s in self.kept for n in ast.walk(s) if isinstance(n, ast.Name)}
        self.identifiers = {_identifier(n) for s in self.kept for n in ast.walk(s)} - {None}
        self.imports = [(getattr(s, "module", None), a.name, a.asname or a.name.split(".")[0])
                        for s in imports for a in s.names if (a.asname or a.name.split(".")[0]) in self.used]


def _identifier(node: ast.AST) -> str | None:
    """The name a node reads or binds (a name, a function's, a class's, a parameter's), or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    return node.arg if isinstance(node, ast.arg) else None


def _bound(statement: ast.stmt) -> list[str]:
    """The names a top-level statement defines (a function, a class, an assignment's names)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = statement.targets if isinstance(statement, ast.Assign) else \
        [statement.target] if isinstance(statement, (ast.AnnAssign, ast.AugAssign)) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _reached(statements: list[ast.stmt], roots: tuple[str, ...]) -> list[ast.stmt]:
    """The statements that define the roots or what those read, in their order (a statement that defines
    nothing is kept: what it does is not known here)."""
    defining = {name: s for s in statements for name in _bound(s)}
    wanted, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in wanted or name not in defining:
            continue
        wanted.add(name)
        todo += [n.id for n in ast.walk(defining[name]) if isinstance(n, ast.Name)]
    return [s for s in statements if not _bound(s) or set(_bound(s)) & wanted]


def _fresh(wanted: str, taken: set[str]) -> str:
    """`wanted`, or with the first suffix _2, _3, … that makes it a name not taken."""
    name, number = wanted, 1
    while name in taken:
        number += 1
        name = f"{wanted}_{number}"
    return name


def _plan(parsed: list[_Parsed]) -> tuple[list[dict[str, str]], list[tuple[str | None, str, str]]]:
    """Each part's renames (its definitions take its prefix; an import it binds to another object than a part
    before it does, or that shadows a name another part reads unbound, such as a builtin, is renamed the
    same way) and the imports of the joined module. Parts come first in the order given, the chaining's names
    before all."""
    module, name, bound = _CHAIN_IMPORT
    binds = {bound: (module, name)}
    taken = set(_CHAIN_NAMES)
    imports = [_CHAIN_IMPORT]
    unbound = [p.used - set(p.defined) - {b for _, _, b in p.imports} for p in parsed]
    renames = []
    for index, p in enumerate(parsed):
        mine = {}
        for defined in p.defined:
            new = _fresh(p.part.prefix + defined, taken | (p.identifiers - {defined}))
            taken.add(new)
            if new != defined:
                mine[defined] = new
        read_elsewhere = set().union(*(u for i, u in enumerate(unbound) if i != index))
        for module, name, bound in p.imports:
            if binds.get(bound) == (module, name):
                continue  # (the same object, imported once)
            new = bound
            if bound in taken or bound in read_elsewhere:
                new = _fresh(p.part.prefix + bound, taken | p.identifiers)
                mine[bound] = new
            binds[new] = (module, name)
            taken.add(new)
            imports.append((module, name, new))
        renames.append(mine)
    return renames, imports


def _renamed(parsed: _Parsed, renames: dict[str, str]) -> str:
    """The part's kept statements, each with the comment lines above it, its names renamed (every Name and
    definition of a renamed name; a parameter of that name would be a local one, which no generated module
    has: an internal error)."""
    lines = parsed.part.source.split("\n")  # (the lines ast numbers: splitlines would break at \f, \u2028, …)
    edits = []  # (line, column in characters, old name, new name)
    for statement in parsed.kept:
        for node in ast.walk(statement):
            if isinstance(node, ast.arg) and node.arg in renames:
                raise RuntimeError(f"internal error: a parameter named {node.arg!r} in a generated module whose "
                                   f"top-level {node.arg!r} is renamed")
            if isinstance(node, ast.Name) and node.id in renames:
                line = lines[node.lineno - 1]
                column = len(line.encode("utf-8")[:node.col_offset].decode("utf-8"))
                edits.append((node.lineno - 1, column, node.id, renames[node.id]))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in renames:
                column = re.match(r"\s*(?:async\s+)?(?:def|class)\s+", lines[node.lineno - 1]).end()
                edits.append((node.lineno - 1, column, node.name, renames[node.name]))
    for row, column, old, new in sorted(edits, reverse=True):  # (from the right: earlier columns stay put)
        if lines[row][column:column + len(old)] != old:
            raise RuntimeError(f"internal error: {old!r} is not at line {row + 1}, column {column} of a generated "
                               f"module")
        lines[row] = lines[row][:column] + new + lines[row][column + len(old):]
    ends = {id(s): (parsed.body[i - 1].end_lineno if i else 0) for i, s in enumerate(parsed.body)}
    return "\n\n\n".join("\n".join(lines[ends[id(s)]:s.end_lineno]).strip("\n") for s in parsed.kept)


def _import_lines(imports: list[tuple[str | None, str, str]]) -> list[str]:
    """`import name as bound` lines, then one `from module import …` line per module, in the order met."""
    plain = [f"import {name}" + ("" if bound == name else f" as {bound}") for module, name, bound in imports
             if module is None]
    by_module: dict[str, list[str]] = {}
    for module, name, bound in imports:
        if module is not None:
            by_module.setdefault(module, []).append(name if bound == name else f"{name} as {bound}")
    return list(dict.fromkeys(plain)) + [f"from {m} import {', '.join(sorted(dict.fromkeys(names)))}"
                                         for m, names in by_module.items()]


def _join(title: str, compiled: Compiled, parts: list[_Part], chain: Callable[[list[dict[str, str]]], str]) -> str:
    """One module of the parts (their definitions renamed, their imports at the top) and the chaining, which
    `chain` writes from each part's roots' names there."""
    parsed = [_Parsed(p) for p in parts]
    renames, imports = _plan(parsed)
    sections = ["\n".join([f'"""{title}"""', "# Source program:",
                           comment_lines(compiled.source.strip(), "#     ", c=False)] + _import_lines(imports))]
    sections += [f"{p.part.header}\n{_renamed(p, r)}" for p, r in zip(parsed, renames)]
    sections.append(chain([{root: r.get(root, root) for root in p.part.roots} for p, r in zip(parsed, renames)]))
    return "\n\n\n".join(sections) + "\n"


# ---- the chaining, as generated code ---------------------------------------------------------------------------
def _names(program, kind: str) -> list[str]:
    return [x.name for x in getattr(program, kind)]


def _picked(source: str, names: list[str], read: str = "[{}]") -> str:
    """A dict literal of these entries of `source` ({"q": inputs["q"], …})."""
    return "{" + ", ".join(f'"{n}": {source}{read.format(chr(34) + n + chr(34))}' for n in names) + "}"


def _tuple(names: list[str]) -> str:
    """A tuple literal of these names as strings."""
    return "(" + ", ".join(f'"{n}"' for n in names) + (",)" if len(names) == 1 else ")")


def _stage_inputs(stage, handed_by: dict[str, int], handed: str) -> str:
    """A stage's inputs: the program's, and those an earlier stage handed on (`handed`: its outputs' name)."""
    return "{" + ", ".join(f'"{n}": ' + (f'{handed}{handed_by[n]}["{n}"]' if n in handed_by else f'inputs["{n}"]')
                           for n in _names(stage.program, "inputs")) + "}"


def _results(compiled: Compiled) -> tuple[str, str]:
    """The program's outputs and final states, each from the stage that computes it ({"o": out2["o"]}, …)."""
    stages, program = compiled.decomposition.stages, compiled.program
    output = {name: s.number for s in stages for name in s.outputs}
    state = {name: s.number for s in stages for name in s.states}
    return ("{" + ", ".join(f'"{o}": out{output[o]}["{o}"]' for o in _names(program, "outputs")) + "}",
            "{" + ", ".join(f'"{n}": final{state[n]}["{n}"]' for n in _names(program, "states")) + "}")


def _forward_chain(compiled: Compiled, calls: list[str]) -> str:
    """forward(): each stage's forward in order (StagedModule.forward), written out."""
    stages = compiled.decomposition.stages
    handed_by = {h.name: s.number for s in stages for h in s.hands}
    lines = ["def forward(inputs, params, initial_state, dims, chunk_size=None, first=0):",
             '    """The program\'s forward: the stages\' in order, each given the values the earlier ones hand on as',
             "    inputs. Inputs [B, T, H, *], params as from default_params, initial states [B, H, *].",
             "",
             '    Returns (outputs [B, T, H, *], final states [B, H, *]).',
             '    """']
    for stage, call in zip(stages, calls):
        n, program = stage.number, stage.program
        lines += [f"    # {stage.header()}",
                  f"    out{n}, final{n} = {call}(",
                  f"        {_stage_inputs(stage, handed_by, 'out')},",
                  f"        {_picked('params', _names(program, 'params'))},",
                  f"        {_picked('initial_state', _names(program, 'states'))},",
                  "        dims, chunk_size=chunk_size, first=first)"]
    outputs, final = _results(compiled)
    return "\n".join(lines + [f"    return {outputs}, {final}"])


def _backward_chain(compiled: Compiled, forward: dict[int, str], backward: dict[int, str]) -> str:
    """backward(): the forwards of the stages but the last, then the stages' backwards from the last
    (StagedGradient.backward), written out."""
    stages, program = compiled.decomposition.stages, compiled.program
    handed_by = {h.name: s.number for s in stages for h in s.hands}
    lines = [("def backward(inputs, params, initial_state, dims, grad_outputs, grad_final_state, derived_params=(), "
              "chunk_size=None):"),
             '    """The program\'s forward and its vector–Jacobian product, stage by stage (docs/gradients.md,',
             '    "Programs derived in stages"). Arguments as each stage\'s backward: inputs [B, T, H, *], params as',
             "    from default_params, initial states [B, H, *]; grad_outputs: the gradient of every output;",
             "    grad_final_state: of the final states (a state absent or None: zero); derived_params: the params",
             "    whose defaults were used; chunk_size: as the stages' backwards take it.",
             "",
             "    Returns (outputs, final states, gradients of every input, param and initial state by name).",
             '    """',
             "    # the forward of the stages but the last, for the values each hands on"]
    for stage in stages[:-1]:
        n = stage.number
        lines += [f"    handed{n}, _ = {forward[n]}(",
                  f"        {_stage_inputs(stage, handed_by, 'handed')},",
                  f"        {_picked('params', _names(stage.program, 'params'))},",
                  f"        {_picked('initial_state', _names(stage.program, 'states'))},",
                  "        dims, chunk_size=chunk_size)"]
    lines += ["",
              "    # the stages' backwards from the last: each gives the gradients of the values handed to it, which",
              "    # seed the outputs of that name of the stage that handed them on"]
    for stage in reversed(stages):
        lines += _stage_backward(compiled, stage, handed_by, backward[stage.number])
    lines += ["", "    # a name several stages read gets the sum of their gradients; one no stage reads, zero",
              "    grads = {"]
    for kind, source in (("inputs", "inputs"), ("params", "params"), ("states", "initial_state")):
        lines += [f'        "{n}": {_gradient(stages, n, source)},' for n in _names(program, kind)]
    outputs, final = _results(compiled)
    return "\n".join(lines + ["    }", f"    return {outputs}, {final}, grads"])


def _stage_backward(compiled: Compiled, stage, handed_by: dict[str, int], call: str) -> list[str]:
    """The call of one stage's backward: its outputs' seeds are the program's gradients of them and the later
    stages' gradients of the values it handed on, summed (as StagedGradient adds them, from the last)."""
    n, program = stage.number, stage.program
    outputs = set(_names(compiled.program, "outputs"))
    seeds = []
    for name in _names(program, "outputs"):
        terms = ([f'grad_outputs["{name}"]'] if name in outputs else []) + \
            [f'grads{s.number}["{name}"]' for s in reversed(compiled.decomposition.stages)
             if s.number > n and name in s.takes]
        seeds.append(f'"{name}": ' + (" + ".join(terms) or f'np.zeros_like(handed{n}["{name}"])'))
    params = _names(program, "params")
    derived = f"tuple(name for name in {_tuple(params)} if name in derived_params)" if params else "()"
    return [f"    # {stage.header()}",
            f"    out{n}, final{n}, grads{n} = {call}(",
            f"        {_stage_inputs(stage, handed_by, 'handed')},",
            f"        {_picked('params', params)},",
            f"        {_picked('initial_state', _names(program, 'states'))},",
            "        dims,",
            "        {" + ", ".join(seeds) + "},",
            f"        {_picked('grad_final_state', _names(program, 'states'), read='.get({})')},",
            f"        {derived}, chunk_size=chunk_size)"]


def _gradient(stages, name: str, source: str) -> str:
    """The program's gradient of an input, param or initial state: the sum of the stages' that read it (the
    later first, as StagedGradient adds them), else zero."""
    terms = [f'grads{s.number}["{name}"]' for s in reversed(stages) if name not in s.takes and name in
             _names(s.program, "inputs") + _names(s.program, "params") + _names(s.program, "states")]
    value = f'{source}["{name}"]'
    return " + ".join(terms) or f"np.zeros(np.shape({value}), np.result_type({value}, np.float32))"
