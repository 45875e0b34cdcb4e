"""The recurrent and parallel backward of softmax attention on the C backend (linrec.c.attention_backward), and
Linformer's parallel and Reformer's parallel and chunkwise (bucketed) backward on C: against the NumPy recurrent (KV-cache) backward — the definition, which
tests/test_grad.py checks against finite differences — at 1e-9 in float64 and 5e-4 in float32 (Linformer and
Reformer, which have no recurrent form: against the NumPy parallel backward, itself checked against finite
differences in tests/test_grad_attention.py). The parallel kernel against a dense NumPy backward, keys fewer and more than the
queries, and the LSH kernels against NumPy's (dense and bucketed), all bit-identical at any thread count;
bad arguments named.

Kernels: the flash and parallel backward's extension per dtype (d and dv are arguments; shared with
tests/test_c_grad_attention.py), and the parallel forward's attention kernel per dtype at one (d, dv) —
dk = 5, dv = 6, the sizes tests/test_chunk_sizes.py builds for float64."""
import numpy as np
import pytest

import linrec
from linrec.c import attention_grad
from linrec.gradients import gradient_refusal
from linrec.numpy import vjp as numpy_vjp
from test_grad import assert_same_gradients, float32
from test_grad_cover import ATTENTION

DIMS = {"dk": 5, "dv": 6}
NEW_FORMS = ("recurrent", "parallel")


def _case(rec, tokens, seed, dims=DIMS, batch=2, heads=3):
    x = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=dims, seed=seed)
    x["q"] *= 3.0  # peaked softmaxes
    rng = np.random.default_rng(seed)
    shapes = {name: out.shape for name, out in rec.run(x, dims=dims, form="parallel").outputs.items()}
    return x, {name: rng.standard_normal(shape) for name, shape in shapes.items()}


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_each_form_against_the_numpy_recurrent_backward(name):
    """Causal, windowed, non-causal (with and without a window), two readouts with a param in the keys; T of
    23 (not a multiple of the kernels' tiles of 16) and T = 1; float64 and float32."""
    rec = ATTENTION[name]()
    for form in NEW_FORMS:
        assert gradient_refusal(rec, form, "c") is None, form
    for tokens in (23, 1):
        x, up = _case(rec, tokens, tokens)
        reference = rec.vjp(x, up, dims=DIMS)  # NumPy, recurrent
        for form in NEW_FORMS:
            got = rec.vjp(x, up, dims=DIMS, form=form, backend="c")
            assert_same_gradients(got, reference)
            single = rec.vjp(float32(x), float32(up), dims=DIMS, form=form, backend="c")
            assert all(g.dtype == np.float32 for g in single.grads.values())
            assert_same_gradients(single, reference, 5e-4)


def test_linformer_parallel_backward_on_c():
    """E·seq(k), F·seq(v): keys and values of kproj rows (fewer than the tokens here, more in the second call);
    the gradients of E and F zero beyond the positions the call used."""
    rec = linrec.load("examples/linformer.lin")
    assert gradient_refusal(rec, "parallel", "c") is None
    for tokens, kproj in ((20, 8), (9, 12)):
        dims = dict(DIMS, kproj=kproj, T=32)
        x, up = _case(rec, tokens, tokens, dims, batch=1, heads=2)
        reference = rec.vjp(x, up, dims=dims, form="parallel")  # NumPy
        got = rec.vjp(x, up, dims=dims, form="parallel", backend="c")
        assert sorted(got.grads) == ["E", "F", "k", "q", "v"]
        assert got.grads["E"].shape == (kproj, 32) and not got.grads["E"][:, tokens:].any()
        assert_same_gradients(got, reference)
        assert_same_gradients(rec.vjp(float32(x), float32(up), dims=dims, form="parallel", backend="c"),
                              reference, 5e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_reformer_backward_on_c(causal):
    """lsh_attention's backward in C (the buckets held fixed), dense (parallel) and by the bucketed form's
    blocks (chunkwise), against the NumPy parallel backward, itself checked against finite differences in
    tests/test_grad_cover.py; 37 tokens in chunks of 4 (a ragged last chunk), 3 rounds."""
    source = open("examples/reformer.lin").read().replace("rounds=2, chunk=16", "rounds=3, chunk=4")
    rec = linrec.compile(source if causal else source.replace("reformer(dk = 16, dv = 16)",
                                                              "reformer(dk = 16, dv = 16) noncausal"), "reformer.lin")
    assert "chunk=4" in source and rec.program.causal == causal
    x, up = _case(rec, 37, 5)
    reference = rec.vjp(x, up, dims=DIMS, form="parallel")  # NumPy
    for form in ("parallel", "chunkwise"):
        assert gradient_refusal(rec, form, "c") is None
        assert_same_gradients(rec.vjp(x, up, dims=DIMS, form=form, backend="c"), reference)
        assert_same_gradients(rec.vjp(float32(x), float32(up), dims=DIMS, form=form, backend="c"), reference, 5e-4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("form", ["dense", "bucketed"])
def test_lsh_kernels_are_the_numpy_twins_at_any_thread_count(dtype, form):
    rng = np.random.default_rng(3)
    q, v, g = (rng.standard_normal((2, 29, 3, n)) for n in (6, 5, 5))
    name = "vjp_lsh_attention" + ("_bucketed" if form == "bucketed" else "")
    want = getattr(numpy_vjp, name)(q, v, g, True, 8, 2, 4, 0)
    runs = [getattr(attention_grad, name)(*(a.astype(dtype) for a in (q, v, g)), True, 8, 2, 4, 0,
                                          num_threads=threads) for threads in (1, 3)]
    tolerance = 1e-12 if dtype == np.float64 else 1e-5
    for got, ref in zip(runs[0], want):
        assert got.dtype == dtype and np.max(np.abs(got - ref)) <= tolerance * np.max(np.abs(ref))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_the_modules_run_the_c_kernels():
    rec = linrec.load("examples/softmax.lin")
    parallel = rec.emit_gradient("parallel", backend="c")
    assert "from linrec.c.attention_grad import parallel_attention, parallel_attention_backward" in parallel
    recurrent = rec.emit_gradient("recurrent", backend="c")
    assert "from linrec.c.attention_grad import flash_attention, flash_attention_backward" in recurrent
    assert "linrec.numpy.attention" not in parallel + recurrent
    reformer = linrec.load("examples/reformer.lin")
    assert "from linrec.c.attention_grad import vjp_lsh_attention\n" in reformer.emit_gradient("parallel", backend="c")
    assert "from linrec.c.attention import lsh_attention_dense" in reformer.emit_gradient("parallel", backend="c")
    bucketed = reformer.emit_gradient("chunkwise", backend="c")
    assert "from linrec.c.attention_grad import vjp_lsh_attention_bucketed" in bucketed
    assert "from linrec.c.attention import lsh_attention_bucketed" in bucketed


def _dense_backward(q, k, v, g, causal, window):
    """The attention backward over the whole masked score matrix, in NumPy (float64)."""
    s = np.einsum("bthd,bjhd->bhtj", q, k)
    t, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    seen = np.ones(s.shape[-2:], bool)
    if causal:
        seen &= j <= t
    if window:
        seen &= np.abs(t - j) < window
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bthc,bjhc->bhtj", g, v)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    return (np.einsum("bhtj,bjhd->bthd", ds, k), np.einsum("bhtj,bthd->bjhd", ds, q),
            np.einsum("bhtj,bthc->bjhc", p, g))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal, window, keys", [(True, 0, 19), (True, 3, 19), (False, 0, 19), (False, 4, 19),
                                                  (False, 0, 7), (False, 0, 40)])
def test_parallel_kernel_against_the_dense_backward_at_any_thread_count(dtype, causal, window, keys):
    """On broadcast queries (a strided view, read in place): the dense backward's results, and the same bits on
    one thread as on three."""
    rng = np.random.default_rng(keys + window)
    q = np.broadcast_to(rng.standard_normal((2, 19, 1, 4)), (2, 19, 3, 4))
    k, v = rng.standard_normal((2, keys, 3, 4)), rng.standard_normal((2, keys, 3, 5))
    g = rng.standard_normal((2, 19, 3, 5))
    want = _dense_backward(q, k, v, g, causal, window)
    runs = [attention_grad.parallel_attention_backward(*(a.astype(dtype) for a in (q, k, v, g)), causal, window,
                                                       num_threads=threads) for threads in (1, 3)]
    tolerance = 1e-12 if dtype == np.float64 else 1e-5
    for got, ref in zip(runs[0], want):
        assert got.dtype == dtype and got.shape == ref.shape
        assert np.max(np.abs(got - ref)) <= tolerance * np.max(np.abs(ref))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_bad_arguments_are_named():
    q = np.zeros((1, 4, 1, 3))
    with pytest.raises(linrec.RuntimeInputError, match="'d_out' should have shape"):
        attention_grad.parallel_attention_backward(q, q, q, np.zeros((1, 4, 1, 2)), True, 0)
    with pytest.raises(linrec.RuntimeInputError, match="as many keys as queries"):
        attention_grad.parallel_attention_backward(q, q[:, :3], q[:, :3], q, True, 0)
    with pytest.raises(linrec.RuntimeInputError, match="'v' should have shape"):
        attention_grad.parallel_attention_backward(q, q, q[:, :3], q, False, 0)
    with pytest.raises(linrec.RuntimeInputError, match="window"):
        attention_grad.parallel_attention_backward(q, q, q, q, True, -1)
    with pytest.raises(linrec.RuntimeInputError, match="'d_out' should have shape"):
        attention_grad.vjp_lsh_attention(q, q, q[:, :2], True, 4, 1, 2, 0)
    with pytest.raises(linrec.RuntimeInputError, match="chunk must be a positive integer"):
        attention_grad.vjp_lsh_attention(q, q, q, True, 4, 1, 0, 0)
    rec = linrec.load("examples/softmax.lin")
    x, up = _case(rec, 5, 0)
    for form in NEW_FORMS:  # a gradient of the wrong shape: named, before any kernel runs
        with pytest.raises(linrec.RuntimeInputError, match="'o'"):
            rec.vjp(x, {"o": up["o"][..., :4]}, dims=DIMS, form=form, backend="c")


def test_what_the_c_backend_refuses():
    summed = linrec.compile("recurrence summed(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                            "output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v\n", "summed.lin")
    assert gradient_refusal(summed, "recurrent", "numpy") is None
    refusal = gradient_refusal(summed, "recurrent", "c")
    assert "the sequence is used outside softmax(K·q)·V" in refusal and "backend='numpy'" in refusal
    both = linrec.compile("recurrence both(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                          "output o = softmax(seq(k)·q)·seq(v) + lsh_attention(q, v, buckets=4, rounds=1, chunk=4, "
                          "seed=0)\n", "both.lin")
    assert gradient_refusal(both, "parallel", "numpy") is None
    assert "lsh_attention sits beside a softmax over the sequence" in gradient_refusal(both, "parallel", "c")
