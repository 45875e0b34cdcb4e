"""log, softplus and logsigmoid in the C kernels (c_common.h.j2: lr_log, lr_log1p and their register forms, which
the printer uses for per-token vectors: c.printer._REGISTER, _ROWS): element by element against NumPy on the
same (float32-rounded) inputs — 4e-7 relative in float32 (a few units in the last place; the float32 helpers
are branch-free polynomials, not libm's calls) and 1e-15 in float64 (libm) — over inputs from the subnormals
to 1e37, with 0, −0, ±100 and ±1e-30, on a size with a partial register (the scalar helpers' tail)."""
from __future__ import annotations

import numpy as np
import pytest

import linrec

LOGS = linrec.compile("""
recurrence logs(dk = 19, dv = 5)
input q[dk], k[dk], v[dv], a[dk] > 0, b[dk]
g = logsigmoid(b)
state S[dk, dv]
S = diag(exp(g))·S + (log(a)*k)⊗v
output o = q·S
output p = softplus(b)
output l = log(a)
output m = logsigmoid(b)
""")


def inputs(dtype):
    rng = np.random.default_rng(0)
    B, T, H, dk = 2, 40, 3, 19
    x = LOGS.random_inputs(B, T, H, seed=1)
    x["a"] = np.exp(rng.uniform(-95, 85, (B, T, H, dk)))  # from 5e-42 (a float32 subnormal) to 8e36
    b = rng.standard_normal((B, T, H, dk)) * 30
    b.flat[:6] = [0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30]
    x["b"] = b
    return {k: v.astype(dtype) for k, v in x.items()}


def test_the_kernel_computes_them_a_register_at_a_time():
    source = LOGS.emit("recurrent", backend="c")
    for helper in ("lr_log_v(", "lr_log_row(", "lr_softplus_row(", "lr_logsigmoid_v(", "lr_logsigmoid_row("):
        assert helper in source, helper


def agree_element_by_element(rec, x: dict, names, rtol: float) -> None:
    """rec's C recurrent outputs `names` within rtol of each element's value, against NumPy's float64 recurrent
    form on the same inputs (x, of one dtype), and its output o within the forms' tolerance of its largest."""
    dtype = next(iter(x.values())).dtype
    want = rec.run({k: v.astype(np.float64) for k, v in x.items()}, form="recurrent", backend="numpy").outputs
    got = rec.run(x, form="recurrent", backend="c").outputs
    for name in names:
        w, g = want[name], got[name].astype(np.float64)
        assert np.all(np.isfinite(g)), name
        err = np.max(np.abs(g - w) / np.maximum(np.abs(w), np.finfo(dtype).tiny))
        assert err <= rtol, f"{name}: {err:.3g}"
    w = want["o"]
    tol = 1e-4 if dtype == np.float32 else 1e-12
    assert np.max(np.abs(got["o"] - w)) <= tol * np.max(np.abs(w))


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 4e-7), (np.float64, 1e-15)], ids=["f32", "f64"])
def test_log_softplus_and_logsigmoid_agree_with_numpy_element_by_element(dtype, rtol):
    # (o: the state's decay is exp(logsigmoid(b)), its keys log(a)·k)
    agree_element_by_element(LOGS, inputs(dtype), ("p", "l", "m"), rtol)
