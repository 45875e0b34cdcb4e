"""linrec.numpy.adjoint_in_place: the generated backward's products computed in the memory of an array the
module made and reads no more — and never in one it reads again, hands back, or got from the caller; the
runtime helpers (linrec.numpy.vjp.in_place, negated) give the operator's values in every case. Pure Python,
no kernel built. (The backward's values with the pass: tests/test_c_grad_chunkwise.py, tests/test_grad.py.)"""
import numpy as np
import pytest

import linrec
import test_c_grad
from linrec import verify_grad
from linrec.numpy.adjoint_derived import emit_decomposed_backward
from linrec.numpy.adjoint_in_place import in_place_products
from linrec.c import rows
from linrec.numpy.vjp import READ, in_place, negated, own_array, vjp_l2norm

OWNED = ("S_grads.",)


def test_a_made_array_at_its_last_read_is_changed_in_place():
    lines = ["kn = l2norm(k)", "qn = l2norm(q)  # qn = l2norm(q)", "w = per_token(beta * kn)",
             "S_q = [(per_token(s * qn), False)]", "r = scan(S_q, w)", "d = kn * 2", "# qn, in a comment"]
    got = in_place_products(lines)
    assert got[3] == "S_q = [(per_token(in_place(qn, '*', s)), False)]"  # (qn read no more: comments read nothing)
    assert got[2] == lines[2]  # (kn read on)
    assert got[5] == "d = in_place(kn, '*', 2)"
    assert got[1] == lines[1]  # (a line without a product, its comment kept)


def test_an_array_from_the_caller_or_an_if_branch_is_not_changed():
    lines = ["a = inputs['a']", "b = a * 2", "if f is None:", "    c = x * y", "else:", "    c = f[0]",
             "d = c * 3", "e = own_array(d_o, s, t, True)", "g = e * 4"]
    assert in_place_products(lines) == lines[:6] + ["d = c * 3"] + lines[7:]


def test_a_scans_gradient_is_changed_only_where_nothing_reads_it_again():
    lines = ["S_grads = scan()", "d_v = own_array(S_grads.writes[0][1], s, t, True)",
             "d_b = np.einsum('...i,...i->...', S_grads.writes[0][0], k)",
             "d_k = own_array(S_grads.writes[0][0] * beta[..., None], s, t, True)",
             "d_x = S_grads.writes[0][1] * 2",  # (d_v holds it, and is handed back below)
             "u = -S_grads.corrections[0][0]", "d_g = np.einsum('...i,...i->...', u, k)", "u1 = u * e",
             "d_k += u1 * beta[..., None]", "d_k += S_grads.corrections[0][1] * 2",
             "grads = {'v': d_v, 'k': d_k}"]
    got = in_place_products(lines, OWNED)
    assert got[3] == "d_k = own_array(in_place(S_grads.writes[0][0], '*', beta[..., None]), s, t, True)"
    assert got[4] == lines[4]
    assert got[5] == "u = negated(S_grads.corrections[0][0])"
    assert got[7] == "u1 = in_place(u, '*', e)"
    assert got[8] == "d_k += in_place(u1, '*', beta[..., None])"
    assert got[9] == "d_k += in_place(S_grads.corrections[0][1], '*', 2)"
    # `S_grads` itself (or its list of writes) read after it: none of its gradients changed before
    for whole in ("h = S_grads", "h = S_grads.writes"):
        held = in_place_products(lines[:4] + [whole], OWNED)
        assert held[3] == lines[3]
    # … or a name given `S_grads` before, and read after
    held = in_place_products(lines[:1] + ["h = S_grads"] + lines[1:4] + ["f(h.writes[0][0])"], OWNED)
    assert held[4] == lines[3]
    # without owned prefixes a scan's gradients may be anyone's arrays: none changed, the module's own still are
    assert in_place_products(lines, ()) == lines[:7] + ["u1 = in_place(u, '*', e)",
                                                        "d_k += in_place(u1, '*', beta[..., None])"] + lines[9:]


def test_an_added_to_target_or_a_second_read_in_the_line_keeps_the_array():
    lines = ["S_grads = scan()", "d = own_array(S_grads.queries[0], s, t, True)", "d += S_grads.queries[0] * 2",
             "a = x * y", "b = a * a", "c = x * y", "h = [c]", "z = c * 2", "f(h)"]
    got = in_place_products(lines, OWNED)
    assert got[2] == lines[2]  # (d is that array: doubling it first would give 4·q, not 3·q)
    assert got[4] == lines[4] and got[7] == lines[7]  # (read twice; held by h, read after)


def test_a_loop_leaves_the_lines_as_they_are():
    lines = ["a = x * y", "for i in range(3):", "    b = a * 2"]
    assert in_place_products(lines) == lines


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_helpers_give_the_operators_values(dtype):
    rng = np.random.default_rng(0)
    x, y, s = (rng.standard_normal((3, 4, 5)).astype(dtype) for _ in range(3))
    for op, f in (("+", np.add), ("-", np.subtract), ("*", np.multiply), ("/", np.true_divide)):
        a = x.copy()
        expected = f(a, y[..., :1])
        got = in_place(a, op, y[..., :1])
        assert got is a and np.array_equal(got, expected)  # (fits: written in a's memory)
    a = x.copy()
    assert np.array_equal(negated(a), -x) and np.array_equal(a, -x)
    view = x.copy()[..., :3]
    assert in_place(view, "*", 2.0).base is None and np.array_equal(view, x[..., :3])  # (a view: a new array)
    small = x[..., :1].copy()
    wide = in_place(small, "*", s)  # (the result outgrows it)
    assert wide.shape == s.shape and np.array_equal(small, x[..., :1]) and np.array_equal(wide, x[..., :1] * s)
    if dtype == np.float32:
        a = x.copy()
        other = y.astype(np.float64)
        got = in_place(a, "*", other)  # (another dtype: the operator's, unchanged a)
        assert got.dtype == np.float64 and np.array_equal(a, x) and np.array_equal(got, x * other)
    assert in_place(2.0, "*", x) is not x and np.array_equal(in_place(2.0, "*", x), 2.0 * x)
    assert negated(np.float32(3)) == -3
    given = x.copy()
    given.flags.writeable = False
    assert np.array_equal(negated(given), -x) and np.array_equal(given, x)


def test_the_numpy_chunkwise_backward_changes_no_scan_gradient_and_none_of_the_callers_arrays():
    rec = linrec.load("examples/gated_deltanet.lin")
    source = emit_decomposed_backward(rec.compiled, "chunkwise")
    assert "in_place(qn, '*', dk ** (-1.0 / 2.0))" in source  # (qn is read no more: the query scaled in it)
    # (NumPy's scans keep their gradients: no S_grads array is the one an in_place or negated writes into)
    assert "in_place(S_grads" not in source and "negated(S_grads" not in source
    x = rec.random_inputs(batch=1, tokens=9, heads=2, dims={"dk": 4, "dv": 3}, seed=1)
    before = {k: v.copy() for k, v in x.items()}
    up = {"o": np.random.default_rng(2).standard_normal((1, 9, 2, 3))}
    up_before = up["o"].copy()
    res = rec.vjp(x, up, form="chunkwise", dims={"dk": 4, "dv": 3}, chunk_size=4)
    ref = rec.vjp(x, up, form="recurrent", dims={"dk": 4, "dv": 3})
    assert all(np.array_equal(x[k], before[k]) for k in x) and np.array_equal(up["o"], up_before)
    assert all(np.abs(res.grads[k] - g).max() <= 1e-9 * max(np.abs(g).max(), 1) for k, g in ref.grads.items())


def test_a_gradient_read_no_more_takes_the_vector_jacobian_product_of_l2norm():
    """own_array of an array read no more (a scan's gradient, or a new array) is the name's own, `+=` keeps
    it so, and vjp_l2norm writes into it at its last read; where it is read on, a new array."""
    lines = ["S_grads = scan()", "d_qn = own_array(S_grads.queries[0], s, t, True)", "d_qn *= 0.5",
             "d_q = own_array(vjp_l2norm(q, d_qn, eps=1e-06), s, t, True)",
             "d_kn = own_array(S_grads.writes[0][0], s, t, True)", "d_v = S_grads.writes[0][0] + 1",
             "d_k = own_array(vjp_l2norm(k, d_kn, eps=1e-06), s, t, True)", "grads = {'q': d_q, 'k': d_k}"]
    got = in_place_products(lines, OWNED)
    assert got[3] == "d_q = own_array(vjp_l2norm(q, d_qn, eps=1e-06, out=d_qn), s, t, True)"
    assert got[6] == lines[6]  # (d_kn is S_grads.writes[0][0], which the line before read on)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vjp_l2norm_into_its_gradient_gives_the_same_values(dtype):
    rng = np.random.default_rng(1)
    x, g = (rng.standard_normal((2, 5, 3, 8)).astype(dtype) for _ in range(2))
    for f in (vjp_l2norm, rows.vjp_l2norm):  # (NumPy's and the C rows', each the same bits with out= or not)
        want = f(x, g.copy())
        into = g.copy()
        got = f(x, into, out=into)
        assert got is into and np.array_equal(got, want)
        other = np.zeros((2, 5, 3, 8), np.float16)  # (does not fit: a new array, `out` untouched)
        assert np.array_equal(f(x, g, out=other), want) and not other.any()


def _view(array: np.ndarray) -> np.ndarray:
    """array's values in a read-only view of a larger array (as linrec.torch hands over autograd's gradients:
    views of the tensors' memory; read-only here, so that a write into it raises)."""
    whole = np.empty((2,) + array.shape, array.dtype)
    whole[1] = array
    view = whole[1]
    view.flags.writeable = False
    return view


@pytest.mark.parametrize("name", test_c_grad.EXAMPLES)
def test_an_upstream_gradient_given_as_a_view_is_read_in_place_and_left_as_it_is(name):
    """The upstream gradients a backward only reads (own_array(…, READ)) are read where they lie, a view of the
    caller's memory too: every gradient form on both backends gives the same gradients, bit for bit, as from
    arrays of their own, changes none of the views, and hands back no gradient that shares their memory."""
    rec = linrec.load(f"examples/{name}.lin")
    x, up, states, final = test_c_grad._call(rec, 1, 19, 2, seed=3)
    for form, backend in verify_grad.gradient_forms(rec, ["numpy", "c"]):
        views = {k: _view(v) for k, v in up.items()}
        call = dict(form=form, backend=backend, initial_state=states, grad_final_state=final, dims=test_c_grad.DIMS)
        got = rec.vjp(x, views, **call)
        want = rec.vjp(x, {k: v.copy() for k, v in up.items()}, **call)
        assert all(np.array_equal(views[k], up[k]) for k in up), (form, backend)
        for k, g in want.grads.items():
            assert np.array_equal(got.grads[k], g), (form, backend, k)
            assert not any(np.shares_memory(got.grads[k], v) for v in views.values()), (form, backend, k)


def test_own_array_keeps_a_view_only_where_the_code_only_reads_it():
    whole = np.arange(24.0).reshape(2, 3, 4)
    view, strided = whole[1], whole[:, 1]
    assert own_array(view, (3, 4), np.float64, READ) is view  # (read where it lies: no copy)
    for keep in (True, False):  # (one the code may change or hand back: its own array)
        kept = own_array(view, (3, 4), np.float64, keep)
        assert kept is not view and not np.shares_memory(kept, whole) and np.array_equal(kept, view)
    copied = own_array(strided, (2, 4), np.float64, READ)  # (not C-contiguous, as the kernels read it: a copy)
    assert copied.flags.c_contiguous and np.array_equal(copied, strided)
    assert own_array(view, (3, 4), np.float32, READ).dtype == np.float32  # (another dtype: converted)
    emitted = linrec.load("examples/gla.lin").emit_gradient("recurrent", "c")
    assert "d_r0 = own_array(d_o, (batch, tokens, heads, dv), dtype, 'read')" in emitted
