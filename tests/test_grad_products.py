"""The chain rule through a product of scalars and one array, ±s_1·…·s_m·v (a delta rule's correction
−e^g·β·kn, a gated key −a·b·σ(c)·k): each scalar's gradient is one contraction Σ g⊙v shared by all of them,
times the other scalars, and v's gradient is g times their product (compiler.adjoint._Sweep.scaled_array) —
where the binary rule multiplied g by a scalar and contracted it with v again at each level of the product's
tree, a pass over a [B, T, H, d] array each. Checked: the rule's gradients against central differences of the
float64 forward, every gradient form on both backends against NumPy's recurrent one, and the generated
backward's passes."""
import pytest

import linrec
from linrec import verify_grad
from linrec.numpy.adjoint_derived import emit_decomposed_backward
from compare import worst_gradient_error

PROGRAMS = {
    # a scalar that appears twice (its gradient: both occurrences), a negation, a constant and a builtin
    "key": "input q[dk], k[dk], v[dv], a, b in (0, 1), c, g <= 0\nstate S[dk, dv]\n"
           "S = exp(g)·S + (−0.5*a*a*b*sigmoid(c)*k)⊗v\noutput o = q·S\n",
    # the delta rule's correction with a second decay: −e^g·e^gh·β·kn
    "correction": "input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0, gh <= 0\nkn = l2norm(k)\nqn = l2norm(q)\n"
                  "state S[dk, dv]\nS = exp(g)·exp(gh)·(I − beta·kn⊗kn)·S + beta·kn⊗v\noutput o = dk^(−1/2)·qn·S\n",
    # a scalar factor that reads the array it scales, (k·k)·a·k, and a product in the readout's query
    "reads_itself": "input q[dk], k[dk], v[dv], a, g <= 0\nstate S[dk, dv]\n"
                    "S = exp(g)·S + ((k·k)*a*k)⊗v\noutput o = (−a*g*q)·S\n",
}


def _compile(name: str):
    return linrec.compile("recurrence p(dk = 5, dv = 3)\n" + PROGRAMS[name], f"{name}.lin")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_gradient_form_against_finite_differences_and_the_recurrent_one(name):
    rec = _compile(name)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    rows = verify_grad.run(rec, backends=("numpy", "c"), dtypes=("float64",), quick=True)
    assert {(r.form, r.backend) for r in rows} == {(f, b) for f in rec.forms for b in ("numpy", "c")}
    bad = [r for r in rows if not r.passed]
    assert not bad, bad
    assert max(r.max_rel for r in rows if r.note.startswith("finite")) <= 1e-6


def test_the_correction_contracts_once():
    """−e^g·e^gh·β·kn: one contraction for its three scalars (two binary-rule levels more would be two more), and
    one product g·(−e^g·e^h·β) for kn's gradient."""
    rec = _compile("correction")
    source = emit_decomposed_backward(rec.compiled, "chunkwise")
    section = source.split("# adjoint of S.correction0_u")[1].split("# adjoint of")[0]
    assert section.count("einsum(") == 1, section
    assert section.count("S_grads.corrections[0][0]") == 2, section  # (the contraction, and kn's gradient)


def test_a_negated_product_negates_its_scalar():
    """−(e^g·β·kn), the correction's per-token array, printed as (−e^g)·β·kn (backends/numpy/printer.py): the
    negation on the [B, T, H] scalar, not a pass over the [B, T, H, dk] product; the chunkwise form as the
    recurrent one."""
    import numpy as np
    rec = linrec.load("examples/gated_deltanet.lin")
    source = emit_decomposed_backward(rec.compiled, "chunkwise")
    line = next(x for x in source.splitlines() if x.strip().startswith("S_corrections ="))
    assert "(-exp_g)[..., None]" in line and "negated(" not in line, line  # (exp_g: np.exp(g), computed once)
    assert "    exp_g = np.exp(g)  # (read more than once below: computed once)" in source.splitlines()
    x = rec.random_inputs(1, 33, 2, dims={"dk": 8, "dv": 8}, seed=5)
    want = rec.run(x, dims={"dk": 8, "dv": 8})
    got = rec.run(x, form="chunkwise", dims={"dk": 8, "dv": 8}, chunk_size=8)
    assert float(np.max(np.abs(got.outputs["o"] - want.outputs["o"]))) <= 1e-12


def test_the_sum_of_a_negated_array_is_the_negated_sum():
    """−Σ g rather than Σ −g (compiler.adjoint._fit): Performer's −|x|²/2 gave its gradient's sum over the m
    features as np.einsum('...i->...', -g), a negated copy of a [B, T, H, m] array made to be summed; now the
    [B, T, H] sum is negated (its C vjp 0.95× at d = 64, T = 4096), the same values bit for bit — negation is
    exact and the order of the sum the same."""
    import numpy as np
    from linrec.compiler import ir
    from linrec.compiler.adjoint import _fit
    g = ir.InputRef(("dk",), "g")
    fitted = _fit(ir.Neg(("dk",), g), ())
    assert isinstance(fitted, ir.Neg) and fitted.shape == () and fitted.operand.args == (g,)
    rec = linrec.load("examples/performer.lin")
    for form in ("recurrent", "chunkwise"):
        source = rec.emit_gradient(form, "c")
        assert "np.einsum('...i->...', -" not in source and "negated(np.einsum('...i->...', " in source, form
    dims = {"dk": 4, "dv": 3, "m": 8}
    x = rec.random_inputs(batch=2, tokens=15, heads=2, dims=dims, seed=10)
    up = {"o": np.random.default_rng(11).standard_normal(x["v"].shape)}
    assert worst_gradient_error(rec, x, up, ("recurrent", "chunkwise"), ("c",), dims) <= 1e-9
