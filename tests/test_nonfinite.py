"""Non-finite values (docs/guarantees.md#non-finite-values): every form on both backends, and the decode step,
against the float64 recurrent form on NumPy — the statements with IEEE arithmetic, the definition.

* A log-decay of −∞ (a decay of exactly 0, which `g <= 0` admits) resets the state, in every form.
* A NaN or ±∞ among token t's values changes nothing before t: tokens < t agree with the reference within
  1e-9 (relative to their largest value). From t on, NaN stands exactly where the reference has NaN, the
  infinities are the reference's, and the finite values agree within 1e-9 (float64; 5e-4 in float32).
* The C helpers give NumPy's value for NaN and ±∞ (relu(NaN) = NaN, elu(NaN) + 1 = NaN, …), on every
  register width.
* Softmax attention, whose parallel and chunkwise forms mask weights and not values, too.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec import registry
from linrec.c import build as c_build
from linrec.c import printer as c_printer
from linrec.c.kernel_source import Target, common_context
from linrec.numpy import runtime
from linrec.templating import environment

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BACKENDS = ("numpy", "c")
CHUNKS = (7, 16, 64)  # (64 > T: the whole sequence as one chunk)
TOKENS = 40
F64_RTOL, F32_RTOL = 1e-9, 5e-4

SOURCES = {
    # a vector state read as a value of its own (HGRN): the C forms run c.values' kernels
    "hgrn": """recurrence hgrn(d = 16)
input x[d], f[d] <= 0
state z[d]
z = exp(f)*z + (1 − exp(f))*x
output y = z
""",
    # every output reads the final state
    "bidirectional": """recurrence bidirectional(dk = 8, dv = 8) noncausal
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
""",
    # a decay without a symbolic logarithm (log_decay at run time): a = 0 is a reset
    "gated": """recurrence gated(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], a in [0, 1]
state S[dk, dv]
S = a·S + k⊗v
output o = q·S
""",
    # a log-decay with no declared range: +∞ and NaN are the token's non-finite values
    "unbounded": """recurrence unbounded(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], g[dk]
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
""",
    # a decay of the value axis (the C forms run c.elementwise's kernels)
    "columns": """recurrence columns(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv]
S = S·diag(exp(g)) + k⊗v
output o = q·S
""",
}


def program(name: str) -> linrec.Recurrence:
    if name in SOURCES:
        return linrec.compile(SOURCES[name], f"{name}.lin")
    return linrec.load(EXAMPLES / f"{name}.lin")


def builds(rec, backend: str, form: str) -> bool:
    return registry.backend(backend).why_not(rec.compiled, form) is None


def runs(rec, x, initial_state=None):
    """(label, outputs, final state) of every form on both backends, chunk sizes included, and of the decode
    step on both backends (the tokens one by one, the state carried)."""
    found = []
    for backend in BACKENDS:
        for form in rec.forms:
            if not builds(rec, backend, form):
                continue
            for chunk in CHUNKS if form == "chunkwise" else (None,):
                res = rec.run(x, form=form, backend=backend, chunk_size=chunk, initial_state=initial_state)
                found.append((f"{backend} {form} C={chunk}", res.outputs, res.final_state))
        if rec.program.causal:
            state = None if initial_state is None else {k: v.copy() for k, v in initial_state.items()}
            steps = {o.name: [] for o in rec.program.outputs}
            for t in range(x[next(iter(x))].shape[1]):
                out, state = rec.step({k: v[:, t] for k, v in x.items()}, state, backend=backend)
                for name in steps:
                    steps[name].append(out[name])
            found.append((f"{backend} step", {k: np.stack(v, axis=1) for k, v in steps.items()}, state))
    return found


def assert_like(got, ref, what: str, rtol: float):
    """NaN exactly where ref has NaN, ref's infinities, and finite values within rtol of ref's largest."""
    got = np.asarray(got, dtype=np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{what}: NaN where the reference has")
    infinite = np.isinf(ref)
    np.testing.assert_array_equal(np.where(np.isinf(got), got, 0), np.where(infinite, ref, 0),
                                  err_msg=f"{what}: infinities")
    finite = np.isfinite(ref)
    if finite.any():
        scale = max(np.max(np.abs(ref[finite])), 1e-300)
        err = np.max(np.abs(got[finite] - ref[finite])) / scale
        assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:g}"


def assert_follows_recurrent(rec, x, first: int, rtol: float = F64_RTOL, initial_state=None):
    """Every form and step against the float64 recurrent form on NumPy: tokens before `first` finite and
    within rtol, the rest (and the final states) like the reference."""
    as64 = {k: np.asarray(v, np.float64) for k, v in x.items()}
    init64 = None if initial_state is None else {k: np.asarray(v, np.float64) for k, v in initial_state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (NumPy's own arithmetic on NaN and ∞)
        ref = rec.run(as64, form="recurrent", backend="numpy", initial_state=init64)
        found = runs(rec, x, initial_state)
    for label, outputs, final in found:
        for name, r in ref.outputs.items():
            got = np.asarray(outputs[name], np.float64)
            if rec.program.causal:
                assert np.isfinite(got[:, :first]).all(), f"{label} {name}: a token before {first} is not finite"
                assert_like(got[:, :first], r[:, :first], f"{label} {name} before token {first}", rtol)
            assert_like(got[:, first:], r[:, first:], f"{label} {name} from token {first}", rtol)
        for name, r in ref.final_state.items():
            assert_like(final[name], r, f"{label} final state {name}", rtol)


def inputs(rec, seed: int = 3, dtype=np.float64, tokens: int = TOKENS):
    return rec.random_inputs(batch=2, tokens=tokens, heads=2, dtype=dtype, seed=seed)


# ---- resets: a log-decay of −∞ --------------------------------------------------------------------------
@pytest.mark.parametrize("name, input_name, tokens, channel", [
    ("gla", "g", (3, 17), 2),          # one channel of a per-channel decay
    ("gla", "g", (0, 25, 39), None),   # every channel; the first and last tokens
    ("gated_deltanet", "g", (9, 10), None),  # a scalar decay, under the delta rule
    ("hgrn", "f", (5, 30), 3),         # a vector state read as it is
    ("bidirectional", "g", (12,), 1),  # every output reads the final state
    ("columns", "g", (12,), 4),        # a decay of the value axis
])
def test_a_log_decay_of_minus_infinity_resets_in_every_form(name, input_name, tokens, channel):
    rec = program(name)
    x = inputs(rec)
    for t in tokens:
        x[input_name][(0, t, 1) + (() if channel is None else (channel,))] = -np.inf
    assert_follows_recurrent(rec, x, first=TOKENS)  # (a reset is no non-finite value: every token finite)


def test_a_zero_decay_resets_where_the_derived_forms_take_its_logarithm():
    rec = program("gated")
    x = inputs(rec)
    x["a"][:, 11] = 0.0
    x["a"][1, 30, 0] = 0.0
    assert_follows_recurrent(rec, x, first=TOKENS)


def test_mamba2_with_an_infinite_step_matches_the_recurrent_form():
    """dt = ∞ passes `dt > 0`: exp(dt·A) = 0 resets, and the write (dt·B)⊗x is infinite — NaN from there on
    in the recurrent form, and so in every form."""
    rec = program("mamba2")
    x = inputs(rec)
    x["dt"][0, 9, 1] = np.inf
    assert_follows_recurrent(rec, x, first=9)


def test_many_resets_keep_the_parallel_form_within_tolerance():
    """Each reset lowers the prefix sums by 750: in the parallel form, 256 of them and then a long stretch
    without one still give 1e-9."""
    rec = program("gla")
    x = rec.random_inputs(batch=1, tokens=1024, heads=1, dtype=np.float64, seed=5, decay_scale=0.01)
    x["g"][:, :512:2] = -np.inf
    ref = rec.run(x, form="recurrent").outputs["o"]
    for backend in BACKENDS:
        got = rec.run(x, form="parallel", backend=backend).outputs["o"]
        assert np.max(np.abs(got - ref)) <= F64_RTOL * np.max(np.abs(ref)), backend


# ---- NaN and ±∞ at one token --------------------------------------------------------------------------
@pytest.mark.parametrize("name, input_name, value", [
    ("gla", "q", np.inf),                 # (a NaN query reaches its own token only, in every form)
    *[("gla", n, v) for n in "kv" for v in (np.nan, np.inf)],
    *[("gated_deltanet", n, v) for n in "kv" for v in (np.nan, -np.inf)],
    ("linear_transformer", "k", np.nan),   # elu(NaN) + 1 is NaN on C too
    ("linear_transformer", "q", np.nan),
    ("linear_transformer", "v", np.inf),
    ("deltanet", "v", np.nan),             # corrections without a decay
    ("mamba2", "x", np.nan),
    ("mamba2", "B", np.inf),
    ("hgrn", "x", np.nan),
    ("hgrn", "x", np.inf),
    ("columns", "v", np.nan),
    ("columns", "q", np.inf),              # (the derived form's scores q·κ_j are ∞ of both signs: C falls back)
    ("unbounded", "g", np.inf),            # a log-decay of +∞ where no range is declared
    ("unbounded", "g", np.nan),
])
def test_a_nonfinite_value_affects_its_token_and_later_ones_only(name, input_name, value):
    rec = program(name)
    x = inputs(rec)
    t = 13
    if x[input_name].ndim == 4:
        x[input_name][0, t, 1, 2] = value
    else:
        x[input_name][0, t, 1] = value
    assert_follows_recurrent(rec, x, first=t)


@pytest.mark.parametrize("name, input_name", [("gla", "v"), ("gated_deltanet", "k"), ("hgrn", "x")])
def test_float32_kernels_follow_the_rule(name, input_name):
    """The C kernels' float path (and its token-by-token fallback) against the float64 reference."""
    rec = program(name)
    x = inputs(rec, dtype=np.float32)
    x[input_name][1, 21, 0, 1] = np.nan
    assert_follows_recurrent(rec, x, first=21, rtol=F32_RTOL)


@pytest.mark.parametrize("name, decay", [("gla", "g"), ("hgrn", "f")])
def test_a_nonfinite_initial_state_runs_its_head_token_by_token(name, decay):
    """∞ in the initial state under strong decays: the recurrent form keeps it (∞·e^−30 is ∞, token after
    token), where exp(b_t)·S_0 of a derived form would underflow to 0·∞ = NaN."""
    rec = program(name)
    x = inputs(rec)
    x[decay][1, :, 0] = -30.0
    sizes = {d.name: d.default for d in rec.program.dims}
    rng = np.random.default_rng(1)
    state = {s.name: rng.standard_normal((2, 2) + tuple(sizes[d] for d in s.shape)) for s in rec.program.states}
    state[rec.program.states[0].name][1, 0, 2] = np.inf  # (one row of batch row 1, head 0)
    assert_follows_recurrent(rec, x, first=0, initial_state=state)


def test_a_param_that_resets_every_token():
    """A_log = +∞ in one head of Mamba-2: A = −∞ and every token resets (exp(dt·A) = 0), so that head reads
    its current token's write only."""
    rec = program("mamba2")
    x = inputs(rec)
    params = rec.default_params(heads=2)
    params["A_log"] = np.array([params["A_log"][0], np.inf])
    params["A"] = -np.exp(params["A_log"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = rec.run({k: np.asarray(v, np.float64) for k, v in x.items()}, form="recurrent", params=params)
        for backend in BACKENDS:
            for form in rec.forms:
                got = rec.run(x, form=form, backend=backend, params=params).outputs["y"]
                assert_like(got, ref.outputs["y"], f"{backend} {form}", F64_RTOL)
    assert np.isfinite(ref.outputs["y"]).all()


# ---- the C helpers --------------------------------------------------------------------------------------
SCALAR_HELPERS = {"exp": "lr_exp", "log": "lr_log", "sigmoid": "lr_sigmoid", "logsigmoid": "lr_logsigmoid",
                  "softplus": "lr_softplus", "relu": "lr_relu", "elu": "lr_elu", "silu": "lr_silu",
                  "tanh": "lr_tanh", "sqrt": "lr_sqrt", "abs": "lr_abs", "elu_plus_one": "lr_elu_plus_one",
                  "cos": "lr_cos", "sin": "lr_sin"}
# every register and row helper the printer calls (its tables), and elu(x) + 1's, which it recognizes by shape
REGISTER_HELPERS = {**c_printer._REGISTER, "elu_plus_one": "lr_elu_plus_one_v"}
ROW_HELPERS = {**c_printer._ROWS, "elu_plus_one": "lr_elu_plus_one_row"}
NUMPY_HELPERS = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "abs": np.abs, "cos": np.cos,
                 "sin": np.sin,
                 **{n: getattr(runtime, n) for n in ("sigmoid", "logsigmoid", "softplus", "relu", "elu", "silu",
                                                     "elu_plus_one")}}
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 0.3, -0.7, 50.0, 9000.0, -9000.0]


def helper_kernel(ctype: str):
    """c_common.h.j2's helpers for the current target, each applied to an array: s_NAME (the scalar
    helper per element), v_NAME (one register at a time), r_NAME (the row helper); and lr_max_row."""
    common = environment("linrec.c").get_template("c_common.h.j2").render(
        **common_context(Target(ctype, c_build.vector_bytes())), block_tokens=16, inputs=[], checks_inputs=False)
    calls = [f"void s_{n}(const T *x, T *y, int n) {{ for (int i = 0; i < n; ++i) y[i] = {f}(x[i]); }}"
             for n, f in SCALAR_HELPERS.items()]
    calls += [f"void v_{n}(const T *x, T *y, int n) {{ for (int i = 0; i + VW <= n; i += VW) "
              f"lr_store(y + i, {f}(lr_load(x + i))); }}" for n, f in REGISTER_HELPERS.items()]
    calls += [f"void r_{n}(const T *x, T *y, int n) {{ {f}(y, x, n); }}" for n, f in ROW_HELPERS.items()]
    calls.append("T max_row(const T *x, int n) { return lr_max_row(x, n); }")
    cdef = "".join(f"void {kind}_{n}({ctype} *x, {ctype} *y, int n);\n"
                   for kind, table in (("s", SCALAR_HELPERS), ("v", REGISTER_HELPERS), ("r", ROW_HELPERS))
                   for n in table) + f"{ctype} max_row({ctype} *x, int n);\n"
    return c_build.build(common + "\n".join(calls) + "\n", cdef, "nonfinite_helpers")


@pytest.mark.parametrize("target", ["native", "avx2", "portable", "native, through memory"])
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_c_helpers_give_numpys_values_for_nan_and_infinities(ctype, target, monkeypatch):
    """(through memory: a register's halves as a GCC before 12 takes them, without __builtin_shufflevector)"""
    if target == "avx2" and "avx2" not in c_build._cpu_flags():
        pytest.skip("needs AVX2")
    if target.endswith("through memory"):
        monkeypatch.setenv("LINREC_CFLAGS", "-DLR_NO_SHUFFLEVECTOR")
    target = target.split(",")[0]
    monkeypatch.setenv("LINREC_C_TARGET", target)
    k = helper_kernel(ctype)
    dtype = np.float32 if ctype == "float" else np.float64
    x = np.resize(np.array(SPECIAL, dtype), 64)  # whole registers, for every width
    pointer = ctype + " *"
    for kind, table in (("s", SCALAR_HELPERS), ("v", REGISTER_HELPERS), ("r", ROW_HELPERS)):
        for name in table:
            got = np.full_like(x, 7.0)
            getattr(k.lib, f"{kind}_{name}")(k.ffi.cast(pointer, x.ctypes.data), k.ffi.cast(pointer, got.ctypes.data),
                                             x.size)
            with np.errstate(all="ignore"):
                expected = NUMPY_HELPERS[name](x.copy()).astype(np.float64)
            assert_like(got, expected, f"{kind}_{name} ({ctype}, {target})", 1e-6 if ctype == "float" else 1e-12)
    for row in ([1.0, np.nan, 3.0], [2.0] * 17 + [np.nan], [-np.inf] * 3, [np.inf, 1.0]):
        a = np.array(row, dtype)
        got, expected = k.lib.max_row(k.ffi.cast(pointer, a.ctypes.data), a.size), np.max(a)
        assert (np.isnan(got) and np.isnan(expected)) or got == expected, row


@pytest.mark.parametrize("target", ["native", "avx2", "portable"])
def test_the_register_exp_is_the_scalar_ones_formula(target, monkeypatch):
    """lr_exp_v, on every target (AVX-512's vscalefps, or the vector extensions' two-halves scaling on AVX2 and
    SSE), against lr_exp over float32's whole range of exp: from below the subnormals (−110: 0) past the top
    (95: ∞), within a few float32 roundings of each other and of float64's exp — subnormal results included,
    whose absolute error is what float32 can hold there."""
    if target == "avx2" and "avx2" not in c_build._cpu_flags():
        pytest.skip("needs AVX2")
    monkeypatch.setenv("LINREC_C_TARGET", target)
    k = helper_kernel("float")
    x = np.linspace(-110.0, 95.0, 1 << 16).astype(np.float32)
    pointer = k.ffi.cast("float *", x.ctypes.data)
    scalar, register = np.empty_like(x), np.empty_like(x)
    k.lib.s_exp(pointer, k.ffi.cast("float *", scalar.ctypes.data), x.size)
    k.lib.v_exp(pointer, k.ffi.cast("float *", register.ctypes.data), x.size)
    want = np.exp(x.astype(np.float64))
    for got in (scalar, register):
        assert np.array_equal(np.isinf(got), want > np.finfo(np.float32).max)
        finite = np.isfinite(got)
        error = np.abs(got[finite] - want[finite]) / np.maximum(want[finite], np.finfo(np.float32).tiny)
        assert error.max() <= 4e-7
    assert np.all(register[x < -104] == 0) and np.all(register[x > 89] == np.inf)


# ---- programs that read the sequence ------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_softmax_attention_values_follow_the_rule(value):
    """The parallel and chunkwise forms of attention mask its weights, not the values (its keys and queries
    already follow the rule): from the first token with a NaN or ±∞ on, the recurrent form over the KV
    cache runs the tokens."""
    rec = program("softmax")
    x = inputs(rec)
    x["v"][0, 13, 1, 2] = value
    x["v"][1, 29, 0, 0] = value  # (a later one in another batch row)
    assert_follows_recurrent(rec, x, first=13)


def test_softmax_attention_from_a_nonfinite_first_token():
    """∞ at token 0 of one batch row: every token runs over the KV cache, and a NaN at token 20 of the
    other batch row still reaches no earlier token."""
    rec = program("softmax")
    x = inputs(rec)
    x["v"][0, 0, 1, 5] = np.inf
    x["v"][1, 20, 0, 2] = np.nan
    assert_follows_recurrent(rec, x, first=0)


PARTLY_NAN = """recurrence t(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + k⊗v
output o = q·S + sqrt(v)
"""


def test_verify_compares_nan_for_nan_and_says_which_range_to_declare(tmp_path, capsys):
    """A reference with NaN on verify's random inputs (sqrt of a standard normal v): every form with exactly its
    NaN and its finite rest passes (each row was FAIL with errors inf), the report says once which range to
    declare; --grad says the same instead of an overflow error. A NaN where the reference is finite, or a
    finite value where it is NaN, still fails."""
    from linrec import verify
    from linrec.cli import main
    path = tmp_path / "partnan.lin"
    path.write_text(PARTLY_NAN)
    assert main(["verify", str(path), "--quick", "--backend", "numpy", "--dtype", "float64", "--form", "parallel"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and out.count("note: the reference itself has NaN") == 1
    assert "declare one such as `input v[dv] >= 0`" in out
    assert main(["verify", str(path), "--grad", "--quick", "--backend", "numpy", "--dtype", "float64"]) == 1
    assert "cannot check gradients: the reference itself has NaN" in capsys.readouterr().err
    ref = np.array([1.0, np.nan, np.inf, 2.0])
    assert verify.difference(ref + [1e-12, 0, 0, 0], ref)[1] < 1e-11
    assert verify.difference([1.0, 1.0, np.inf, 2.0], ref) == (np.inf, np.inf)
    assert verify.difference([np.nan, np.nan, np.inf, 2.0], ref) == (np.inf, np.inf)
    assert verify.difference([1.0, np.nan, -np.inf, 2.0], ref) == (np.inf, np.inf)
