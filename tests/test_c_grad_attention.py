"""The chunkwise (flash) backward of softmax attention on the C backend (linrec.c.attention_backward, its
kernels linrec.c.attention_grad): against the NumPy recurrent (KV-cache) backward — the definition, which
tests/test_grad.py checks against finite differences — at 1e-9 in float64 and 5e-4 in float32, and against
the NumPy flash backward; causal, windowed, non-causal (with and without a window), two readouts; T not a
multiple of the block, T = 1; the kernels bit-identical whatever the threads. Two kernels in all (float64,
float32: d and dv are arguments)."""
import numpy as np
import pytest

import linrec
from linrec.c import attention_grad
from linrec.gradients import gradient_refusal
from linrec.numpy import attention as numpy_attention
from test_grad import assert_same_gradients, float32
from test_grad_cover import ATTENTION

DIMS = {"dk": 6, "dv": 5}


def _case(rec, tokens, seed):
    x = rec.random_inputs(batch=2, tokens=tokens, heads=3, dims=DIMS, seed=seed)
    x["q"] *= 3.0  # peaked softmaxes
    rng = np.random.default_rng(seed)
    up = {o.name: rng.standard_normal((2, tokens, 3, 5 if o.name == "o" else 6)) for o in rec.program.outputs}
    return x, up


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_against_the_recurrent_and_the_numpy_flash_backward(name):
    rec = ATTENTION[name]()
    assert gradient_refusal(rec, "chunkwise", "c") is None
    for tokens, chunk in ((23, 4), (23, 7), (1, None)):
        x, up = _case(rec, tokens, tokens)
        reference = rec.vjp(x, up, dims=DIMS)  # NumPy, recurrent
        got = rec.vjp(x, up, dims=DIMS, form="chunkwise", chunk_size=chunk, backend="c")
        assert_same_gradients(got, reference)
        flash = rec.vjp(x, up, dims=DIMS, form="chunkwise", chunk_size=chunk)  # NumPy, chunkwise
        assert_same_gradients(got, flash, 1e-12)
        single = rec.vjp(float32(x), float32(up), dims=DIMS, form="chunkwise", chunk_size=chunk, backend="c")
        assert all(g.dtype == np.float32 for g in single.grads.values())
        assert_same_gradients(single, reference, 5e-4)


def test_the_module_runs_the_c_kernels():
    code = linrec.load("examples/softmax.lin").emit_gradient("chunkwise", backend="c")
    assert "from linrec.c.attention_grad import flash_attention, flash_attention_backward" in code
    assert "linrec.numpy.attention" not in code


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal, window", [(True, 0), (True, 3), (False, 0), (False, 4)])
def test_kernels_are_the_numpy_twins_at_any_thread_count(dtype, causal, window):
    """On broadcast queries (a strided view, read in place) and ragged blocks: the NumPy functions' results,
    and the same bits on one thread as on three."""
    rng = np.random.default_rng(7)
    q = np.broadcast_to(rng.standard_normal((2, 19, 1, 4)).astype(dtype), (2, 19, 3, 4))
    k, v, g = (rng.standard_normal((2, 19, 3, n)).astype(dtype) for n in (4, 5, 5))
    out, lse = numpy_attention.flash_attention(q, k, v, causal, window, 6)
    want = numpy_attention.flash_attention_backward(q, k, v, out, lse, g, causal, window, 6)
    tolerance = 1e-12 if dtype == np.float64 else 1e-5
    runs = []
    for threads in (1, 3):
        c_out, c_lse = attention_grad.flash_attention(q, k, v, causal, window, 6, num_threads=threads)
        grads = attention_grad.flash_attention_backward(q, k, v, c_out, c_lse, g, causal, window, 6,
                                                        num_threads=threads)
        runs.append((c_out, c_lse) + grads)
    for got, ref in zip(runs[0], (out, lse) + want):
        assert got.dtype == dtype
        assert np.max(np.abs(got - ref)) <= tolerance * np.max(np.abs(ref))
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[1]))


def test_bad_arguments_are_named():
    q = np.zeros((1, 4, 1, 3))
    with pytest.raises(linrec.RuntimeInputError, match="'v' should have shape"):
        attention_grad.flash_attention(q, q, np.zeros((1, 5, 1, 2)), True, 0, 4)
    with pytest.raises(linrec.RuntimeInputError, match="'lse' should have shape"):
        attention_grad.flash_attention_backward(q, q, q, q, np.zeros((1, 4)), q, True, 0, 4)
    with pytest.raises(linrec.RuntimeInputError, match="block"):
        attention_grad.flash_attention(q, q, q, True, 0, 0)
    with pytest.raises(linrec.RuntimeInputError, match="window"):
        attention_grad.flash_attention(q, q, q, True, -1, 4)


def test_what_the_c_backend_refuses():
    summed = linrec.compile("recurrence summed(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                            "output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v\n", "summed.lin")
    assert "other than in softmax(s)·V" in gradient_refusal(summed, "chunkwise", "c")
