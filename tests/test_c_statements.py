"""The C backend's statement-by-statement kernels (backends/c/statements.py) against the NumPy recurrent form.

They run every program the fused kernels do not take: elementwise decays of a matrix, factors on the
right, dense transitions, per-token matrices, writes that read another state, named values that read a
state before its update, reads from the right (S·q), non-causal programs of these. Tolerances as in
test_c_backend (max|x − ref| / max|ref| against the float64 NumPy recurrent form): 1e-10 in float64,
2e-5 in float32. Each program's kernels are built once per session (two dtypes, one size each).
"""
from __future__ import annotations

import numpy as np
import pytest
from test_c_backend import F32_RTOL, F64_RTOL, compare, random_state, rel_err

PROGRAMS = {
    # Mamba-1's selective scan: a decay per element of the state, exp(A_i·dt_j); a read from the right
    "selective": """\
recurrence selective(dk = 5, dv = 19)
input x[dv], B[dk], C[dk]
input dt[dv] in (0, 1)
param A[dk] per head = −exp(randn(std=0.5, seed=3))
state S[dk, dv]
S = exp(A⊗dt) * S + B⊗(dt*x)
output y = C·S
output s = sum(S·dt)
""",
    # gated slot attention: a softmax over one state's reads weighting the rows of another (18 slots: a whole
    # register of rows and a tail for lr_matvec's 16 at a time)
    "slots": """\
recurrence slots(dk = 7, dv = 5, m = 18)
input q[dk], k[dk], v[dv], a[m] in (0, 1)
state K[m, dk], V[m, dv]
K = diag(a)·K + (1 − a)⊗k
V = diag(a)·V + (1 − a)⊗v
output o = softmax(K·q)·V
""",
    # a decay per element as a power with a per-token exponent, a^(|k|⊗dt): the rows of the power a register at a
    # time (19 columns: a whole register and a tail)
    "powered": """\
recurrence powered(dk = 5, dv = 19)
input q[dk], k[dk], v[dv], dt[dv] in (0, 1)
param a[dk, dv] per head = uniform(0.5, 0.99, seed=2)
state S[dk, dv]
S = a^(abs(k)⊗dt) * S + k⊗v
output o = q·S
""",
    # decays on both sides of a delta rule
    "gates": """\
recurrence gates(dk = 7, dv = 18)
input q[dk], k[dk], v[dv], a[dk] <= 0, b[dv] <= 0
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = diag(exp(a))·(I − beta·kn⊗kn)·S·diag(exp(b)) + beta·kn⊗v
output o = q·S
""",
    # a dense per-head transition, a per-token matrix, a product of two dense matrices, a matrix used twice
    "dense": """\
recurrence dense(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
input A[dk, dk] in (-0.1, 0.1)
param M[dk, dk] per head = randn(std=0.15, seed=0)
state S[dk, dv]
S = (M·A)·S + 0.3·tanh(M)·S + k⊗v
output o = q·S + 0.1·(tanh(M)·q)·S
""",
    # a named value read before its state's update and used only after it (p = q·S_(t−1)); a write that
    # reads other states; a vector state read through a matrix state and through a dense parameter
    "cross": """\
recurrence cross(dk = 5, dv = 4)
input q[dk], k[dk], v[dv]
input g <= 0, beta in (0, 1)
param W[dk, dk] = randn(std=0.2, seed=1)
state S[dk, dv], z[dk], U[dk, dk]
kn = l2norm(k)
p = q·S
U = 0.5·U + 0.1·k⊗k
z = 0.3·z·U + 0.3·W·z + tanh(k)
S = exp(g)·S + beta·kn⊗(v − kn·S) + 0.01·z⊗v
output o = q·S + p
output r = z*sigmoid(q)
""",
    # a scalar times a correction of the state, exp(g)·(I − beta·kz⊗kz)·S, whose key reads a state that reads
    # this one back (a cycle: no stages)
    "scaled": """\
recurrence scaled(dk = 6, dv = 7)
input q[dk], k[dk], v[dv]
input g <= 0, beta in (0, 1)
state S[dk, dv], z[dk]
kz = l2norm(k + 0.1*z)
S = exp(g)·(I − beta·kz⊗kz)·S + beta·kz⊗v
z = exp(g)*z + 0.1*tanh(S·v)
output o = q·S
""",
    # an elementwise exponential in a product's right factor (fuzz seed 59): the vector product q·(E*S) is
    # printed before the update's loop, so the exponential there is no row of that loop's (it was: 'r6'
    # undeclared), and a row of it in the update
    "rowed": """\
recurrence rowed(dk = 5, dv = 18)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
state S[dk, dv]
S = (I − beta·q⊗q)·(exp(−(abs(k)⊗abs(v)))*S) + beta·q⊗v
output o = l2norm(k)·S
""",
    # every output reads the final state
    "encoder": """\
recurrence encoder(dk = 4, dv = 3) noncausal
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv]
S = S·diag(exp(g)) + k⊗v
output o = groupnorm(q·S)
output w = S·v
""",
}
CAUSAL = [n for n in PROGRAMS if n != "encoder"]
_RECS: dict = {}


@pytest.fixture(scope="session")
def linrec(cache_dir):
    import linrec
    return linrec


def rec_for(linrec, name):
    if name not in _RECS:
        _RECS[name] = linrec.compile(PROGRAMS[name], f"{name}.lin")
    return _RECS[name]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_runs_statement_by_statement(linrec, name):
    """None of them is the fused kernel's; every one has a C recurrent form, with its reason in the source."""
    from linrec.c import backend as c_backend
    rec = rec_for(linrec, name)
    assert c_backend.fused_why_not(rec.compiled) is not None
    assert c_backend.why_not(rec.compiled, "recurrent") is None
    src = rec.emit("recurrent", backend="c")
    assert "statement by statement" in src and "Not the fused kernel" in src
    assert ("int lr_step(" in src) == rec.program.causal


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_numpy(linrec, name, dtype):
    rec = rec_for(linrec, name)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    dims = {d.name: d.default for d in rec.program.dims}
    for batch, tokens, heads, seed in [(2, 37, 3, 0), (1, 1, 2, 1)]:
        inputs = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, seed=seed)
        compare(rec, inputs, random_state(rec, batch, heads, dims, np.float64, seed), dtype, rtol)


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_steps_chained_equal_prefill(linrec, monkeypatch, name, dtype):
    """Prefill 5 tokens, then step the rest — on two threads, one bound step in place — and compare with the
    prefill of all of them."""
    from linrec.c import kernel_source
    monkeypatch.setenv("LINREC_NUM_THREADS", "2")
    monkeypatch.setattr(kernel_source, "THREAD_WORK", 1)  # the prefill on both threads at these tiny sizes
    rec = rec_for(linrec, name)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    dims = {d.name: d.default for d in rec.program.dims}
    inputs = rec.random_inputs(batch=2, tokens=12, heads=3, seed=2, dtype=dtype)
    state0 = {k: v.astype(dtype) for k, v in random_state(rec, 2, 3, dims, np.float64, 2).items()}
    full = rec.prefill(inputs, backend="c", initial_state=state0)
    state = rec.prefill({k: v[:, :5] for k, v in inputs.items()}, backend="c", initial_state=state0).final_state
    token = {k: np.ascontiguousarray(v[:, 5]) for k, v in inputs.items()}
    step = rec.bind_step(token, state, backend="c")
    outs = []
    for t in range(5, 12):
        for k, v in inputs.items():
            token[k][...] = v[:, t]
        outs.append({k: v.copy() for k, v in step().items()})
    for k, v in full.outputs.items():
        assert rel_err(np.stack([o[k] for o in outs], axis=1), v[:, 5:]) <= rtol, k
    for k, v in full.final_state.items():
        assert rel_err(state[k], v) <= rtol, k


def test_products_follow_their_structure(linrec):
    """A delta rule between two diagonal decays, or behind a scalar (exp(g)·(I − beta·k⊗k)·S: the scalar taken
    out of the product), costs vector products (k·S), never a matrix product; two dense matrices meet in one
    (the product loop over k)."""
    assert "a_ik" not in rec_for(linrec, "gates").emit("recurrent", backend="c")
    scaled = rec_for(linrec, "scaled").emit("recurrent", backend="c")
    assert "a_ik" not in scaled and "/* kz·S */" in scaled


def test_a_state_in_memory_meets_vectors_through_the_matrix_helpers(linrec):
    """K·q and p·V of states as they are in memory go through lr_matvec and lr_vecmat (registers of sums kept
    across the rows, where a loop summed each row's lanes on its own), and the softmax between them through
    loops that vectorize (lr_max_row, lr_exp_row, a sum of lanes); the values: test_matches_numpy and
    test_steps_chained_equal_prefill on the same program."""
    source = rec_for(linrec, "slots").emit("recurrent", backend="c")
    readout = source[source.index("/* output o = softmax(K·q)·V */"):]
    readout = readout[:readout.index("}")]
    for helper in ("lr_matvec(", "lr_max_row(", "lr_exp_row(", "lr_vecmat("):
        assert helper in readout, helper
    assert "lr_exp(" not in readout


def test_a_power_with_a_per_token_exponent_goes_a_row_at_a_time(linrec):
    """a^(|k|⊗dt), a matrix per token: each row through lr_pow_v into a buffer before the update reads it (lr_pow in
    the update's loop would be a call per element); the values: test_matches_numpy and
    test_steps_chained_equal_prefill on the same program."""
    source = rec_for(linrec, "powered").emit("recurrent", backend="c")
    update = source[source.index("/* S = a^(abs(k)⊗dt)*S + k⊗v"):]
    update = update[:update.index("/* output")]
    assert "lr_pow_v(" in update and "] = lr_pow(" in update  # (the registers, then the tail)


def test_an_elementwise_decay_takes_its_exponentials_a_row_at_a_time(linrec):
    """exp(A⊗dt), a matrix per token, goes row by row into a buffer through the row helper (lr_exp_v's one
    vscalefps a register, where GCC's vectorized scalar lr_exp scales in two halves) before the update reads it;
    the values: test_matches_numpy and test_steps_chained_equal_prefill on the same program."""
    source = rec_for(linrec, "selective").emit("recurrent", backend="c")
    update = source[source.index("/* S = exp(A⊗dt)*S + B⊗(dt*x)"):]
    update = update[:update.index("/* output")]
    assert "lr_exp_row(r" in update and "lr_exp(" not in update
    assert "a_ik" in rec_for(linrec, "dense").emit("recurrent", backend="c")


def test_a_state_that_reads_itself_through_a_product(linrec):
    """z = z·(0.5·I + 0.1·U) reads every element of z for each one it writes: computed before z is
    overwritten (summing the product into z itself would read elements already written)."""
    rec = linrec.compile("""recurrence selfread(d = 5)
input k[d]
input a in (0, 1)
state U[d, d], z[d]
U = a·U + k⊗k
z = z·(0.5·I + 0.1·U)
output y = z
""", "selfread.lin")
    inputs = rec.random_inputs(batch=1, tokens=9, heads=2, seed=7)
    compare(rec, inputs, random_state(rec, 1, 2, {"d": 5}, np.float64, 7), np.float64, F64_RTOL)


def test_out_of_range_inputs_are_refused(linrec):
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "selective")
    inputs = rec.random_inputs(batch=1, tokens=4, heads=2, seed=3)
    inputs["dt"][0, 2, 1, 3] = 1.5
    with pytest.raises(RuntimeInputError, match="dt"):
        rec.run(inputs, form="recurrent", backend="c")
    state = rec.prefill({k: v[:, :2] for k, v in inputs.items()}, backend="c").final_state
    before = {k: v.copy() for k, v in state.items()}
    with pytest.raises(RuntimeInputError, match="dt"):
        rec.step({k: v[:, 2] for k, v in inputs.items()}, state, backend="c", inplace=True)
    for k, v in state.items():  # refused before any state was touched
        np.testing.assert_array_equal(v, before[k])


def test_noncausal_has_no_decode_step(linrec):
    from linrec.dsl.errors import LinrecError
    rec = rec_for(linrec, "encoder")
    inputs = rec.random_inputs(batch=1, tokens=3, heads=1, seed=0)
    with pytest.raises(LinrecError, match="non-causal"):
        rec.step({k: v[:, 0] for k, v in inputs.items()}, None, backend="c")


def test_exponential_keys_read_from_the_right_run_as_written(linrec):
    """S = S + exp(k)⊗v read as S·w has no derived forms, so nothing stabilizes it (the scales fold into
    readouts q·S only): both backends run its statements as written, and equal an explicit loop."""
    rec = linrec.compile("""recurrence expright(dk = 4, dv = 3)
input k[dk], v[dv], w[dv]
state S[dk, dv]
S = S + exp(k)⊗v
output o = S·w
""", "expright.lin")
    x = rec.random_inputs(batch=2, tokens=6, heads=2, seed=4)
    S = np.zeros((2, 2, 4, 3))
    expected = np.zeros((2, 6, 2, 4))
    for t in range(6):
        S = S + np.exp(x["k"][:, t])[..., :, None] * x["v"][:, t][..., None, :]
        expected[:, t] = np.einsum("bhij,bhj->bhi", S, x["w"][:, t])
    for backend in ("numpy", "c"):
        res = rec.run(x, form="recurrent", backend=backend)
        assert rel_err(res.outputs["o"], expected) <= F64_RTOL, backend
        assert rel_err(res.final_state["S"], S) <= F64_RTOL, backend


def test_check_says_how_c_runs_it(linrec, tmp_path, capsys):
    import json

    from linrec.cli import main
    path = tmp_path / "selective.lin"
    path.write_text(PROGRAMS["selective"])
    assert main(["check", str(path)]) == 0
    assert "recurrent   available (backends: numpy, c; C runs its statements one by one)" in capsys.readouterr().out
    assert main(["check", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["forms"][0]["c_kernel"] == "statement by statement"
