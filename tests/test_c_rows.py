"""linrec.c.rows (templates/c_rows.c.j2): l2norm, rmsnorm and groupnorm and their vector–Jacobian products in
one pass of C, which the C backward's generated modules import in place of the NumPy helpers — the same values
(float64 to 1e-12, float32 to float32 rounding), the same NaN rows, the same bits on any number of threads, and
the NumPy helper for what the kernel does not take. Also the chain rule's two rewrites that make fewer
[B, T, H, d] arrays: a sum of a product as a contraction (compiler.adjoint._fit) and a scan's gradient
scaled in place (numpy.adjoint_derived.first_contributions). One kernel, built once."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import rows
from linrec.compiler import ir
from linrec.compiler.adjoint import Einsum, _fit
from linrec.numpy.adjoint_derived import first_contributions
from linrec.numpy import runtime as numpy_runtime
from linrec.numpy import vjp as numpy_vjps
from linrec.numpy.runtime import l2norm as numpy_l2norm
from linrec.numpy.vjp import vjp_l2norm as numpy_vjp_l2norm

BUILTINS = ["l2norm", "rmsnorm", "groupnorm"]


def _arrays(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) + 0.5  # (groupnorm: rows whose mean is not 0)
    x[(0,) * (len(shape) - 1)] = 0.0  # a zero row: eps keeps it finite
    return x.astype(dtype), rng.standard_normal(shape).astype(dtype)


def _relative(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


def _pair(builtin):
    """(the builtin, its vector–Jacobian product) of the C rows, and the same of NumPy."""
    return (getattr(rows, builtin), getattr(rows, "vjp_" + builtin)), \
        (getattr(numpy_runtime, builtin), getattr(numpy_vjps, "vjp_" + builtin))


@pytest.mark.parametrize("builtin", BUILTINS)
@pytest.mark.parametrize("shape", [(2, 7, 3, 5), (1, 33, 2, 64), (4, 129)])
def test_float64_matches_the_numpy_helpers(shape, builtin):
    x, g = _arrays(shape, np.float64)
    (f, vjp), (numpy_f, numpy_vjp) = _pair(builtin)
    for eps in (1e-6, 0.5):
        assert _relative(f(x, eps=eps), numpy_f(x, eps=eps)) <= 1e-12
        assert _relative(vjp(x, g, eps=eps), numpy_vjp(x, g, eps=eps)) <= 1e-12


@pytest.mark.parametrize("builtin", BUILTINS)
def test_float32_is_float32_and_rounds_like_it(builtin):
    x, g = _arrays((3, 40, 2, 64), np.float32, seed=1)
    (f, vjp), (numpy_f, numpy_vjp) = _pair(builtin)
    want_y, want_d = numpy_f(x.astype(np.float64)), numpy_vjp(x.astype(np.float64), g.astype(np.float64))
    y, d = f(x), vjp(x, g)
    assert y.dtype == d.dtype == np.float32
    assert _relative(y, want_y) <= 1e-6 and _relative(d, want_d) <= 1e-6


@pytest.mark.parametrize("builtin", BUILTINS)
def test_a_nan_stays_in_its_row(builtin):
    x, g = _arrays((5, 8), np.float64, seed=2)
    x[2, 3] = np.nan
    (f, vjp), (numpy_f, numpy_vjp) = _pair(builtin)
    for got, want in ((f(x), numpy_f(x)), (vjp(x, g), numpy_vjp(x, g))):
        assert np.isnan(got[2]).all() and np.isfinite(np.delete(got, 2, axis=0)).all()
        np.testing.assert_allclose(np.delete(got, 2, axis=0), np.delete(want, 2, axis=0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("builtin", BUILTINS)
def test_threads_give_the_same_bits(monkeypatch, builtin):
    x, g = _arrays((2, 301, 3, 17), np.float32, seed=3)
    (f, vjp), _ = _pair(builtin)
    monkeypatch.setattr(rows, "ROWS_PER_THREAD", 1)
    runs = []
    for threads in ("1", "3"):
        monkeypatch.setenv("LINREC_NUM_THREADS", threads)
        runs.append((f(x), vjp(x, g)))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_what_the_kernel_does_not_take_goes_to_numpy():
    x, g = _arrays((3, 6, 8), np.float64, seed=4)
    cases = [(x.astype(np.float16), g.astype(np.float16)),  # another dtype
             (x, g[0]),                                       # a gradient broadcast over the first axis
             (x[:, ::2], g[:, ::2]),                         # rows that are not contiguous
             (x, g.astype(np.float32))]                      # dtypes that differ
    for a, b in cases:
        with np.errstate(all="ignore"):  # (float16: the zero row's x·x + eps is 0, its gradient NaN, as on NumPy)
            want, got = numpy_vjp_l2norm(a, b), rows.vjp_l2norm(a, b)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
    assert rows.l2norm(np.zeros((0, 4))).shape == (0, 4)
    assert np.array_equal(rows.l2norm(x[:, ::2]), numpy_l2norm(x[:, ::2]))


def test_the_c_backward_modules_import_them():
    rec = linrec.load("examples/gated_deltanet.lin")
    assert "from linrec.c.rows import l2norm, vjp_l2norm" in gradients.emit(rec, "chunkwise", "c")
    # (the recurrent one's kernel normalizes q and k itself: c.normalized_rows, tests/test_c_normalized_rows.py)
    assert "linrec.c.rows" not in gradients.emit(rec, "recurrent", "c")
    assert "linrec.c.rows" not in gradients.emit(rec, "chunkwise", "numpy")
    retnet = linrec.load("examples/retnet.lin")  # (its output's groupnorm)
    assert "from linrec.c.rows import groupnorm, vjp_groupnorm" in gradients.emit(retnet, "recurrent", "c")


def test_the_sum_of_a_product_is_a_contraction():
    a, b = ir.InputRef((4,), "a"), ir.InputRef((4,), "b")
    s = ir.InputRef((), "s")
    got = _fit(ir.Arith((4,), "mul", ir.Arith((4,), "mul", a, ir.Dot((4,), s, b)), a), ())
    # Σ_i a_i·(s·b_i)·a_i = s·((a ⊙ b)·a): the scalar outside, the last two vector factors contracted
    assert isinstance(got, ir.Arith) and got.op == "mul" and got.left == s
    assert isinstance(got.right, Einsum) and got.right.spec == "i,i->" and got.right.args[1] == a
    one = _fit(ir.Arith((4,), "add", a, b), ())  # no product: the sum as it was
    assert isinstance(one, Einsum) and one.spec == "i->"


def test_a_scans_gradient_read_once_is_scaled_in_place():
    lines = ["d_q = np.zeros_like(q)", "d_q += S_grads.queries[0] * dk ** (-0.5)",
             "d_k = np.zeros_like(k)", "d_k += S_grads.writes[0][0] * beta[..., None]",
             "d_b = np.einsum('...i,...i->...', S_grads.writes[0][0], k)", "grads = {'q': d_q, 'k': d_k}"]
    got = first_contributions(lines, ("S_grads.",))
    assert got[:2] == ["d_q = own_array(S_grads.queries[0], q.shape, q.dtype, True)", "d_q *= dk ** (-0.5)"]
    # read twice: the product is an array of its own
    assert got[2] == "d_k = own_array(S_grads.writes[0][0] * beta[..., None], k.shape, k.dtype, True)"
    assert first_contributions(lines[:2], ())[0] == \
        "d_q = own_array(S_grads.queries[0] * dk ** (-0.5), q.shape, q.dtype, True)"
