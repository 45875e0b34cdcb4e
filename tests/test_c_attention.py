"""C kernels for sequence-level attention (linrec.c.attention): softmax attention in its three forms
against a direct NumPy softmax, and Reformer's LSH attention against numpy_attention's.

Every test uses one kernel size (d = 19, dv = 37: odd, several SIMD registers, a tail group of value
registers) per dtype, built once per session in a throw-away cache."""
from __future__ import annotations


import numpy as np
import pytest

from linrec.dsl.errors import LinrecError, RuntimeInputError

D, DV = 19, 37
FORMS = ("recurrent", "parallel", "chunkwise")
DTYPES = (np.float64, np.float32)


@pytest.fixture(scope="session")
def ca(cache_dir):
    """The module, with both kernels built (once) in the session's cache."""
    from linrec.c import attention as c_attention
    for dtype in DTYPES:
        c_attention.kernel(dtype, D, DV)
    return c_attention


def direct(q, k, v, causal, window, offset=0):
    """softmax(q·kᵀ over the visible keys)·v in float64, one dense matrix."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = np.einsum("bthd,bshd->bhts", q, k)
    i = np.arange(q.shape[1])[:, None] + offset
    j = np.arange(k.shape[1])[None, :]
    seen = np.ones(s.shape[-2:], bool)
    if causal:
        seen &= j <= i
    if window:
        seen &= np.abs(i - j) < window
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def qkv(batch, tq, tk, heads, dtype, seed=0, scale=1.0, d=D, dv=DV):
    rng = np.random.default_rng(seed)
    q = (scale * rng.standard_normal((batch, tq, heads, d)) / np.sqrt(d)).astype(dtype)
    k = rng.standard_normal((batch, tk, heads, d)).astype(dtype)
    v = rng.standard_normal((batch, tk, heads, dv)).astype(dtype)
    return q, k, v


def check(out, ref, dtype):
    assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
    assert np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref)) if out.size else 0.0
    if dtype == np.float64:
        assert err <= 1e-12, err
    else:
        assert err <= 5e-4 * max(1e-30, np.max(np.abs(ref))), err


# ---- softmax attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 5), (False, 5)])
def test_forms_against_direct_softmax(ca, dtype, form, causal, window):
    q, k, v = qkv(2, 37, 37, 3, dtype)  # 37: not a multiple of any block
    ref = direct(q, k, v, causal, window)
    check(ca.attention(q, k, v, causal, window, form), ref, dtype)
    if form == "chunkwise":
        for chunk in (1, 5, 16, 50):
            check(ca.attention(q, k, v, causal, window, form, chunk), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tq,tk,window", [(20, 45, 0), (50, 9, 0), (20, 45, 5), (1, 300, 0)])
def test_cross_attention_other_key_length(ca, dtype, form, tq, tk, window):
    """Non-causal, Tk ≠ Tq (Linformer's projected keys): every query against the keys it sees."""
    q, k, v = qkv(2, tq, tk, 2, dtype, seed=1)
    check(ca.attention(q, k, v, False, window, form, 16 if form == "chunkwise" else None),
          direct(q, k, v, False, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [True, False])
def test_single_token(ca, dtype, form, causal):
    q, k, v = qkv(3, 1, 1, 2, dtype, seed=2)
    out = ca.attention(q, k, v, causal, 0, form)
    check(out, direct(q, k, v, causal, 0), dtype)
    np.testing.assert_allclose(out, v, rtol=1e-6)  # one key: its value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [True, False])
def test_several_blocks_with_a_partial_one(ca, dtype, form, causal):
    """T = 150: two whole blocks of 64 and a partial one (and the parallel form's key blocks)."""
    q, k, v = qkv(1, 150, 150, 2, dtype, seed=3)
    ref = direct(q, k, v, causal, 0)
    check(ca.attention(q, k, v, causal, 0, form), ref, dtype)
    check(ca.attention(q, k, v, causal, 33, form), direct(q, k, v, causal, 33), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_large_scores_stay_finite(ca, dtype, form):
    """Scores of about ±300 overflow a naive exp (in float32 already above 88): the running max keeps every
    exponent ≤ 0."""
    q, k, v = qkv(1, 70, 70, 2, dtype, seed=4)
    q = (q / np.linalg.norm(q, axis=-1, keepdims=True) * 300).astype(dtype)
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    s = np.einsum("bthd,bshd->bths", q.astype(np.float64), k.astype(np.float64))
    assert s.max() > 200 and s.min() < -200
    for causal in (True, False):
        check(ca.attention(q, k, v, causal, 0, form, 16 if form == "chunkwise" else None),
              direct(q, k, v, causal, 0), dtype)


@pytest.mark.parametrize("form", FORMS)
def test_forms_agree_and_match_the_numpy_twin(ca, form):
    """The call the generated modules make: attention(q, k, v, causal, window, form, chunk_size)."""
    from linrec.numpy import attention as numpy_attention
    q, k, v = qkv(2, 40, 40, 3, np.float64, seed=5)
    for causal, window in ((True, 0), (False, 7)):
        np.testing.assert_allclose(ca.attention(q, k, v, causal, window, form, None),
                                   numpy_attention.attention(q, k, v, causal, window, form, None),
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_decode_step_over_a_kv_cache(ca, dtype, form):
    """query_offset: the last query alone over the whole cache is the last row of causal attention."""
    q, k, v = qkv(2, 30, 30, 2, dtype, seed=6)
    full = direct(q, k, v, True, 0)
    check(ca.attention(q[:, -1:], k, v, True, 0, form, query_offset=29), full[:, -1:], dtype)
    check(ca.attention(q[:, -4:], k, v, True, 6, form, query_offset=26), direct(q, k, v, True, 6)[:, -4:], dtype)


@pytest.mark.parametrize("form", FORMS)
def test_strided_views_are_read_in_place(ca, form):
    """Slices of a fused [B, T, H, 2d+dv] tensor, a broadcast query and a transposed layout give the same
    result as contiguous copies."""
    rng = np.random.default_rng(7)
    fused = rng.standard_normal((2, 33, 3, 2 * D + DV))
    fused[..., :D] /= np.sqrt(D)
    q, k, v = fused[..., :D], fused[..., D:2 * D], fused[..., 2 * D:]
    assert not q.flags.c_contiguous
    expect = ca.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), True, 0, form)
    np.testing.assert_array_equal(ca.attention(q, k, v, True, 0, form), expect)
    qb = np.broadcast_to(q[:, :, :1], q.shape)
    np.testing.assert_array_equal(ca.attention(qb, k, v, False, 0, form),
                                  ca.attention(np.ascontiguousarray(qb), k, v, False, 0, form))
    kt = np.ascontiguousarray(np.swapaxes(k, 1, 2)).swapaxes(1, 2)  # head-major memory
    np.testing.assert_array_equal(ca.attention(q, kt, v, True, 0, form), expect)


def test_thread_count_does_not_change_the_result(ca, monkeypatch):
    q, k, v = qkv(2, 100, 100, 3, np.float32, seed=8)
    for form in FORMS:
        one = ca.attention(q, k, v, True, 0, form, num_threads=1)
        monkeypatch.setenv("LINREC_NUM_THREADS", "3")
        np.testing.assert_array_equal(ca.attention(q, k, v, True, 0, form), one)
        monkeypatch.delenv("LINREC_NUM_THREADS")


def test_refusals(ca):
    q, k, v = qkv(1, 8, 8, 1, np.float64)
    with pytest.raises(RuntimeInputError, match="causal"):
        ca.attention(q, k[:, :5], v[:, :5], True, 0, "parallel")
    with pytest.raises(LinrecError, match="unknown attention form"):
        ca.attention(q, k, v, True, 0, "dense")
    with pytest.raises(RuntimeInputError, match="sees no key"):
        ca.attention(q, k[:, :2], v[:, :2], False, 3, "parallel")  # query 7 is ≥ 3 past the last key
    with pytest.raises(RuntimeInputError, match="same width"):
        ca.attention(q, k[..., :4], v, False, 0, "parallel")
    with pytest.raises(RuntimeInputError, match="window"):
        ca.attention(q, k, v, False, -1, "parallel")
    with pytest.raises(RuntimeInputError, match="chunk size"):
        ca.attention(q, k, v, False, 0, "chunkwise", 0)


# ---- Reformer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 37, 100])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["lsh_attention_dense", "lsh_attention_bucketed"])
def test_lsh_matches_numpy(ca, dtype, tokens, causal, name):
    from linrec.numpy import attention as numpy_attention
    rng = np.random.default_rng(tokens)
    q = rng.standard_normal((2, tokens, 3, D)).astype(dtype)
    v = rng.standard_normal((2, tokens, 3, DV)).astype(dtype)
    for buckets, rounds, chunk, seed in ((8, 2, 16, 0), (4, 3, 5, 3)):
        ref = getattr(numpy_attention, name)(q, v, causal, buckets, rounds, chunk, seed)
        out = getattr(ca, name)(q, v, causal, buckets, rounds, chunk, seed)
        assert out.dtype == np.dtype(dtype) and out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12 if dtype == np.float64 else 2e-5)


def test_lsh_forms_agree(ca):
    """The bucketed form against the dense reference, both in C."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 200, 2, D))
    v = rng.standard_normal((1, 200, 2, DV))
    for causal in (True, False):
        np.testing.assert_allclose(ca.lsh_attention_bucketed(q, v, causal, 8, 2, 16, 1),
                                   ca.lsh_attention_dense(q, v, causal, 8, 2, 16, 1), rtol=0, atol=1e-12)
