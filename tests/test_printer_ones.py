"""The NumPy printer leaves out the chain rule's multiplications by 1 (backends/numpy/printer.py): x·1, which
compiler.adjoint._product writes to give a product its shape, and x·(1/c), the derivative of x/c for a constant
c, which printed as `x * 1.0 / c` — a pass over x each for nothing (Performer's features' gradient, [B, T, H, m],
made two). What is printed instead gives the same values bit for bit (x·1 = x exactly, and Python read
`x * 1.0 / c` as (x·1)/c), and the same shape."""
import numpy as np

import linrec
from linrec.compiler import ir
from linrec.numpy.printer import NumpyPrinter

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
    want = rec.vjp(x, up, form="recurrent", backend="numpy", dims=dims)
    for form in ("parallel", "chunkwise"):
        got = rec.vjp(x, up, form=form, backend="c", dims=dims)
        for name, g in want.grads.items():
            assert np.abs(got.grads[name] - g).max() <= 1e-9 * np.abs(g).max(), (form, name)
