"""x^y in the C kernels (c_common.h.j2: lr_pow, and lr_pow_v, the register form the printer uses for a per-token
vector whose exponent is not one of the small constants it writes out as products: c.printer._general_pow). In
float32 it is e^(y·log x) in double, rounded once to float — within 0.51 ulp of the exact power, where libm's
powf was a call per element that no loop vectorizes; C's special cases (x = 0, negative, infinite or NaN; y
infinite or NaN) come from powf itself.

* A program's outputs x^y, vector and scalar bases and exponents, against NumPy's float64 power of the same
  float32 inputs: within 6.1e-8 of the value (0.51 ulp of float32) on a size with a partial register (the
  scalar helper's tail); in float64 (libm's pow) within 1e-15.
* The helpers alone on every register width: the special values exactly as powf gives them (NaN where it gives
  NaN, zeros with their signs), and random powers from float32's subnormals up within 0.51 ulp.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_c_logs import agree_element_by_element

import linrec
from linrec.c import build as c_build
from linrec.c.kernel_source import Target, common_context
from linrec.templating import environment

POWERS = linrec.compile("""
recurrence powers(dk = 19, dv = 5)
input q[dk], k[dk], v[dv], a[dk] > 0, b[dk]
param c = 2
state S[dk, dv]
S = S + (c^(b/(1 + abs(b)))*k)⊗v
output o = q·S
output p = a^b
output r = c^b
output u = a^(−1.25)
""")


def inputs(dtype):
    rng = np.random.default_rng(0)
    B, T, H, dk = 2, 30, 3, 19
    x = POWERS.random_inputs(B, T, H, seed=1)
    x["a"] = np.exp(rng.uniform(-60, 60, (B, T, H, dk)))
    x["b"] = rng.uniform(-1.4, 1.4, (B, T, H, dk))
    return {k: v.astype(dtype) for k, v in x.items()}


def test_the_kernel_computes_a_vectors_powers_a_register_at_a_time():
    source = POWERS.emit("recurrent", backend="c")
    assert source.count("lr_pow_v(") >= 4, "the helper and the three vectors' powers"
    assert "lr_pow_v(lr_splat(" in source  # c^b: a scalar base in every lane


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 6.1e-8), (np.float64, 1e-15)], ids=["f32", "f64"])
def test_powers_agree_with_numpy_element_by_element(dtype, rtol):
    agree_element_by_element(POWERS, inputs(dtype), ("p", "r", "u"), rtol)  # (o: keys 2^(b/(1 + |b|))·k)


def pow_kernel():
    """lr_pow (s_pow), lr_pow_v a register at a time with lr_pow for the tail (v_pow), and libm's powf (c_pow)
    over arrays, for the current target"""
    common = environment("linrec.c").get_template("c_common.h.j2").render(
        **common_context(Target("float", c_build.vector_bytes())), block_tokens=16, inputs=[], checks_inputs=False)
    calls = """
void s_pow(const T *x, const T *y, T *z, int n) { for (int i = 0; i < n; ++i) z[i] = lr_pow(x[i], y[i]); }
void v_pow(const T *x, const T *y, T *z, int n)
{
    int i = 0;
    for (; i + VW <= n; i += VW) lr_store(z + i, lr_pow_v(lr_load(x + i), lr_load(y + i)));
    for (; i < n; ++i) z[i] = lr_pow(x[i], y[i]);
}
void c_pow(const T *x, const T *y, T *z, int n) { for (int i = 0; i < n; ++i) z[i] = powf(x[i], y[i]); }
"""
    cdef = "".join(f"void {kind}_pow(float *x, float *y, float *z, int n);\n" for kind in "svc")
    return c_build.build(common + calls, cdef, "pow_helpers")


@pytest.mark.parametrize("target", ["native", "avx2", "portable", "native, through memory"])
def test_pow_helpers_special_values_as_powf_and_the_rest_within_half_an_ulp(target, monkeypatch):
    """(through memory: the register's halves as a GCC before 12 takes them, without __builtin_shufflevector)"""
    if target == "avx2" and "avx2" not in c_build._cpu_flags():
        pytest.skip("needs AVX2")
    if target.endswith("through memory"):
        monkeypatch.setenv("LINREC_CFLAGS", "-DLR_NO_SHUFFLEVECTOR")
    monkeypatch.setenv("LINREC_C_TARGET", target.split(",")[0])
    k = pow_kernel()

    def run(kind, x, y):
        z = np.full_like(x, 7.0)
        pointer = lambda a: k.ffi.cast("float *", a.ctypes.data)  # noqa: E731
        getattr(k.lib, f"{kind}_pow")(pointer(x), pointer(y), pointer(z), x.size)
        return z

    special = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -3.0, 1e-45, 1e-38, 3.4e38, np.inf, -np.inf, np.nan],
                       np.float32)
    xs, ys = (np.ascontiguousarray(g.ravel()) for g in np.meshgrid(special, special))  # every pair, 196
    libm = run("c", xs, ys)
    for kind in "sv":
        got = run(kind, xs, ys)
        same = (got == libm) & (np.signbit(got) == np.signbit(libm)) | np.isnan(got) & np.isnan(libm)
        assert same.all(), f"{kind}_pow: {list(zip(xs[~same], ys[~same], got[~same], libm[~same]))[:5]}"

    rng = np.random.default_rng(0)
    n = 1 << 16
    x = np.exp(rng.uniform(-103, 88, n)).astype(np.float32)  # (from the subnormals)
    y = rng.uniform(-2, 2, n).astype(np.float32)
    y[: n // 4] = rng.standard_normal(n // 4) * 1e-3
    x[n // 4: n // 2] = 1 + rng.standard_normal(n // 4) * 1e-4  # near 1, large exponents
    y[n // 4: n // 2] = rng.uniform(-1e5, 1e5, n // 4)
    exact = x.astype(np.float64) ** y.astype(np.float64)
    normal = (np.abs(exact) >= np.finfo(np.float32).tiny) & (np.abs(exact) <= np.finfo(np.float32).max)
    for kind in "sv":
        got = run(kind, x, y)
        with np.errstate(over="ignore"):  # (beyond float32's largest: ∞, as the helpers give it)
            rounded = exact[~normal].astype(np.float32)
        assert np.all(got[~normal] == rounded), kind  # 0, subnormals, ∞: rounded the same
        ulp = np.spacing(np.abs(got[normal])).astype(np.float64)
        err = np.max(np.abs(got[normal] - exact[normal]) / ulp)
        assert err <= 0.51, f"{kind}_pow: {err:.3f} ulp"
