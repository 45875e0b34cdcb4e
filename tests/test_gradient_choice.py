"""form="auto"'s backward (backends/gradient_choice.py): on C from CALIBRATION_TOKENS tokens on, the recurrent
and the chunkwise vjp measured against each other once per process and the faster one run; else the first of
gradients.AUTO_ORDER the backend builds. Recurrence.vjp(form="auto") runs that form: its results are that
form's, bit for bit. (linrec.torch's plan: tests/test_torch_grad.py.)"""
import numpy as np
import pytest

import linrec
from linrec import gradient_choice, gradients

DIMS = {"dk": 4, "dv": 4}


@pytest.fixture(scope="module")
def gla():
    return linrec.load("examples/gla.lin")


def fixed_costs(monkeypatch, costs: dict) -> list:
    """gradient_choice.backward_costs fixed to `costs` (ms per form); a list that gets the heads of each call
    (tests/test_torch_grad.py uses it too)."""
    asked = []
    monkeypatch.setattr(gradient_choice, "backward_costs",
                        lambda rec, backend, heads, batch, dims, dtype: asked.append(heads) or costs)
    return asked


def _same(a, b) -> bool:
    return all(np.array_equal(a.grads[k], b.grads[k]) for k in b.grads) and set(a.grads) == set(b.grads) and \
        all(np.array_equal(a.outputs[k], b.outputs[k]) for k in b.outputs)


def test_the_backward_measurement_times_both_forms_once_per_shape(monkeypatch, gla):
    """backward_costs, for real on small sizes (the calibration's tokens lowered): both forms' vjp timed, the
    measurement kept for the process (a second ask runs nothing), and the faster one chosen; a program with a
    param without a default is not measured (the calibration has no values for it)."""
    monkeypatch.setattr(gradient_choice, "CALIBRATION_TOKENS", 64)
    monkeypatch.setattr(gradient_choice, "_costs", {})
    forms = []
    vjp = gla.vjp
    monkeypatch.setattr(gla, "vjp", lambda *args, **kw: forms.append(kw["form"]) or vjp(*args, **kw))
    costs = gradient_choice.backward_costs(gla, "c", 2, 1, DIMS, np.float64)
    assert sorted(costs) == ["chunkwise", "recurrent"] and all(ms > 0 for ms in costs.values())
    assert forms == ["recurrent", "chunkwise"] * 4  # (a call each that builds the kernels, three timed in turn)
    assert gradient_choice.measured_form(gla, "c", DIMS, 64, 2, 1, np.float64) == min(costs, key=costs.get)
    assert gradient_choice.backward_costs(gla, "c", 2, 1, DIMS, np.float64) is costs and len(forms) == 8
    needs = linrec.compile("recurrence p(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nparam w[dk]\n"
                           "state S[dk, dv]\nS = S + (w*k)⊗v\noutput o = q·S\n", "p.lin")
    assert gradient_choice.backward_costs(needs, "c", 2, 1, DIMS, np.float64) is None
    assert gradient_choice.auto_gradient_form(needs, "c", DIMS, 64, 2, 1, np.float64) == "recurrent"


def test_vjp_auto_runs_the_chosen_form(monkeypatch, gla):
    """Recurrence.vjp(form="auto"): on NumPy, and on C below the calibration's tokens, the recurrent backward
    (no measurement); on C from there on, the measured faster one — the chunkwise backward where it is
    measured faster, the recurrent one where that is — by the longest of packed sequences (cu_seqlens), not
    by the packed row's length; the results are that form's, bit for bit."""
    x = gla.random_inputs(2, 24, 2, dims=DIMS, seed=4)
    up = {"o": np.random.default_rng(5).standard_normal((2, 24, 2, 4))}
    asked = fixed_costs(monkeypatch, {"recurrent": 2.0, "chunkwise": 1.0})
    for backend in ("numpy", "c"):
        assert _same(gla.vjp(x, up, form="auto", backend=backend),
                     gla.vjp(x, up, form="recurrent", backend=backend)), backend
    assert asked == []
    monkeypatch.setattr(gradient_choice, "CALIBRATION_TOKENS", 16)
    assert _same(gla.vjp(x, up, form="auto", backend="c"), gla.vjp(x, up, form="chunkwise", backend="c"))
    assert asked == [2]
    packed = {k: v[:1] for k, v in x.items()}
    for offsets, form in (([0, 8, 16, 24], "recurrent"), ([0, 4, 24], "chunkwise")):
        got = gla.vjp(packed, {"o": up["o"][:1]}, form="auto", backend="c", cu_seqlens=offsets)
        want = gla.vjp(packed, {"o": up["o"][:1]}, form=form, backend="c", cu_seqlens=offsets)
        assert _same(got, want), offsets
    fixed_costs(monkeypatch, {"recurrent": 1.0, "chunkwise": 2.0})
    assert _same(gla.vjp(x, up, form="auto", backend="c"), gla.vjp(x, up, form="recurrent", backend="c"))


def test_vjp_auto_without_a_recurrent_backward_and_without_any():
    """A program without a recurrent form (Reformer): form="auto" runs its chunkwise backward. One without a
    derived backward (a param whose default mixes a random draw with another param) is an error that gives
    each form's reason, not an unknown form."""
    reformer = linrec.load("examples/reformer.lin")
    x = reformer.random_inputs(1, 16, 1, seed=3)
    up = {o.name: np.ones_like(v) for o, v in zip(reformer.program.outputs, reformer.run(x).outputs.values())}
    assert _same(reformer.vjp(x, up, form="auto"), reformer.vjp(x, up, form="chunkwise"))
    noisy = linrec.compile("recurrence noisy(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nparam s per head = 1\n"
                           "param w per head = s + randn(seed=0)\nstate S[dk, dv]\nS = S + w*k⊗v\noutput o = q·S\n",
                           "noisy.lin")
    nx = noisy.random_inputs(1, 8, 1)
    with pytest.raises(linrec.LinrecError, match="'noisy' has no backward for form='auto': the numpy backend builds "
                                                 "no backward form=\"auto\" runs: recurrent, chunkwise, parallel: "
                                                 "the default of param 'w'"):
        noisy.vjp(nx, {"o": np.ones((1, 8, 1, 4))}, form="auto")
    assert gradients.AUTO_ORDER == ("recurrent", "chunkwise", "parallel")
