"""The NumPy printer leaves out the chain rule's multiplications by 1 (backends/numpy/printer.py): x·1, which
compiler.adjoint._product writes to give a product its shape, and x·(1/c), the derivative of x/c for a constant
c, which printed as `x * 1.0 / c` — a pass over x each for nothing (Performer's features' gradient, [B, T, H, m],
made two). What is printed instead gives the same values bit for bit (x·1 = x exactly, and Python read
`x * 1.0 / c` as (x·1)/c), and the same shape."""
import numpy as np

import linrec
from linrec.compiler import ir
from linrec.numpy.printer import NumpyPrinter
from compare import worst_gradient_error

X = ir.InputRef(("dk",), "x")  # a vector per token
C = ir.Apply((), "sqrt", (ir.DimSize((), "m"),))  # a constant scalar
S = ir.InputRef((), "s")  # a scalar per token
ONE = ir.Const((), 1.0)


def _printed(e: ir.Expr) -> str:
    return NumpyPrinter(lambda leaf: leaf.name if hasattr(leaf, "name") else f"{leaf.dim}_")(e)


def test_a_product_with_one_prints_as_its_other_factor_or_a_quotient():
    assert _printed(ir.Arith(("dk",), "mul", X, ONE)) == "x"
    assert _printed(ir.Arith(("dk",), "mul", ONE, X)) == "x"
    quotient = _printed(ir.Arith(("dk",), "mul", X, ir.Arith((), "div", ONE, C)))
    assert quotient == _printed(ir.Arith(("dk",), "div", X, C)) and "1.0" not in quotient, quotient


def test_a_product_with_one_that_gives_a_scalar_its_vector_shape_keeps_the_axis():
    """s·1 of shape [dk] for s a scalar per token: NumPy's s[..., None], which the product with 1 printed; the
    factor alone would have lost the axis."""
    printed = _printed(ir.Arith(("dk",), "mul", S, ONE))
    assert "[..., None]" in printed, printed
    s = np.arange(3.0)
    assert eval(printed, {"s": s}).shape == (3, 1)


def test_performers_backward_has_no_multiplication_by_one_and_the_statements_gradients():
    rec = linrec.load("examples/performer.lin")
    for form in rec.forms:
        for backend in ("numpy", "c"):
            source = rec.emit_gradient(form, backend)
            assert "* 1.0" not in source and "'*', 1.0)" not in source, (form, backend)
    dims = {"dk": 4, "dv": 3, "m": 8}
    x = rec.random_inputs(batch=2, tokens=17, heads=2, dims=dims, seed=8)
    up = {"o": np.random.default_rng(9).standard_normal(x["v"].shape)}
    assert worst_gradient_error(rec, x, up, ("parallel", "chunkwise"), ("c",), dims) <= 1e-9


def test_a_factor_left_of_one_stays_a_factor_where_code_pastes_it_beside_a_product():
    """A fuzz finding (seed 50): the key (1 − sigmoid(c))·φ(k) of a stabilized state, c a constant, whose factor
    the chain of products held as (1 − sigmoid(c))·1; printed without the ·1 as a bare sum, derived.write_key
    pasted it before `* np.exp(α − M)` — 1 − sigmoid(c)·exp(…) — and every form but the definition was 4.6 off.
    The factor keeps its parentheses."""
    rec = linrec.compile("recurrence f(dk = 5, dv = 3)\ninput q[dk], k[dk]\nphi(x) = exp(x - norm(x)^2/2)\n"
                         "c = exp(-1)\nstate z[dk]\nz = sigmoid(c)·z + (1 - sigmoid(c))·phi(k)\n"
                         "output o = q·z\n", "f.lin")
    assert "(1.0 - sigmoid(c_)) * np.exp(" in rec.emit("parallel", "numpy")
    x = rec.random_inputs(batch=2, tokens=12, heads=2, seed=3)
    want = rec.run(x, form="definition").outputs["o"]
    for form in rec.forms:
        got = rec.run(x, form=form).outputs["o"]
        assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max(), form
