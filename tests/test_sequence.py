"""Programs that read the sequence: exact softmax attention (three forms, masks), Linformer (parallel
only, with its refusals) and Reformer (bucketed form against its dense reference)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.numpy import attention as numpy_attention
from test_grad import worst_error

ROOT = Path(__file__).resolve().parent.parent / "examples"


def direct_softmax_attention(q, k, v, causal=True, window=0):
    batch, tokens, heads, dk = q.shape
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dk)
    i, j = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    seen = np.ones((tokens, tokens), bool)
    if causal:
        seen &= j <= i
    if window:
        seen &= (i - j < window) & (j - i < window)
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def _variant(causal: bool, window: int) -> linrec.Recurrence:
    src = (ROOT / "softmax.lin").read_text()
    if window:
        src = src.replace("seq(k)", f"seq(k, window={window})").replace("seq(v)", f"seq(v, window={window})")
    if not causal:
        src = src.replace("dv = 16)", "dv = 16) noncausal")
    return linrec.compile(src, "softmax_variant.lin")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_softmax_every_form_equals_direct(causal, window, tokens):
    rec = _variant(causal, window)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, tokens, 3, dims={"dk": 5, "dv": 4}, seed=tokens)
    ref = direct_softmax_attention(x["q"], x["k"], x["v"], causal, window)
    for form, chunk in [("recurrent", None), ("parallel", None), ("chunkwise", 16), ("chunkwise", 64)]:
        out = rec.run(x, form=form, chunk_size=chunk).outputs["o"]
        assert np.max(np.abs(out - ref)) < 1e-12, (form, chunk)


# named values inside seq(): normalized keys and queries (QK-norm), a feature map on the values
QK_NORM = """recurrence qknorm(dk = 5, dv = 4)
input q[dk], k[dk], v[dv]
qn = l2norm(q)
kn = l2norm(k)
output o = softmax(seq(kn)·(4·qn))·seq(silu(v))
"""


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_named_values_inside_seq_every_form_equals_direct(backend):
    rec = linrec.compile(QK_NORM, "qknorm.lin")
    x = rec.random_inputs(2, 23, 2, dims={"dk": 5, "dv": 4}, seed=9)
    unit = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)  # noqa: E731
    silu = x["v"] / (1 + np.exp(-x["v"]))
    ref = direct_softmax_attention(unit(x["q"]) * 4 * np.sqrt(5), unit(x["k"]), silu)
    for form, chunk in [("recurrent", None), ("parallel", None), ("chunkwise", 8)]:
        out = rec.run(x, form=form, backend=backend, chunk_size=chunk).outputs["o"]
        assert np.max(np.abs(out - ref)) < 1e-12, (form, chunk)


def test_softmax_float32_and_large_scores_stay_finite():
    rec = linrec.load(ROOT / "softmax.lin")
    x = rec.random_inputs(1, 100, 2, dims={"dk": 8, "dv": 8}, seed=3)
    x = {k: (v * 30).astype(np.float32) for k, v in x.items()}  # scores of several hundred
    ref = direct_softmax_attention(*(x[n].astype(np.float64) for n in "qkv"))
    for form in rec.forms:
        out = rec.run(x, form=form, chunk_size=16).outputs["o"]
        assert out.dtype == np.float32 and np.all(np.isfinite(out))
        assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 5e-4, form


def test_linformer_parallel_equals_direct_and_refuses_the_rest():
    rec = linrec.load(ROOT / "linformer.lin")
    assert rec.forms == ("parallel",)
    for form in ("recurrent", "chunkwise"):
        assert "future ones included" in rec.decomposition.why_not(form)
        with pytest.raises(linrec.LinrecError, match=f"no {form} form"):
            rec.run(rec.random_inputs(1, 4, 1), form=form)
    x = rec.random_inputs(2, 50, 2, dims={"dk": 5, "dv": 4, "kproj": 8}, seed=1)
    res = rec.run(x, form="parallel")
    e, f = res.params["E"][:, :50], res.params["F"][:, :50]
    kp, vp = np.einsum("ps,bshd->bphd", e, x["k"]), np.einsum("ps,bshd->bphd", f, x["v"])
    s = np.einsum("bthd,bphd->bthp", x["q"], kp) / np.sqrt(5)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bthp,bphd->bthd", p / p.sum(-1, keepdims=True), vp)
    assert np.max(np.abs(res.outputs["o"] - ref)) < 1e-12


def test_linformer_causal_is_a_compile_error():
    src = (ROOT / "linformer.lin").read_text().replace(") noncausal", ")")
    with pytest.raises(linrec.LinrecError, match="no causal form"):
        linrec.compile(src, "causal_linformer.lin")


def test_linformer_sequence_longer_than_its_projections_is_refused():
    rec = linrec.compile((ROOT / "linformer.lin").read_text().replace("T = 4096", "T = 16"), "short.lin")
    with pytest.raises(linrec.RuntimeInputError, match="T = 20 tokens but E, F cover"):
        rec.run(rec.random_inputs(1, 20, 1, dims={"kproj": 4}), form="parallel")


@pytest.mark.parametrize("tokens", [1, 5, 37, 100])
@pytest.mark.parametrize("causal", [True, False])
def test_reformer_bucketed_equals_dense_reference(tokens, causal):
    src = (ROOT / "reformer.lin").read_text()
    if not causal:
        src = src.replace("dv = 16)", "dv = 16) noncausal")
    rec = linrec.compile(src, "reformer.lin")
    assert rec.forms == ("parallel", "chunkwise")
    x = rec.random_inputs(2, tokens, 2, dims={"dk": 8, "dv": 4}, seed=tokens)
    dense = rec.run(x, form="parallel").outputs["o"]
    bucketed = rec.run(x, form="chunkwise").outputs["o"]
    assert np.all(np.isfinite(dense)) and np.max(np.abs(dense - bucketed)) < 1e-12


def test_reformer_one_bucket_one_chunk_is_causal_shared_qk_attention():
    # with a single bucket and a chunk as long as the sequence, LSH attention is plain shared-QK
    # attention (keys q/‖q‖), a token seeing itself only when it sees nothing else
    q = np.random.default_rng(0).standard_normal((1, 9, 1, 4))
    v = np.random.default_rng(1).standard_normal((1, 9, 1, 3))
    out = numpy_attention.lsh_attention_dense(q, v, True, buckets=2, rounds=1, chunk=64, seed=0)
    keys = q / np.linalg.norm(q, axis=-1, keepdims=True)
    buckets = numpy_attention.lsh_buckets(q, 2, 1, 0)[0, 0, :, 0]
    for t in range(9):
        others = [j for j in range(t) if buckets[j] == buckets[t]]
        seen = others or [t]
        s = np.array([q[0, t, 0] @ keys[0, j, 0] for j in seen]) / 2.0
        p = np.exp(s - s.max())
        expected = (p / p.sum()) @ v[0, seen, 0]
        assert np.allclose(out[0, t, 0], expected, atol=1e-12)


def test_softmax_decode_over_a_kv_cache_equals_the_full_sequence():
    rec = linrec.load(ROOT / "softmax.lin")
    x = rec.random_inputs(2, 12, 3, seed=5)
    full = rec.run(x, form="parallel").outputs["o"]
    cache, outs = None, []
    for t in range(12):
        out, cache = rec.step({k: v[:, t] for k, v in x.items()}, cache)
        outs.append(out["o"])
    assert cache["k"].shape == (2, 12, 3, 16)  # the state is the cache
    assert np.max(np.abs(np.stack(outs, axis=1) - full)) < 1e-12


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_c_decode_over_a_kv_cache_runs_the_new_query_in_the_kernel(monkeypatch, window, dtype):
    """backend="c": the C attention kernel takes the new token's query only (query_offset), against the
    whole cache; the outputs equal the full sequence's."""
    from linrec.c import attention as c_attention
    rec = _variant(True, window)
    x = {k: v.astype(dtype) for k, v in rec.random_inputs(2, 13, 3, seed=6).items()}
    full = rec.run({k: v.astype(np.float64) for k, v in x.items()}, form="parallel").outputs["o"]
    seen = []
    kernel = c_attention.attention

    def spy(queries, keys, values, *args, **kwargs):
        seen.append((queries.shape[1], keys.shape[1], kwargs.get("query_offset")))
        return kernel(queries, keys, values, *args, **kwargs)
    module = rec.module("recurrent", "c")  # the generated glue calls its own import of the kernel
    monkeypatch.setitem(module.__dict__, "attention", spy)
    cache, outs = None, []
    for t in range(13):
        out, cache = rec.step({k: v[:, t] for k, v in x.items()}, cache, backend="c")
        assert out["o"].dtype == dtype
        outs.append(out["o"])
    assert seen[3:6] == [(1, 4, 3), (1, 5, 4), (1, 6, 5)]  # one query against the t + 1 cached keys
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert np.max(np.abs(np.stack(outs, axis=1) - full)) < tol * np.max(np.abs(full))


def test_linformer_has_no_decode_step():
    rec = linrec.load(ROOT / "linformer.lin")
    x = rec.random_inputs(1, 1, 1)
    with pytest.raises(linrec.LinrecError, match="non-causal: .* no token-by-token decode step"):
        rec.step({k: v[:, 0] for k, v in x.items()}, None)


def test_float32_stays_float32_on_numpy():
    """float32 arrays computed on NumPy stay float32, every intermediate: NumPy's scalars are float64 and, under
    NumPy 2's promotion, made float32 arrays float64 — Reformer's output came back float64 (its scores divided
    by np.sqrt(dk)), and a builtin of constants in a program (sqrt(m), exp(0.5)) computed the expression around
    it in float64. The output of `exp(0.5)·v` is float32 arithmetic's, bit for bit."""
    reformer = linrec.load(ROOT / "reformer.lin")
    x = reformer.random_inputs(1, 24, 2, dtype=np.float32, seed=0)
    result = reformer.run(x, backend="numpy")
    assert result.outputs["o"].dtype == np.float32
    grads = reformer.vjp(x, {"o": np.ones_like(result.outputs["o"])}, form="parallel", backend="numpy").grads
    assert all(g.dtype == np.float32 for g in grads.values())
    scaled = linrec.compile("recurrence scaled(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                            "S = S + k⊗v\noutput o = q·S\noutput p = exp(0.5)·v\noutput r = sqrt(dk + 1)·v\n")
    x = scaled.random_inputs(2, 300, 2, dtype=np.float32, seed=1)
    for form in ("recurrent", "parallel", "chunkwise"):
        outputs = scaled.run(x, form=form, backend="numpy").outputs
        assert all(o.dtype == np.float32 for o in outputs.values())
        assert np.array_equal(outputs["p"], np.float32(np.exp(0.5)) * x["v"]), form
        assert np.array_equal(outputs["r"], np.float32(np.sqrt(5.0)) * x["v"]), form


# ---- found by probing: statistics over the visible keys, scores that mix positions, sequence expressions in C ----

MIXED_HEAD = """recurrence mixed(dk = 3, dv = 5)
input q[dk], k[dk], v[dv], u[dv], k2[dk]
output o = {body}
"""
# bodies whose every form (on each backend that builds it) must equal the float64 NumPy recurrent form (a KV
# cache of the visible keys): means, rmsnorm and groupnorm over the sequence divide by the visible keys (the
# parallel form divided by every key); scores or values that combine positions (softmax of a softmax, l2norm of
# the scores, a mean in the values) have no chunkwise form (it ran one block of keys at a time: wrong outputs);
# keys and values computed from sequences (seq(v)·2, seq(v) + seq(u)) run in the C kernels (they did not run)
MIXED = {
    "mean_of_weights": ("mean(softmax(seq(k)·q))·v", None),
    "mean_of_scores": ("mean(seq(k)·q)·v", None),
    "rmsnorm_of_scores": ("rmsnorm(seq(k)·q)·seq(v)", None),
    "groupnorm_of_scores": ("groupnorm(seq(k)·q)·seq(v)", None),
    "softmax_of_softmax": ("softmax(softmax(seq(k)·q))·seq(v)", "`softmax(seq(k)·q)` combines the scores"),
    "l2norm_scores": ("softmax(5·l2norm(seq(k)·q))·seq(v)", "`l2norm(seq(k)·q)` combines the scores"),
    "rmsnorm_scores": ("softmax(rmsnorm(seq(k)·q))·seq(v)", "`rmsnorm(seq(k)·q)` combines the scores"),
    "mean_in_values": ("softmax(seq(k)·q)·(seq(v)*mean(seq(k)·q))", "`mean(seq(k)·q)` combines the values"),
    "values_scaled": ("softmax(seq(k)·q)·(seq(v)*2)", None),
    "values_summed": ("softmax(seq(k)·q)·(seq(v) + seq(u))", None),
    "keys_summed": ("softmax((seq(k)+seq(k2))·q)·seq(v)", None),
}


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("name", MIXED)
def test_sequence_statistics_and_mixed_scores_every_form(name, window):
    def windowed(text):
        for x in ("k", "v", "u", "k2"):
            text = text.replace(f"seq({x})", f"seq({x}, window={window})") if window else text
        return text
    body, refused = (windowed(text) if text else text for text in MIXED[name])
    rec = linrec.compile(MIXED_HEAD.format(body=body), f"{name}.lin")
    if refused:
        assert "chunkwise" not in rec.forms and refused in rec.decomposition.why_not("chunkwise")
    x = rec.random_inputs(2, 37, 2, seed=3)
    want = rec.run(x, form="recurrent").outputs["o"]
    ran = 0
    for form in rec.forms:
        for backend in ("numpy", "c"):
            if linrec.registry.refusal(rec.compiled, backend, form):
                continue
            got = rec.run(x, form=form, backend=backend, chunk_size=8 if form == "chunkwise" else None).outputs["o"]
            assert np.max(np.abs(got - want)) <= 1e-9 * np.max(np.abs(want)), (form, backend)
            ran += 1
    assert ran >= 2
    if name == "mean_of_weights":  # the weights' mean is 1/(number of keys seen): o = v / that number
        seen = np.minimum(np.arange(1, 38), window or 37)
        assert np.allclose(want / x["v"], (1 / seen)[None, :, None, None], rtol=1e-12)


# ---- a probe's findings (stop 49): each failed before its fix ------------------------------------------------
NAMED_READOUTS = """recurrence named(d = 5)
input q[d], k[d], v[d]
a = softmax(seq(k)·q)·seq(v)               # attention readouts given names, then combined
b = softmax(seq(k)·(2*q))·seq(v)
output o = a + b*sigmoid(q)
"""


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_named_attention_readouts_every_form_equals_direct(backend):
    """`a = softmax(seq(k)·q)·seq(v)` then `output o = 2*a`: check listed every form, and every run was an internal
    error (the named value printed as a value of one token, seq and all). Named readouts are now written into
    the outputs that use them."""
    rec = linrec.compile(NAMED_READOUTS, "named.lin")
    x = rec.random_inputs(2, 9, 2, seed=1)
    q, k, v = x["q"], x["k"], x["v"]
    unscaled = np.sqrt(5)  # (direct_softmax_attention divides the scores by √dk)
    want = direct_softmax_attention(q * unscaled, k, v) + \
        direct_softmax_attention(2 * q * unscaled, k, v) / (1 + np.exp(-q))
    for form in rec.forms:
        got = rec.run(x, form=form, backend=backend, chunk_size=4).outputs["o"]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=form)


@pytest.mark.parametrize("source, message", [
    ("state S[d, d]\nS = S + k⊗(softmax(seq(k)·q)·seq(v))\noutput o = q·S\n",
     r"a program with states \(S\) cannot also read the sequence"),
    ("a = softmax(seq(k)·q)·seq(v)\noutput o = softmax(seq(k)·a)·seq(v)\n",
     "an attention readout's scores or values use another attention readout"),
    ("a = softmax(seq(k)·q)·seq(v)\noutput o = softmax(seq(a)·q)·seq(v)\n",
     "an attention readout's scores or values use another attention readout"),
    ("output o = softmax(seq(k)·q)\n", r"output 'o' has shape \[T\], over the sequence axis 'T'"),
])
def test_programs_the_forms_cannot_run_are_refused_at_their_place(source, message):
    """Each passed check with forms listed, then failed every run with an internal error (a state update
    reading the sequence, attention over another attention's results, an output over the sequence axis)."""
    with pytest.raises(linrec.LinrecError, match=message) as info:
        linrec.compile("recurrence m(d = 5)\ninput q[d], k[d], v[d]\n" + source, "m.lin")
    assert "m.lin:" in str(info.value)


def test_a_window_on_a_projection_over_the_sequence_is_refused():
    """Linformer's E·seq(k, window=3): the forward ignored the window and the gradients applied it."""
    with pytest.raises(linrec.LinrecError, match=r"m.lin:4:\d+: error: parameter\(s\) E span the sequence axis .* "
                                                 r"leave out `window=`"):
        linrec.compile("recurrence m(dk = 5, dv = 4, kp = 3, T = 40) noncausal\ninput q[dk], k[dk], v[dv]\n"
                       "param E[kp, T] = randn(seed=0, std=0.2)\n"
                       "output o = softmax((E·seq(k, window=3))·q)·(E·seq(v, window=3))\n", "m.lin")


@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_scalar_values_in_the_chunkwise_form(tokens):
    """seq(v) of a scalar input v: the NumPy chunkwise form (form='auto''s pick) failed to broadcast."""
    rec = linrec.compile("recurrence m(dk = 5)\ninput q[dk], k[dk], v\noutput o = softmax(seq(k)·q)·seq(v)\n", "m.lin")
    x = rec.random_inputs(2, tokens, 2, seed=1)
    want = direct_softmax_attention(x["q"] * np.sqrt(5), x["k"], x["v"][..., None])[..., 0]
    for chunk in (None, 3):
        got = rec.run(x, form="chunkwise", chunk_size=chunk).outputs["o"]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_non_finite_value_under_a_non_causal_window(bad, dtype):
    """A non-causal window and one value of ±∞ or NaN: the products masked the weights, and a masked weight 0
    times ∞ is NaN, so the parallel and chunkwise forms had NaN at tokens whose window does not hold it (35 of
    40 outputs NaN against the recurrent form's 0). Every form now gives the recurrent form's outputs."""
    rec = _variant(causal=False, window=3)
    x = {k: v.astype(dtype) for k, v in rec.random_inputs(1, 40, 1, dims={"dk": 5, "dv": 4}, seed=0).items()}
    x["v"][0, 17, 0, 2] = bad
    want = rec.run(x, form="recurrent").outputs["o"]
    assert np.isfinite(want).sum() == want.size - 5  # (the five tokens whose window holds token 17, column 2)
    for backend in ("numpy", "c"):
        for form in ("parallel", "chunkwise"):
            got = rec.run(x, form=form, backend=backend, chunk_size=8).outputs["o"]
            np.testing.assert_allclose(got, want, rtol=1e-12 if dtype == np.float64 else 1e-4, atol=1e-6,
                                       err_msg=f"{backend} {form}")


def test_a_kv_cache_missing_an_input_or_of_another_dtype_is_refused():
    """A cache without 'k' was refused for its sizes (the token alone stood for the inputs so far); a float32
    cache took a float64 token and became float64, where run refuses mixed dtypes."""
    rec = linrec.load(ROOT / "softmax.lin")
    x = rec.random_inputs(2, 3, 3, dims={"dk": 4, "dv": 4}, seed=0)
    token = {name: value[:, 0] for name, value in x.items()}
    _, cache = rec.step(token, None)
    with pytest.raises(linrec.RuntimeInputError, match=r"the KV cache of 'softmax' holds no 'k' \(it holds 'q', "
                                                       r"'v'\)"):
        rec.step(token, {name: value for name, value in cache.items() if name != "k"})
    with pytest.raises(linrec.RuntimeInputError, match="the KV cache's 'q' is float32 but the token's 'q' is float64"):
        rec.step(token, {name: value.astype(np.float32) for name, value in cache.items()})


# ---- scores scaled by scalars: the kernels' softmax(K·q)·V with the scalars on the query ---------------------
SCALED_SCORES = {  # (scores as written, the factor of q·k in direct_softmax_attention's scores, from x)
    "constant_left": ("2.5·(seq(k)·q)", lambda x: 2.5),
    "dim_power_right": ("(seq(k)·q)·dk^(−1/2)", lambda x: 5 ** -0.5),
    "negated_over_input": ("−((seq(k)·q)·dk^(−1/2))/tau", lambda x: -(5 ** -0.5) / x["tau"][..., None]),
    "param_times": ("c*(seq(l2norm(k))·q)", None),
}


@pytest.mark.parametrize("name", sorted(SCALED_SCORES))
def test_scaled_scores_run_in_the_c_kernels_every_form(name):
    """`softmax(dk^(−1/2)·(seq(k)·q))·seq(v)` — the scale written on the scores, not on q — had no C form and no
    parallel or chunkwise backward; a scale on the right had no chunkwise form ("combines the scores"). Every
    form, forward and backward, on both backends, now equals a direct loop and the NumPy recurrent backward."""
    scores, factor = SCALED_SCORES[name]
    rec = linrec.compile(f"""recurrence scaled(dk = 5, dv = 4)
param c = 0.7
input q[dk], k[dk], v[dv]
input tau > 0
output o = softmax({scores})·seq(v)
""", "scaled.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, 19, 2, seed=3)
    if factor is None:  # c·(l2norm(k)·q)
        unit = x["k"] / np.sqrt(np.sum(x["k"] ** 2, -1, keepdims=True) + 1e-6)
        want = direct_softmax_attention(x["q"] * 0.7 * np.sqrt(5), unit, x["v"])
    else:
        want = direct_softmax_attention(x["q"] * factor(x) * np.sqrt(5), x["k"], x["v"])
    up = {"o": np.random.default_rng(4).standard_normal(want.shape)}
    reference = rec.vjp(x, up, form="recurrent", backend="numpy").grads
    for backend in ("numpy", "c"):
        for form in ("recurrent", "parallel", "chunkwise"):
            got = rec.run(x, form=form, backend=backend, chunk_size=4).outputs["o"]
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=f"{form} {backend}")
            grads = rec.vjp(x, up, form=form, backend=backend, chunk_size=4).grads
            assert worst_error(grads, reference) < 1e-9, (form, backend)
