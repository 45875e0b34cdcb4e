"""User names that spell a name the generated code makes for itself (issue 20, item 4).

Generated NumPy and C name their own arrays after the user's (S → S_writes, S_corrections, the C row pointer
in_q_t of input q, …) and import helpers by name (vecmat, rescale, …). A user name that spells one of them
must not change what the program computes. Each test compares a program whose names collide with such a name
to the same program under plain names, on the same backend and form, with the same inputs, initial states
and params: outputs and final states agree to 1e-12 (relative to the largest value; they are the same
arithmetic, so in practice they agree bit for bit). Beside the cases of the issue, a property test renames
the program's names to a seeded sample of the identifiers its generated code holds.
"""
from __future__ import annotations

import ast
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.dsl.errors import LinrecError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RTOL = 1e-12
BATCH, TOKENS, HEADS = 2, 11, 2

GLA = """\
recurrence gla(dk = 5, dv = 19)
input q[dk], k[dk], v[dv]
input g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
output y = k·S
"""
# the fused C kernel does not take a dense transition: C runs it statement by statement (c_statements)
DENSE = """\
recurrence dense(dk = 5, dv = 7)
input q[dk], k[dk], v[dv]
param W[dk, dk] = randn(std=0.3, seed=2)
state S[dk, dv]
S = W·S + k⊗v
output o = q·S
output y = k·S
"""
# a readout mixed with an input after the scan (y = r0 + D·x)
MAMBA = (EXAMPLES / "mamba2.lin").read_text()
# exponential feature maps: stabilized (S_exponent0, stable_key0, rescale …)
PERFORMER = (EXAMPLES / "performer.lin").read_text()
SOFTMAX = (EXAMPLES / "softmax.lin").read_text()
# a vector times a parameter matrix: NumPy's vecmat helper
PROJECTED = """\
recurrence projected(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
param W[dk, dk] = randn(std=0.4, seed=1)
state S[dk, dv]
S = S + (k·W)⊗v
output o = q·S
"""


def rename(source: str, renames: dict[str, str]) -> str:
    """The program with names renamed (whole words only; every occurrence, comments included)."""
    for old, new in renames.items():
        source = re.sub(rf"(?<!\w){re.escape(old)}(?!\w)", new, source)
    return source


def relative_error(actual, expected) -> float:
    """max|actual − expected| / max|expected|"""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-300)
    return float(np.max(np.abs(actual - expected), initial=0.0)) / scale


def call_data(rec, seed: int = 0):
    """Inputs and initial states (random, float64) and the file's params, by DSL name."""
    inputs = rec.random_inputs(batch=BATCH, tokens=TOKENS, heads=HEADS, seed=seed)
    sizes = {d.name: d.default for d in rec.program.dims}
    rng = np.random.default_rng(seed + 1)
    states = {s.name: 0.5 * rng.standard_normal((BATCH, HEADS) + tuple(sizes[d] for d in s.shape))
              for s in rec.program.states}
    return inputs, states, rec.module(rec.forms[0]).default_params(HEADS, sizes)


def renamed_keys(d: dict, renames: dict[str, str]) -> dict:
    """A dict by DSL name with the names renamed ("S.log_scale" goes with S)."""
    def key(k):
        head, dot, tail = k.partition(".")
        return renames.get(head, head) + dot + tail
    return {key(k): v for k, v in d.items()}


def assert_same_results(plain: str, renames: dict[str, str], backend: str, forms, seed: int = 0):
    """The renamed program gives the plain one's outputs and final states, form by form."""
    rec = linrec.compile(plain, "plain.lin")
    renamed = linrec.compile(rename(plain, renames), "renamed.lin")
    inputs, states, params = call_data(rec, seed)
    for form in forms:
        want = rec.run(inputs, form=form, backend=backend, params=params, initial_state=states)
        got = renamed.run(renamed_keys(inputs, renames), form=form, backend=backend,
                          params=renamed_keys(params, renames), initial_state=renamed_keys(states, renames))
        for kind, expected, actual in (("output", want.outputs, got.outputs),
                                       ("final state", want.final_state, got.final_state)):
            expected = renamed_keys(expected, renames)
            assert set(actual) == set(expected), (kind, set(actual), set(expected))
            for name in expected:
                err = relative_error(actual[name], expected[name])
                assert err <= RTOL, f"{backend} {form}, {renames}: {kind} '{name}' off by {err:.3g}"


def assert_same_steps(plain: str, renames: dict[str, str], tokens: int = 5):
    """The C decode step of the renamed program gives the plain one's outputs and states, token by token."""
    rec = linrec.compile(plain, "plain.lin")
    renamed = linrec.compile(rename(plain, renames), "renamed.lin")
    inputs, states, params = call_data(rec)
    state, state2 = dict(states), renamed_keys(states, renames)
    for t in range(tokens):
        token = {k: np.ascontiguousarray(v[:, t]) for k, v in inputs.items()}
        out, state = rec.step(token, state, backend="c", params=params)
        out2, state2 = renamed.step(renamed_keys(token, renames), state2, backend="c",
                                    params=renamed_keys(params, renames))
        for expected, actual in ((renamed_keys(out, renames), out2), (renamed_keys(state, renames), state2)):
            assert set(actual) == set(expected)
            for name, value in expected.items():
                assert relative_error(actual[name], value) <= RTOL, (t, name)


# ---- C: the row pointer of array x is x's C name with _t; a user name x_t beside x ----------------------
@pytest.mark.parametrize("plain", [GLA, DENSE], ids=["fused", "statement-by-statement"])
@pytest.mark.parametrize("renames", [{"k": "q_t"}, {"y": "o_t"}], ids=["input q_t", "output o_t"])
def test_c_row_pointer_names(plain, renames):
    assert_same_results(plain, renames, "c", ["recurrent"])
    assert_same_steps(plain, renames)


def test_dense_program_runs_statement_by_statement():
    """(what the case above relies on: the fused kernel does not take DENSE)"""
    from linrec.c.backend import recurrent_kernel
    assert recurrent_kernel(linrec.compile(DENSE).compiled) == "statement by statement"
    assert recurrent_kernel(linrec.compile(GLA).compiled) == "fused"


# ---- NumPy's derived forms (and the C scans and attention kernels, whose glue is the same NumPy) ------------
GENERATED_LOCALS = [
    (GLA, {"q": "S_writes"}), (GLA, {"q": "S_corrections"}), (GLA, {"k": "S_log_decay"}),
    (MAMBA, {"x": "r0"}),                                   # read again after the scan wrote r0
    (PERFORMER, {"q": "S_exponent0"}), (PERFORMER, {"v": "stable_key0"}), (PERFORMER, {"k": "rescale"}),
    (PERFORMER, {"o": "final_state_scales"}),
    (PROJECTED, {"q": "vecmat"}),
    (SOFTMAX, {"q": "k_seq"}), (SOFTMAX, {"q": "first"}),
]


def derived_forms(plain: str, backend: str) -> list[str]:
    """The forms whose code is generated NumPy: all but C's recurrent kernels (a sequence program's C forms
    are NumPy glue around attention kernels)."""
    rec = linrec.compile(plain)
    if backend == "c" and rec.decomposition.sequence is None:
        return [f for f in rec.forms if f != "recurrent"]
    return list(rec.forms)


@pytest.mark.parametrize("plain, renames", GENERATED_LOCALS,
                         ids=[f"{linrec.compile(p).name}-{'-'.join(r.values())}" for p, r in GENERATED_LOCALS])
@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_names_of_generated_locals(plain, renames, backend):
    assert_same_results(plain, renames, backend, derived_forms(plain, backend))


def test_name_of_a_builtin_the_sequence_forms_call():
    """(NumPy's KV-cache loop slices the sequence; C's glue has no such loop)"""
    assert_same_results(SOFTMAX, {"v": "slice"}, "numpy", ["recurrent"])


@pytest.mark.parametrize("renames", [{"q": "keys0"}, {"q": "values0"}, {"k": "attention"}])
def test_names_of_the_attention_kernels_glue(renames):
    """Softmax attention on C: NumPy glue (keys0, values0, query0) around compiled kernels (attention)."""
    assert_same_results(SOFTMAX, renames, "c", ["recurrent", "parallel", "chunkwise"])


def test_builtin_names_are_refused():
    """l2norm, exp, … name builtins: no program can define them (so they cannot shadow the helpers)."""
    with pytest.raises(LinrecError, match="'l2norm' is a builtin name and cannot name an input"):
        linrec.compile(rename(GLA, {"q": "l2norm"}))


# ---- names that start with "__" --------------------------------------------------------------------------
PLAIN = """\
recurrence dunder(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
input g <= 0
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = q·S
"""
TO_DUNDER = {"q": "__q", "k": "__", "g": "__debug__", "S": "__S", "o": "__o"}


def test_check_with_names_that_start_with_two_underscores(tmp_path):
    path = tmp_path / "dunder.lin"
    path.write_text(rename(PLAIN, TO_DUNDER))
    done = subprocess.run([sys.executable, "-m", "linrec", "check", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "__S  [B, H, dk, dv]" in done.stdout
    assert re.search(r"chunkwise\s+available", done.stdout)


def test_names_that_start_with_two_underscores_compute_as_plain_ones():
    assert_same_results(PLAIN, TO_DUNDER, "numpy", ["recurrent", "parallel", "chunkwise"])
    assert_same_results(PLAIN, TO_DUNDER, "c", ["recurrent", "chunkwise"])


# ---- every name the generated code uses, as a user name --------------------------------------------------
# Beside the examples: C statement by statement with a named value that reads a state and a vector state read
# as it is; a readout before the update, a delta-rule correction under a diagonal decay, two states; a state
# multiplied from the right (carried transposed)
OTHERS = {
    "mixed": """\
recurrence mixed(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], a
param W[dk, dk] = randn(std=0.3, seed=2)
state S[dk, dv], z[dk]
p = k·S
S = W·S + k⊗(v − p)
z = sigmoid(a)*z + k
output o = q·S + sum(z)*p
output y = z
""",
    "hybrid": """\
recurrence hybrid(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0, beta in (0, 1), a <= 0
kn = l2norm(k)
state S[dk, dv], z[dk]
output early = q·S
S = diag(exp(g))·S − beta*kn⊗(kn·S) + kn⊗v
z = exp(a)*z + kn
output o = (q·S) / (1 + q·z)
output y = z
""",
    "transposed": """\
recurrence transposed(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], beta in (0, 1)
state S[dv, dk]
S = S·(I − beta·k⊗k) + beta·v⊗k
output o = S·q
""",
}
PROGRAMS = {p.stem: p.read_text() for p in sorted(EXAMPLES.glob("*.lin"))} | OTHERS
ROLE_PREFIXES = ("in_", "prm_", "st_", "out_", "let_")  # of the C names of a program's arrays
GLUE = re.compile(r"/\* NumPy glue that prepares the arrays and calls the kernels below:\n(.*?)\n\*/", re.S)
# renames per program checked on NumPy (every form), and on C too: one where C builds a kernel of the
# program's own (a build costs ~1 s), two where C runs NumPy glue around kernels of its sizes alone
NUMPY_SAMPLE, C_SAMPLE, C_GLUE_SAMPLE = 6, 1, 2  # (NumPy: 6 keeps the suite in its 15 minutes)


def python_identifiers(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def c_identifiers(source: str) -> tuple[set[str], set[str]]:
    """The identifiers of a C source outside comments, as (the user names that would spell them — q_t for
    in_q_t: a user's name reaches C only behind its role's prefix —, those of the NumPy glue it carries in a
    comment)."""
    glue = GLUE.search(source)
    code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", source, flags=re.S))
    names = set(re.findall(r"\b[A-Za-z_]\w*", code))
    stems = {name[len(p):] for name in names for p in ROLE_PREFIXES if name.startswith(p) and len(name) > len(p)}
    return stems, python_identifiers(glue.group(1)) if glue else set()


def program_names(rec) -> set[str]:
    p = rec.program
    return {p.name} | {x.name for x in (*p.dims, *p.inputs, *p.params, *p.states)} | set(p.lets) \
        | {o.name for o in p.outputs}


def renames_to(source: str, candidates: list[str], count: int, rng: random.Random) -> list[dict]:
    """Up to `count` renames {user name: candidate} of an input, state, value or output of the program, for
    candidates drawn at random that the DSL takes as the new name (not a builtin, keyword or name in use)."""
    rec = linrec.compile(source)
    p = rec.program
    movable = [x.name for x in p.inputs] + [s.name for s in p.states] + list(p.lets) + [o.name for o in p.outputs]
    out = []
    for new in rng.sample(candidates, len(candidates)):
        # (not the name a candidate is made of: S_writes would go with S, as S_writes_writes)
        others = [old for old in movable if not new.startswith(old + "_")]
        if not others:
            continue
        renames = {rng.choice(others): new}
        try:
            linrec.compile(rename(source, renames))
        except LinrecError:
            continue
        out.append(renames)
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_generated_names_as_user_names(name):
    """A seeded sample of the identifiers in every generated NumPy module and C source of a program, each as
    the new name of one of its inputs, states, values or outputs: the same outputs and final states, on NumPy
    in every form, and on C in the recurrent form and one scan form."""
    source = PROGRAMS[name]
    rec = linrec.compile(source)
    numpy_names, c_names = set(), set()
    c_forms = []
    for form in rec.forms:
        numpy_names |= python_identifiers(rec.emit(form, backend="numpy"))
        try:
            stems, glue = c_identifiers(rec.emit(form, backend="c"))
        except LinrecError:
            continue
        c_names |= stems
        numpy_names |= glue
        c_forms.append(form)
    taken = program_names(rec)
    rng = random.Random(name)
    for renames in renames_to(source, sorted((numpy_names | c_names) - taken), NUMPY_SAMPLE, rng):
        assert_same_results(source, renames, "numpy", rec.forms)
    scans = [f for f in ("chunkwise", "parallel") if f in c_forms]
    c_checked = (["recurrent"] if "recurrent" in c_forms else []) + scans[:1]
    count = C_GLUE_SAMPLE if rec.decomposition.sequence is not None else C_SAMPLE
    for renames in renames_to(source, sorted((c_names or numpy_names) - taken), count, rng):
        assert_same_results(source, renames, "numpy", rec.forms)
        assert_same_results(source, renames, "c", c_checked)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_generated_modules_import_and_take_only_reserved_names(name):
    """What a generated NumPy module imports, its functions' parameters and the builtins it calls are words no
    user name takes (compiler.identifiers.INTERNAL: a user name is renamed away from them)."""
    from linrec.compiler.identifiers import INTERNAL
    rec = linrec.compile(PROGRAMS[name])
    modules = [rec.emit(form, backend="numpy") for form in rec.forms]
    for form in rec.forms:
        try:
            glue = GLUE.search(rec.emit(form, backend="c"))
        except LinrecError:
            continue
        modules += [glue.group(1)] if glue else []
    for module in modules:
        tree = ast.parse(module)
        imported = [a for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        bound = {a.asname or a.name for a in imported}
        params = {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
        stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        free = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} \
            - stored - bound - params - {"np"}
        # a program in stages is emitted as one module of its stages' modules (linrec.stages._join): their
        # functions, and an import two stages bind to different objects, take the stage's prefix, a spelling
        # chosen against every name of that stage's code — not a fixed word, and the imported name is the
        # stage module's own, reserved like any
        joined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and re.match(r"stage\d+_", n.name)}
        aliases = {a.asname for a in imported if a.asname and re.match(r"stage\d+_", a.asname)}
        originals = {a.name for a in imported if a.asname in aliases}
        assert ((bound - aliases) | originals | params | (free - joined)) - INTERNAL == set()
