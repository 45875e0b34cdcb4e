"""A vector state written with a scalar, the same value added to every element (`z = exp(g)*z + beta`, `+ 1`,
`+ 1/dk`, a per-head param, `sigmoid(w)`): the decomposition's write key is that scalar, broadcast over the
state's rows. Found by a probe: the C fused kernel had no C for it (an internal error from `run`, `prefill` and
`step` on C, and `--standalone`; c.state_terms now makes it the coefficient of a vector of ones), and every
gradient form but NumPy's recurrent one took the key's gradient at one row instead of summing it over the rows
(70 % off, silently; numpy.adjoint_derived's seeds now sum a broadcast scalar's gradient). Here: every form on
both backends against the NumPy recurrent form at 1e-9, prefill and steps on C, every gradient form against
the NumPy recurrent backward at 1e-9 and that one against central differences.

The same for a scalar read of the state added to each of its elements, `z − beta*(kn·z)/dk`: the rank-one
correction (−beta/dk)⊗kn whose u is that scalar at every row (compiler.transitions; it was refused every form
but the recurrent one as "a dense matrix", found by a probe) — also written `sum(kn*z)` or `mean(z)`, a
contraction with the vector of ones (compiler.linearity; such a program was refused outright as "not linear")."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.numpy.runtime import l2norm
from test_grad import worst_error

BODIES = {
    "input": "input q[dk], beta, g <= 0\nstate z[dk]\nz = exp(g)*z + beta\noutput o = q·z\n",
    "constant": "input q[dk], g <= 0\nstate z[dk]\nz = exp(g)*z + 0.5\noutput o = q·z\n",
    "size": "input q[dk]\nstate z[dk]\nz = z + 1/dk\noutput o = q·z\n",
    "param": "input q[dk], g[dk] <= 0\nparam c per head = 0.3\nstate z[dk]\nz = diag(exp(g))·z + c\noutput o = z\n",
    "builtin": "input q[dk], w, g <= 0\nstate z[dk]\nz = exp(g)*z + sigmoid(w)\noutput o = q·z\noutput p = z\n",
    "noncausal": "input q[dk], beta, g <= 0\nstate z[dk]\nz = exp(g)*z + beta\noutput o = q·z\n",
    # a scalar read of the state added to each of its elements: the rank-one correction (beta/dk·1)⊗kn
    "state_read": "input q[dk], k[dk], beta in (0, 1), g <= 0\nkn = l2norm(k)\nstate z[dk]\n"
                  "z = exp(g)*z − beta*(kn·z)/dk + k\noutput o = q·z\n",
    "state_read_steps": "input q[dk], k[dk], beta in (0, 1), g <= 0\nkn = l2norm(k)\nstate z[dk]\n"
                        "z = z − beta*(kn·z)\nz = exp(g)*z + k\noutput o = q·z\n",
    # the same read written with sum and mean: linear (a contraction with ones), not "a function of the state"
    "sum_read": "input q[dk], k[dk], beta in (0, 1), g <= 0\nkn = l2norm(k)\nstate z[dk]\n"
                "z = exp(g)*z − beta*sum(kn*z)/dk + k\noutput o = q·z\n",
    "mean_read": "input q[dk], k[dk], beta in (0, 1), g <= 0\nstate z[dk]\nz = exp(g)*z − beta*mean(z) + k\n"
                 "output o = q·z\n",
}


def _program(name: str):
    header = "recurrence t(dk = 5, dv = 3)" + (" noncausal" if name == "noncausal" else "") + "\n"
    return linrec.compile(header + BODIES[name], f"{name}.lin")


@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_form_on_both_backends(name):
    rec = _program(name)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, 37, 3, seed=1)
    s0 = {s.name: np.random.default_rng(2).standard_normal((2, 3, 5)) for s in rec.program.states}
    want = rec.run(x, form="recurrent", initial_state=s0)
    for form in rec.forms:
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend, initial_state=s0, chunk_size=8)
            assert worst_error(got.outputs, want.outputs) <= 1e-9, (form, backend)
            assert worst_error(got.final_state, want.final_state) <= 1e-9, (form, backend)
    if rec.program.causal:  # (the decode step and the prefill kernel: the fused kernel's)
        assert worst_error(rec.prefill(x, backend="c", initial_state=s0).final_state, want.final_state) <= 1e-9
        state = s0
        for t in range(37):
            _, state = rec.step({k: v[:, t] for k, v in x.items()}, state, backend="c")
        assert worst_error(state, want.final_state) <= 1e-9


@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_gradient_form_sums_the_scalar_over_the_rows(name):
    rec = _program(name)
    x = rec.random_inputs(2, 23, 2, seed=3)
    rng = np.random.default_rng(4)
    ref = rec.run(x)
    up = {k: rng.standard_normal(v.shape) for k, v in ref.outputs.items()}
    s0 = {k: rng.standard_normal(v.shape) for k, v in ref.final_state.items()}
    want = rec.vjp(x, up, initial_state=s0)  # (NumPy's recurrent backward: the statements as written)

    def loss(arrays):
        out = rec.run(arrays, initial_state=s0).outputs
        return sum(float(np.sum(up[k] * out[k])) for k in out)
    for name_ in x:  # (central differences along a random direction: the reference is right)
        d = rng.standard_normal(x[name_].shape) * (0.01 if name_ in ("g",) else 1.0)
        eps = 1e-6
        fd = (loss(dict(x, **{name_: x[name_] + eps * d})) - loss(dict(x, **{name_: x[name_] - eps * d}))) / (2 * eps)
        assert abs(fd - float(np.sum(want.grads[name_] * d))) <= 1e-6 * max(abs(fd), 1.0), name_
    for form in rec.forms:
        for backend in ("numpy", "c"):
            if gradients.gradient_refusal(rec, form, backend):
                continue
            got = rec.vjp(x, up, initial_state=s0, form=form, backend=backend, chunk_size=8)
            assert worst_error(got.grads, want.grads) <= 1e-9, (form, backend)


@pytest.mark.parametrize("update", ["z = z + s\nz = z − beta*(kn·z)*kn\n", "z = (I − beta·kn⊗kn)·(z + s)\n",
                                    "z = (I − beta·kn⊗kn)·(z + 0.5)\n", "z = z + s\nz = diag(exp(−beta*k*k))·z\n"])
def test_a_scalar_added_before_a_later_step_maps_the_state(update):
    """Composed, the scalar meets the later step's map inside a contraction, `kn·(z + s)`, which the terms of a
    decomposition would take as kn scaled by s (the derived forms raised NumPy errors, and every backward but
    NumPy's recurrent one an internal error; a probe found it). Such an update is a general linear map: the
    recurrent form runs the steps as written on both backends, the gradient on NumPy, and the rest is refused
    with the reason."""
    rec = linrec.compile("recurrence p(dk = 3, dv = 3)\ninput q[dk], k[dk], s, beta in (0, 1)\nkn = l2norm(k)\n"
                         "state z[dk]\n" + update + "output o = q·z\n", "p.lin")
    assert rec.forms == ("recurrent",)
    assert "a scalar is added to 'z'" in rec.decomposition.why_not("chunkwise")
    x = rec.random_inputs(1, 6, 2, seed=0)
    s0 = {"z": np.random.default_rng(1).standard_normal((1, 2, 3))}
    z, outputs = s0["z"][0], []  # (the steps by hand)
    for t in range(6):
        kk, ss, bb = x["k"][0, t], x["s"][0, t], x["beta"][0, t]
        kn = l2norm(kk, eps=1e-6)
        z = z + (0.5 if "0.5" in update else ss[:, None])
        z = z - bb[:, None] * np.sum(kn * z, -1, keepdims=True) * kn if "kn" in update else \
            np.exp(-bb[:, None] * kk * kk) * z
        outputs.append(np.sum(x["q"][0, t] * z, -1))
    for backend in ("numpy", "c"):
        got = rec.run(x, backend=backend, initial_state=s0).outputs["o"][0]
        assert np.abs(got - np.array(outputs)).max() <= 1e-12, backend
    up = {"o": np.ones((1, 6, 2))}
    assert np.all(np.isfinite(rec.vjp(x, up, initial_state=s0).grads["s"]))
    with pytest.raises(linrec.LinrecError, match="a scalar is added to 'z'"):
        rec.vjp(x, up, backend="c")
