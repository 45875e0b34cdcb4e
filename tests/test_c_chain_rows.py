"""The C backward's chain rule in one pass of C over the tokens' rows (linrec.c.chain_rows): every run of
statements against the same statements run by NumPy, the runs the C backward's modules make, and where a run
must end or fall back on NumPy."""
import numpy as np
import pytest

import linrec
from linrec.c import chain_rows as cr
from linrec.numpy.vjp import in_place, negated, own_array, unbroadcast

EXAMPLES = "examples"  # (the suite runs from the repository's root)

GLOBALS = {"np": np, "own_array": own_array, "unbroadcast": unbroadcast, "in_place": in_place, "negated": negated}
B, T, H, D = 2, 37, 3, 12


@pytest.fixture
def every_size(monkeypatch):
    """The kernel for runs of any size (by default a small one runs in NumPy)."""
    monkeypatch.setattr(cr, "MIN_ROW_VALUES", 0)


@pytest.fixture
def kernel_runs(monkeypatch):
    """The runs that went to the kernel (each a _Plan run), counted."""
    runs = []
    real = cr._Plan.run

    def counted(self):
        runs.append(self.p.targets)
        return real(self)
    monkeypatch.setattr(cr._Plan, "run", counted)
    return runs


def _scope(dtype, seed=0):
    r = np.random.default_rng(seed)
    rows = lambda *tail: r.standard_normal((B, T, H) + tail).astype(dtype)  # noqa: E731
    return {"dy": rows(D), "x": rows(D), "w": rows(D), "k": rows(D - 4), "dt": rows(), "s": rows(1),
            "A": r.standard_normal(H).astype(dtype), "Dv": r.standard_normal((H, D)).astype(dtype),
            "dA": np.zeros(H, dtype), "dDv": np.zeros((H, D), dtype), "dC": np.zeros((), dtype),
            "acc": rows(D), "dk": 8, "dtype": np.dtype(dtype)}


RUNS = {
    "a skip term and its param": """
        dA += unbroadcast(np.einsum('...i,...i->...', dy, x), dA.shape)
        dx = own_array(dy * A[..., None], x.shape, x.dtype, True)
        dx += w
    """,
    "scalars per token and per head": """
        ddt = own_array(s[..., 0] * A, dt.shape, dt.dtype, True)
        dA -= unbroadcast(s[..., 0] * dt, dA.shape)
        ddt += dt
        dC += unbroadcast(ddt * 2.0, dC.shape)
    """,
    "in_place, negated, sums and a temporary": """
        g = negated(in_place(w, '*', dt[..., None]))
        dk2 = own_array(np.einsum('...i->...', g)[..., None] * dk ** (-1.0 / 2.0) + x, x.shape, x.dtype, True)
        acc -= in_place(g * Dv, '/', 1.0 + dt[..., None] * dt[..., None])
        dDv += unbroadcast(g * x, dDv.shape)
        acc += dk2 * np.einsum('...i,...i->...', acc, x)[..., None]
    """,
    "rows of two widths": """
        a = own_array(k * s, k.shape, k.dtype, True)
        b = own_array(x * np.einsum('...i,...i->...', k, a)[..., None], x.shape, x.dtype, True)
        dA += unbroadcast(np.einsum('...i->...', b), dA.shape)
    """,
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("run", RUNS)
def test_a_run_gives_what_numpy_gives(run, dtype, every_size, kernel_runs):
    source = RUNS[run]
    ours, theirs = _scope(dtype), _scope(dtype)
    got = cr.chain_rows(source, ours, GLOBALS)
    want = cr._program(source).numpy(theirs, GLOBALS)
    assert kernel_runs, "the run went to NumPy"
    # float64 within a few roundings (the C contracts a·b + c into one), float32 the same at its precision; a
    # row's sums in double against NumPy's in the dtype
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for name, a, b in zip(cr.chain_targets(source), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = max(float(np.max(np.abs(b))), 1.0)
        assert float(np.max(np.abs(a - b))) <= tol * scale, name
    for name in ("acc", "dA", "dDv", "dC"):  # arrays changed in place, as NumPy changes them
        assert np.allclose(ours[name], theirs[name], rtol=tol, atol=tol * max(1.0, float(np.max(np.abs(theirs[name]))))), name


def test_a_later_statement_reads_the_rows_an_earlier_one_changed(every_size, kernel_runs):
    """`acc` changed in place, then read through another name (a view of it) and through its own: row by row
    in the run's order, as NumPy's whole passes one after the other give it."""
    source = """
        acc += w
        y = own_array(view * 2.0 + acc, x.shape, x.dtype, True)
    """
    ours, theirs = _scope(np.float64), _scope(np.float64)
    ours["view"], theirs["view"] = ours["acc"][..., :], theirs["acc"][..., :]
    got = cr.chain_rows(source, ours, GLOBALS)
    want = cr._program(source).numpy(theirs, GLOBALS)
    assert kernel_runs
    assert np.array_equal(got[1], want[1]) and np.array_equal(ours["acc"], theirs["acc"])


def _case(case):
    """The run's source and its arrays, changed so that the kernel does not take them."""
    source, scope = RUNS["a skip term and its param"], _scope(np.float32)
    if case == "float64 rows beside float32":
        scope["x"] = scope["x"].astype(np.float64)
    elif case == "a target not contiguous":
        source = "w += dy * A[..., None]"
        scope["w"] = np.asfortranarray(scope["w"])
    elif case == "no tokens":
        scope = {k: (v[:, :0] if isinstance(v, np.ndarray) and v.ndim >= 3 else v) for k, v in scope.items()}
    elif case == "rows of other tokens":
        scope["w"] = scope["w"][:, :-1]
    else:  # a read-only target: NumPy's error
        source = "w += dy * A[..., None]"
        scope["w"] = np.broadcast_to(scope["w"][:, :1], scope["w"].shape)
    return source, scope


@pytest.mark.parametrize("case", ["float64 rows beside float32", "a target not contiguous", "no tokens",
                                  "rows of other tokens", "a read-only target"])
def test_arrays_the_kernel_does_not_take_run_in_numpy(case, every_size, kernel_runs):
    source, ours = _case(case)
    theirs = _case(case)[1]
    try:
        want = cr._program(source).numpy(theirs, GLOBALS)
    except Exception as e:  # NumPy's own error, which the run gives as well
        with pytest.raises(type(e), match=str(e)[:20]):
            cr.chain_rows(source, ours, GLOBALS)
        assert not kernel_runs
        return
    got = cr.chain_rows(source, ours, GLOBALS)
    assert not kernel_runs
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_small_runs_stay_in_numpy(kernel_runs):
    """Below MIN_ROW_VALUES values in its widest statement a run is NumPy's (the kernel's call would cost more)."""
    cr.chain_rows(RUNS["a skip term and its param"], _scope(np.float64), GLOBALS)
    assert not kernel_runs and B * T * H * D < cr.MIN_ROW_VALUES


def test_where_a_run_ends():
    lines = ["d_a = own_array(x * 2.0, x.shape, x.dtype, True)",
             "# a comment, which goes with the line after it",
             "z = kernel(q)",                                     # may run before the run: moved above it
             "d_b = own_array(z * x, x.shape, x.dtype, True)",
             "y = vjp_thing(k, d_a, out=d_a)",                    # writes into an array: ends the run
             "d_c = own_array(y + 1.0, y.shape, y.dtype, True)",
             "d_c += vjp_thing(x, d_c)",                          # an operand computed from what the run wrote
             "if flag:",
             "    d_c += x"]
    out = cr.fused_lines(lines)
    assert out[:3] == ["# a comment, which goes with the line after it", "z = kernel(q)", 'd_a, d_b = chain_rows("""']
    after = next(i for i, x in enumerate(out) if x.startswith('""", locals(), '))
    assert out[after + 1:after + 3] == ["y = vjp_thing(k, d_a, out=d_a)", 'd_c, = chain_rows("""']
    close = '""", locals(), {"own_array": own_array})'  # (the helpers the statements call, by name)
    assert out[after] == close and out[-4:] == [close, "d_c += vjp_thing(x, d_c)", "if flag:", "    d_c += x"]


def test_an_operand_computed_after_an_array_changed_in_place_ends_the_run():
    """An operand that is a call is evaluated before the run; after the run changed in place an array made
    before it (which the call may read under another name), that would be too early."""
    out = cr.fused_lines(["w += x", "d = own_array(f(v) * 2.0, x.shape, x.dtype, True)"])
    assert out[0] == "w, = chain_rows(\"\"\"" and "d = own_array(f(v) * 2.0, x.shape, x.dtype, True)" in out


def test_mamba2s_chain_rule_is_one_run():
    """Mamba-2's skip term D·x and dt's gradients through dt·A and dt·B, one pass with the kernel's ∂x."""
    from linrec.c import grad as c_grad
    text = c_grad.emit(linrec.load(f"{EXAMPLES}/mamba2.lin").compiled)
    assert text.count("chain_rows(\"\"\"") == 1
    run = text[text.index("chain_rows(\"\"\""):text.index("locals(), {")]
    for line in ("d_D += unbroadcast(", "d_x = own_array(d_y * D[..., None]", "d_x += S_grads.writes[0][1]",
                 "d_A += unbroadcast("):
        assert line in run
    assert text.index("S_grads = adjoint_recurrent(") < text.index("chain_rows(\"\"\"")


@pytest.mark.parametrize("program", ["mamba2", "mamba1", "comba", "gdn2", "gated_oja", "linear_transformer",
                                     "performer", "preconditioned_deltanet", "retnet", "gated_deltanet"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_c_backward_with_its_runs_in_c_matches_numpy(program, dtype, every_size, kernel_runs):
    rec = linrec.load(f"{EXAMPLES}/{program}.lin")
    dims = {"dk": 8, "dv": 12}
    x = rec.random_inputs(2, 37, 3, dims=dims, dtype=dtype, seed=1)
    out = rec.run(x, backend="numpy", dims=dims).outputs
    g = {k: np.random.default_rng(2).standard_normal(v.shape).astype(dtype) for k, v in out.items()}
    ours = rec.vjp(x, g, form="recurrent", backend="c", dims=dims)
    want = rec.vjp(x, g, form="recurrent", backend="numpy", dims=dims)
    tol = 1e-9 if dtype == np.float64 else 5e-4
    for name, b in want.grads.items():
        a, b = np.asarray(ours.grads[name]), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert float(np.max(np.abs(a - b))) <= tol * max(1.0, float(np.max(np.abs(b)))), name
    if program in ("mamba2", "comba", "gdn2", "gated_oja", "performer"):
        assert kernel_runs, "no run went to the kernel"


@pytest.mark.parametrize("program", ["mamba2", "gdn2", "comba"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_chunkwise_c_backward_runs_them_too(program, dtype, every_size, kernel_runs):
    """The C chunkwise backward's module (c.grad_chunk) hands over the same runs; against the NumPy recurrent
    backward at the forms' tolerances."""
    rec = linrec.load(f"{EXAMPLES}/{program}.lin")
    dims = {"dk": 8, "dv": 12}
    x = rec.random_inputs(2, 37, 3, dims=dims, dtype=dtype, seed=4)
    out = rec.run(x, backend="numpy", dims=dims).outputs
    g = {k: np.random.default_rng(5).standard_normal(v.shape).astype(dtype) for k, v in out.items()}
    ours = rec.vjp(x, g, form="chunkwise", backend="c", dims=dims, chunk_size=8)
    want = rec.vjp(x, g, form="recurrent", backend="numpy", dims=dims)
    tol = 1e-9 if dtype == np.float64 else 5e-4
    for name, b in want.grads.items():
        a, b = np.asarray(ours.grads[name]), np.asarray(b)
        assert float(np.max(np.abs(a - b))) <= tol * max(1.0, float(np.max(np.abs(b)))), name
    assert kernel_runs, "no run went to the kernel"
