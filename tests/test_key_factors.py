"""The key-side vectors of an update factored into per-token scalars times the vectors they share
(compiler.key_factors), as the C backward takes them (linrec.c.scaled_keys): the recurrent one
(templates/c_grad.c.j2: with corrections the written slots by the vectors they share, lr_put_keys; without, its
two passes, lr_fill_token and lr_factored_key_grads) and the chunkwise and parallel ones (c_grad_chunk.c.j2, the
same groups). What the factoring finds in the expressions, and the C backward in every form on programs
whose slots share vectors in every way the kernels distinguish — a scaled owner, an unscaled owner, a write's
key as the only slot of its vector, two corrections on two vectors, a constant scalar, a scalar of zero, a
scaled key without corrections, keys sharing a vector without corrections (under mild and strong decays) —
against the NumPy recurrent backward at 1e-9 in float64 and 5e-4 in float32
(sizes that are not whole registers), and the expansion the other kernels take (scaled_keys.expand, fold)
against the plain arrays."""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from linrec.c import grad_chunk_kernels, grad_kernels, grad_scans, scaled_keys, scan_kernels
from linrec.compiler.analysis import to_text
from linrec.compiler.key_factors import key_factors
from test_grad import worst_error

DIMS = {"dk": 19, "dv": 21}  # (dk not a whole register of either width: the padding of the copied vectors;
# dv more than a register and not a whole one: the recurrent kernel's groups of columns and the columns after)


def _slots(rec, state="S"):
    f = key_factors(rec.compiled.decomposition.transition(state))
    if f is None:
        return None
    def show(s):
        return (to_text(f.bases[s.base]), None if s.scale is None else to_text(s.scale), s.owner)
    return [show(s) for pair in f.corrections for s in pair] + [show(s) for s in f.writes]


def test_the_delta_rules_share_one_vector():
    gdn = linrec.load("examples/gated_deltanet.lin")
    assert _slots(gdn) == [("l2norm(k)", "−(exp(g)*beta)", True), ("l2norm(k)", None, False),
                           ("l2norm(k)", "beta", False)]
    comba = linrec.load("examples/comba.lin")
    assert [s[1] for s in _slots(comba)] == ["−beta", "sigmoid(d)", "beta"]


def test_nothing_to_factor():
    # (GLA's key has no scalar and no other slot; a matrix u or w beside an elementwise decay is not a vector)
    assert _slots(linrec.load("examples/gla.lin")) is None
    rec = linrec.compile("""recurrence plain(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a[dk]
state S[dk, dv]
S = (I − a⊗k)·S + q⊗v
output o = q·S
""", "plain.lin")
    assert _slots(rec) == [("a", "-1", True), ("k", None, True), ("q", None, True)]


PROGRAMS = {
    # two corrections on two vectors, the second one's w unscaled (an owner without a scalar) and a write on each
    # vector; a per-key decay between them (the first correction's u: a vector product, its own vector)
    "two vectors": """recurrence two(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a[dk], u[dv], beta in (0, 1), c in (0, 1)
input g[dk] <= 0
kn = l2norm(k)
an = l2norm(a)
state S[dk, dv]
S = (I − beta·kn⊗kn)·diag(exp(g))·(I − c·an⊗an)·S + (2*c)·an⊗u + beta·kn⊗v
output o = q·S
""",
    # u = e^g·k and w = −β·k on one vector, a write's key the only slot of its own; a scalar decay
    "scaled w": """recurrence scaled_w(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0
state S[dk, dv]
S = exp(g)·(I + k⊗(−beta·k))·S + sigmoid(q)⊗v
output o = q·S
""",
    # a constant scalar (−1) and a scalar that is zero at some tokens
    # a scaled key and no corrections (Mamba-2's dt·B): every kernel takes it factored (the recurrent one in its two
    # passes, and for pairs of strong decays in its states' way)
    "scaled key": """recurrence scaled_key(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], dt > 0
state S[dk, dv]
S = exp(−dt)·S + (dt·k)⊗v
output o = q·S
""",
    # writes whose keys share a vector, two scaled and one not, without corrections: the two passes, and with decays
    # strong enough (a mean log-decay below −1) the states' way
    "shared keys": """recurrence shared_keys(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], w[dv], a, b, g <= 0
state S[dk, dv]
S = exp(g)·S + (a·k)⊗v + (b·k)⊗w + k⊗v
output o = q·S
""",
    "shared keys, strong decay": """recurrence shared_strong(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], w[dv], a, b, g <= 0
state S[dk, dv]
S = exp(8·g − 2)·S + (a·k)⊗v + (b·k)⊗w + k⊗v
output o = q·S
""",
    "constant and zero": """recurrence constant(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], z >= 0
kn = l2norm(k)
state S[dk, dv]
S = (I − 0.5·kn⊗kn)·S + (z - 1)·kn⊗v
output o = 0.5·q·S
""",
}


def _call(rec, batch, tokens, heads, seed, dtype=np.float64):
    x = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=DIMS, seed=seed)
    if "z" in x:  # (z − 1 = 0 at every third token)
        x["z"][:, ::3] = 1.0
    rng = np.random.default_rng(seed + 100)
    up = {o.name: rng.standard_normal((batch, tokens, heads) + tuple(DIMS[d] for d in o.value.shape))
          for o in rec.program.outputs}
    shape = {s.name: (batch, heads) + tuple(DIMS[d] for d in s.shape) for s in rec.program.states}
    s0 = {k: rng.standard_normal(v) for k, v in shape.items()}
    gT = {k: rng.standard_normal(v) for k, v in shape.items()}
    cast = lambda d: {k: np.asarray(v, dtype) for k, v in d.items()}  # noqa: E731
    return cast(x), cast(up), cast(s0), cast(gT)


def _factored_kernels() -> list:
    return [s for s in scan_kernels._kernels if isinstance(s, grad_kernels.Structure) and s.sources]


@pytest.mark.parametrize("form", ["recurrent", "chunkwise", "parallel"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_c_backward_of_factored_slots(name, form):
    rec = linrec.compile(PROGRAMS[name], f"{name}.lin")
    assert _slots(rec) is not None
    for i, (batch, tokens, heads, chunk) in enumerate([(2, 13, 3, 4), (1, 9, 2, None), (1, 1, 1, None)]):
        chunk = None if form == "parallel" else chunk
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=i)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form=form,
                      chunk_size=chunk)
        assert worst_error(got.grads, want.grads) <= 1e-9, (name, i)
        assert worst_error(got.outputs, want.outputs) <= 1e-9
        x32, up32, s32, g32 = ({k: v.astype(np.float32) for k, v in d.items()} for d in (x, up, s0, gT))
        got32 = rec.vjp(x32, up32, initial_state=s32, grad_final_state=g32, dims=DIMS, backend="c", form=form,
                        chunk_size=chunk)
        assert all(g.dtype == np.float32 for g in got32.grads.values())
        assert worst_error(got32.grads, want.grads) <= 5e-4, (name, i)
    # (kernels that take the slots factored ran, in both precisions)
    chunk_kernel = form != "recurrent"
    assert {s.ctype for s in _factored_kernels() if s.dk == DIMS["dk"]
            and isinstance(s, grad_chunk_kernels.Structure) == chunk_kernel} == {"float", "double"}


def test_expanded_slots_give_the_same_gradients():
    """scaled_keys.expand and fold (the kernels that do not take factored slots) against the factored kernel,
    and the factored slots' gradients against those of the plain arrays they stand for."""
    rng = np.random.default_rng(3)
    batch, tokens, heads, dk, dv = 2, 10, 2, 7, 5
    arr = lambda *n: rng.standard_normal((batch, tokens, heads) + n)  # noqa: E731
    base, other = arr(dk), arr(dk)
    beta, c = arr(1), arr(1)
    corrections = [(scaled_keys.scaled(base, -beta), scaled_keys.scaled(base, None)),
                   (scaled_keys.scaled(other, c), arr(dk))]
    writes = [(scaled_keys.scaled(base, beta), arr(dv)), (scaled_keys.scaled(other, None), arr(dv))]
    log_decay = -np.abs(arr(1))
    queries = [(arr(dk), False)]
    s0 = rng.standard_normal((batch, heads, dk, dv))
    up = [arr(dv)]
    plain_c, plain_w = scaled_keys.expand(corrections, writes)
    _, _, ckpt = grad_scans.adjoint_checkpoints(s0, log_decay, plain_w, queries, 3, corrections=plain_c)
    factored = grad_scans.adjoint_recurrent(s0, log_decay, writes, queries, ckpt, 3, up, None,
                                            corrections=corrections)
    plain = grad_scans.adjoint_recurrent(s0, log_decay, plain_w, queries, ckpt, 3, up, None, corrections=plain_c)
    folded = scaled_keys.fold(plain, corrections, writes)
    d = {"u0": plain.corrections[0][0], "w0": plain.corrections[0][1], "u1": plain.corrections[1][0],
         "k0": plain.writes[0][0], "k1": plain.writes[1][0]}
    want_base = -beta * d["u0"] + d["w0"] + beta * d["k0"]
    want_other = c * d["u1"] + d["k1"]
    for g in (factored, folded):
        assert np.allclose(g.corrections[0][0].base, want_base, rtol=1e-12, atol=1e-12)
        assert g.corrections[0][1] == (None, None) and g.writes[0][0].base is None
        assert np.allclose(g.corrections[1][0].base, want_other, rtol=1e-12, atol=1e-12)
        assert g.writes[1][0] == (None, None)
        # (a slot not factored: the same up to rounding — the factored kernel sums a shared vector's terms once)
        assert np.allclose(g.corrections[1][1], plain.corrections[1][1], rtol=1e-12, atol=1e-12)
        assert np.allclose(g.corrections[0][0].scale[..., 0], np.sum(d["u0"] * base, -1), rtol=1e-12, atol=1e-12)
        assert np.allclose(g.writes[0][0].scale[..., 0], np.sum(d["k0"] * base, -1), rtol=1e-12, atol=1e-12)
        assert np.allclose(g.corrections[1][0].scale[..., 0], np.sum(d["u1"] * other, -1), rtol=1e-12,
                           atol=1e-12)
        assert np.allclose(g.initial_state, plain.initial_state, rtol=1e-12, atol=1e-12)
        assert np.allclose(g.log_decay, plain.log_decay, rtol=1e-12, atol=1e-12)
