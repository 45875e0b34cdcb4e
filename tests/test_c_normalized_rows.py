"""Rows the C recurrent backward with corrections normalizes itself (c.normalized_rows): a factored key-side
vector or a query that is l2norm(x) goes to the kernel as x, `normalized(x, eps)` in the generated module, and
its gradient comes back as x's. Here: what the module makes of it (no array of l2norm(x), no vector–Jacobian
product after the kernel, the value still computed where something else reads it), the C backward against the
NumPy recurrent one — float64 at 1e-10, float32 at the forms' 5e-4 — over programs that take the path in
different ways, and the kernels' own paths called directly: the forward and the backward of arrays normalized
slot by slot (no factoring), and the kernels that do not normalize (their arrays made and their gradients folded
by c.grad_scans)."""
import numpy as np
import pytest

import linrec
from linrec.c import grad, grad_calls, grad_kernels, grad_scans, rows
from linrec.c.normalized_rows import Normalized, l2norm_argument
from linrec.c.scaled_keys import Scaled
from linrec.compiler import ir
from linrec.numpy.vjp import vjp_l2norm
from test_grad import worst_error

HEAD = "input q[dk], k[dk], v[dv]\ninput beta in (0, 1)\n"
PROGRAMS = {
    # gated DeltaNet's shape: the key factored (u, w, κ one vector), the query normalized, a scalar decay
    "gated": "recurrence gated(dk = 16, dv = 16)\n" + HEAD + "input g <= 0\nkn = l2norm(k)\nstate S[dk, dv]\n"
             "S = exp(g)·(I − beta·kn⊗kn)·S + beta·kn⊗v\noutput o = dk^(−1/2)·l2norm(q)·S\n",
    # a readout before the update, a decay per row (before the correction: w = kn*exp(g), u and κ kn's), an eps of
    # its own
    "before": "recurrence before(dk = 16, dv = 16)\n" + HEAD + "input g[dk] <= 0\nkn = l2norm(k, eps=0.25)\n"
              "state S[dk, dv]\noutput early = l2norm(q)·S\n"
              "S = (I − beta·kn⊗kn)·diag(exp(g))·S + beta·kn⊗v\noutput o = l2norm(q)·S\n",
    # the normalized key read elsewhere too (its value kept, its other adjoint carried through vjp_l2norm), and the
    # query not normalized
    "shared": "recurrence shared(dk = 16, dv = 16)\n" + HEAD + "kn = l2norm(k)\nstate S[dk, dv]\n"
              "S = (I − beta·kn⊗kn)·S + beta·kn⊗v\noutput o = q·S\noutput r = sum(kn*q)\n",
    # no corrections: the kernel without them normalizes nothing, the module keeps l2norm
    "plain": "recurrence plain(dk = 16, dv = 16)\n" + HEAD + "input g[dk] <= 0\nstate S[dk, dv]\n"
             "S = diag(exp(g))·S + l2norm(k)⊗v\noutput o = l2norm(q)·S\n",
}


def _module(name: str) -> str:
    return grad.emit(linrec.compile(PROGRAMS[name]).compiled)


def test_l2norm_argument():
    k = ir.InputRef(("dk",), "k")
    assert l2norm_argument(ir.Apply(("dk",), "l2norm", (k,), (("eps", 0.5),))) == (k, 0.5)
    assert l2norm_argument(ir.Apply(("dk",), "rmsnorm", (k,), (("eps", 0.5),))) is None
    assert l2norm_argument(k) is None


@pytest.mark.parametrize("name, wrapped, kept", [
    ("gated", [("k", 1e-06), ("q", 1e-06)], set()),
    # (each readout's query its own; w = kn*exp(g) is a vector of its own, so kn is still made for it)
    ("before", [("k", 0.25), ("q", 1e-06), ("q", 1e-06)], {"kn = l2norm(k, eps=0.25)", "vjp_l2norm(k, d_kn"}),
    ("shared", [("k", 1e-06)], {"kn"}),
    ("plain", [], {"l2norm(k", "l2norm(q"}),
])
def test_the_module_gives_the_kernel_x(name, wrapped, kept):
    """Each normalized array goes as normalized(x, eps); a value still read elsewhere is still computed (and its
    adjoint carried), and without corrections nothing is wrapped."""
    code = _module(name)
    for x, eps in set(wrapped):
        assert code.count(f"normalized(per_token({x}, (batch, tokens, heads, dk), dtype, scalar=False), "
                          f"eps={eps!r})") == wrapped.count((x, eps))
    assert code.count("normalized(") == len(wrapped)
    if name == "gated":  # (no l2norm(x) made, no vjp_l2norm after the kernel; comments aside)
        statements = [line.split("#")[0] for line in code.split("def backward")[1].splitlines()]
        assert not any("l2norm" in line for line in statements)
    for text in kept:
        assert text in code


@pytest.mark.parametrize("name", ["gated", "before", "shared", "plain"])
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-10), (np.float32, 5e-4)])
def test_c_backward_matches_numpy(name, dtype, tolerance):
    """Odd sizes (a row that is not whole registers), random initial states, two batch rows and three heads."""
    rec = linrec.compile(PROGRAMS[name])
    dims = {"dk": 13, "dv": 7}
    x = rec.random_inputs(batch=2, tokens=37, heads=3, dims=dims, seed=5, dtype=dtype)
    x["k"][0, 3, 1] = 0  # (a zero row: l2norm(0) = 0, its gradient 1/√eps times the upstream's)
    rng = np.random.default_rng(6)
    s0 = {"S": rng.standard_normal((2, 3, 13, 7)).astype(dtype)}
    out = rec.run(x, backend="numpy", dims=dims, initial_state=s0).outputs
    up = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in out.items()}
    want = rec.vjp(x, up, form="recurrent", backend="numpy", dims=dims, initial_state=s0, chunk_size=5)
    got = rec.vjp(x, up, form="recurrent", backend="c", dims=dims, initial_state=s0, chunk_size=5)
    assert worst_error({k: np.asarray(v, np.float64) for k, v in got.grads.items()},
                       {k: np.asarray(v, np.float64) for k, v in want.grads.items()}) < tolerance


def _arrays(dtype, dk=11, dv=6, lead=(2, 23, 3)):
    rng = np.random.default_rng(7)
    a = lambda n: rng.standard_normal(lead + (n,)).astype(dtype)  # noqa: E731
    return dict(s0=rng.standard_normal((lead[0], lead[2], dk, dv)).astype(dtype),
                l=-rng.random(lead + (1,)).astype(dtype),
                u=a(dk), w=a(dk), k=a(dk), v=a(dv), q=a(dk), dy=a(dv)), dk


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_kernels_normalize_slot_by_slot(dtype, tolerance):
    """Unfactored slots, each its own Normalized (eps 1e-6, 0.5, 2): the kernel's own forward (which normalizes
    through its Rows) and its backward, against the same kernels on l2norm's arrays with vjp_l2norm after."""
    a, dk = _arrays(dtype)
    nu, nw = Normalized(a["u"], 1e-6), Normalized(a["w"], 0.5)
    nk, nq = Normalized(a["k"], 2.0), Normalized(a["q"], 1e-6)
    normal = lambda n: rows.l2norm(n.array, n.eps)  # noqa: E731
    plain = dict(corrections=[(normal(nu), normal(nw))], writes=[(normal(nk), a["v"])], queries=[(normal(nq), False)])
    c = grad_kernels._prepare(a["s0"], a["l"], [(nu, nw)], [(nk, a["v"])], [(nq, False)])
    assert c.structure.normalized == (-1, 0, 1, 2, -1, 3) and c.structure.norm_eps == (1e-6, 0.5, 2.0, 1e-6)
    [y], final, ckpt = grad_calls.forward(c, grad_kernels.kernel(c.structure), "lr_grad_forward", [6], 4, None)
    [y0], final0, ckpt0 = grad_kernels.adjoint_checkpoints(a["s0"], a["l"], plain["writes"], plain["queries"], 4,
                                                           corrections=plain["corrections"])
    assert worst_error({"y": y, "S": final, "c": ckpt}, {"y": y0, "S": final0, "c": ckpt0}) < tolerance
    got = grad_kernels.adjoint_recurrent(a["s0"], a["l"], [(nk, a["v"])], [(nq, False)], ckpt0, 4, [a["dy"]], None,
                                         corrections=[(nu, nw)])
    ref = grad_kernels.adjoint_recurrent(a["s0"], a["l"], plain["writes"], plain["queries"], ckpt0, 4, [a["dy"]], None,
                                         corrections=plain["corrections"])
    back = lambda n, g: vjp_l2norm(n.array, g, n.eps)  # noqa: E731
    want = {"u": back(nu, ref.corrections[0][0]), "w": back(nw, ref.corrections[0][1]), "k": back(nk, ref.writes[0][0]),
            "q": back(nq, ref.queries[0]), "v": ref.writes[0][1], "l": ref.log_decay, "s0": ref.initial_state}
    have = {"u": got.corrections[0][0], "w": got.corrections[0][1], "k": got.writes[0][0], "q": got.queries[0],
            "v": got.writes[0][1], "l": got.log_decay, "s0": got.initial_state}
    assert worst_error(have, want) < tolerance


@pytest.mark.parametrize("corrections", [False, True])
def test_scans_fold_what_the_kernel_does_not_normalize(corrections):
    """c.grad_scans: without corrections (the kernel that normalizes nothing), or with decays taken as values, the
    Normalized arrays are made l2norm's arrays and their gradients folded back — against the arrays given plain."""
    a, dk = _arrays(np.float64)
    base = Normalized(a["k"], 1e-6)
    query = Normalized(a["q"], 0.5)
    made = rows.l2norm(a["k"], 1e-6)
    beta = np.abs(a["l"])
    fix = dict(writes=[(Scaled(base, beta), a["v"])], queries=[(query, False, 0.5)],
               corrections=[(Scaled(base, -beta), Scaled(base, None))] if corrections else [])
    plain = dict(writes=[(Scaled(made, beta), a["v"])], queries=[(rows.l2norm(a["q"], 0.5), False, 0.5)],
                 corrections=[(Scaled(made, -beta), Scaled(made, None))] if corrections else [])
    decay = -np.abs(a["l"])  # (taken as the log of values: c.small_decays' path, which normalizes nothing)
    _, _, ckpt = grad_scans.adjoint_checkpoints(a["s0"], decay, fix["writes"], fix["queries"], 4,
                                                corrections=fix["corrections"])
    got = grad_scans.adjoint_recurrent(a["s0"], decay, fix["writes"], fix["queries"], ckpt, 4, [a["dy"]], None,
                                       corrections=fix["corrections"], decays_as_values=corrections)
    ref = grad_scans.adjoint_recurrent(a["s0"], decay, plain["writes"], plain["queries"], ckpt, 4, [a["dy"]], None,
                                       corrections=plain["corrections"], decays_as_values=corrections)
    owner = (ref.corrections[0][0] if corrections else ref.writes[0][0]).base
    got_owner = (got.corrections[0][0] if corrections else got.writes[0][0]).base
    assert worst_error({"k": got_owner, "q": got.queries[0], "v": got.writes[0][1], "s0": got.initial_state},
                       {"k": vjp_l2norm(a["k"], owner, 1e-6), "q": vjp_l2norm(a["q"], ref.queries[0], 0.5),
                        "v": ref.writes[0][1], "s0": ref.initial_state}) < 1e-12
