"""tanh, elu, cos and sin in the C kernels (c_common.h.j2: lr_tanh, lr_expm1, lr_cos, lr_sin and their register
forms, which the printer uses for per-token vectors: c.printer._REGISTER, _ROWS): float32 polynomials a register
at a time where libm's tanhf, expm1f, cosf and sinf were a call per element, which no loop vectorizes. Element by
element against NumPy on the same (float32-rounded) inputs — 4e-7 of the value in float32 (at most 1.5 ulp
measured) and 1e-15 in float64 (libm) — over arguments up to ±9000 (cos and sin take libm's from 8192 on) and
±40, on a size with a partial register (the scalar helpers' tail). Their non-finite values: test_nonfinite."""
from __future__ import annotations

import numpy as np
import pytest
from test_c_logs import agree_element_by_element

import linrec

TRIG = linrec.compile("""
recurrence trig(dk = 19, dv = 5)
input q[dk], k[dk], v[dv], a[dk], b[dk]
state S[dk, dv]
S = S + (cos(a)*tanh(b)*k)⊗v
output o = q·S
output c = cos(a)
output s = sin(a)
output t = tanh(b)
output e = elu(b)
""")


def inputs(dtype):
    rng = np.random.default_rng(0)
    B, T, H, dk = 2, 40, 3, 19
    x = TRIG.random_inputs(B, T, H, seed=1)
    a = rng.uniform(-9000, 9000, (B, T, H, dk))
    a[0] = rng.uniform(-4, 4, (T, H, dk))
    b = rng.standard_normal((B, T, H, dk)) * 3
    b[1, :5] = rng.uniform(-40, 40, (5, H, dk))
    b.flat[:4] = [0.0, -0.0, 1e-30, -1e-30]
    x["a"], x["b"] = a, b
    return {k: v.astype(dtype) for k, v in x.items()}


def test_the_kernel_computes_them_a_register_at_a_time():
    source = TRIG.emit("recurrent", backend="c")
    for helper in ("lr_cos_row(", "lr_sin_row(", "lr_tanh_row(", "lr_elu_row("):  # (calls: the header defines them
        assert helper in source, helper                                       # through LR_ROW, without the paren)


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 4e-7), (np.float64, 1e-15)], ids=["f32", "f64"])
def test_tanh_elu_cos_and_sin_agree_with_numpy_element_by_element(dtype, rtol):
    agree_element_by_element(TRIG, inputs(dtype), ("c", "s", "t", "e"), rtol)
