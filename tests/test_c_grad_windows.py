"""The C recurrent backward without corrections (templates/c_grad.c.j2) runs its two passes one window of whole
segments at a time, from the last: pass 1 from the window's checkpoint, pass 2 back over the same window, the
decay's gradient summed anew from the end of each block of 16 tokens. Here: windows of every shape the
checkpoint interval gives (one token per segment, segments grouped to 64 tokens, a segment longer than 64, one
longer than the sequence, a last window shorter than the others), with several key blocks, against the NumPy
recurrent backward at 1e-9 in float64; and in float32 the decay's gradient over a long sequence and a decay
param's gradient over long segments, which the sums started anew keep within a block's rounding."""
import numpy as np
import pytest

import linrec
from test_grad import worst_error

DIMS = {"dk": 96, "dv": 80}  # (several key blocks; the sizes tests/test_c_grad.py builds too)


@pytest.mark.parametrize("name, decay", [("gla", "g"), ("mamba2", "dt"), ("linear_transformer", None)])
def test_windows_of_every_shape_match_numpy(name, decay):
    rec = linrec.load(f"examples/{name}.lin")
    dims = {k: v for k, v in DIMS.items() if k in {d.name for d in rec.program.dims}}
    tokens = 150
    x = rec.random_inputs(batch=1, tokens=tokens, heads=2, dims=dims, seed=5)
    if decay is not None:
        x[decay][:, :, 1] *= 0.2  # (the second head's decays mild enough for the sums, the first's as drawn)
    rng = np.random.default_rng(6)
    up = {o.name: rng.standard_normal(np.shape(x[rec.program.inputs[0].name])[:3] + (dims["dv"],))
          for o in rec.program.outputs}
    shapes = {s.name: (1, 2) + tuple(dims[d] for d in s.shape) for s in rec.program.states}
    s0 = {k: rng.standard_normal(v) for k, v in shapes.items()}
    gT = {k: rng.standard_normal(v) for k, v in shapes.items()}
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims)
    for chunk in (1, 7, 50, 64, 100, 200):
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims, backend="c", chunk_size=chunk)
        assert worst_error(got.grads, want.grads) <= 1e-9, (name, chunk)


def test_float32_decay_gradient_over_a_long_sequence():
    """GLA, T = 4096 in float32 against float64: the decay's gradient, a sum over the tokens after each one,
    within 1e-6 of its largest value (carried over the whole sequence, its rounding reached 2.4e-6 here)."""
    rec = linrec.load("examples/gla.lin")
    dims = {"dk": 64, "dv": 64}
    x = rec.random_inputs(batch=1, tokens=4096, heads=2, dims=dims, seed=3, dtype=np.float32)
    rng = np.random.default_rng(7)
    up = {"o": rng.standard_normal((1, 4096, 2, 64)).astype(np.float32)}
    got = rec.vjp(x, up, dims=dims, backend="c", form="recurrent").grads["g"]
    want = rec.vjp({k: v.astype(np.float64) for k, v in x.items()}, {"o": up["o"].astype(np.float64)}, dims=dims,
                   backend="c", form="recurrent").grads["g"]
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))


@pytest.mark.parametrize("tokens, heads, dk, dv, decay_scale, step_scales, seed", [
    (320, 2, 2, 3, 0.01, [0.1, 20.0], 424665),   # (the second head's steps 200 times the first's)
    (700, 1, 3, 2, 0.3, [0.1], 78817),
])
def test_float32_decay_param_gradient_with_long_segments(tokens, heads, dk, dv, decay_scale, step_scales, seed):
    """Mamba-2's ∂A sums dt·∂l over the tokens. With the sums of ∂l carried over a whole segment of the
    sequence (chunk_size = T), the roundings of neighbouring tokens' ∂l were alike and added up: ∂A was 1.4e-3
    and 1.4e-2 of its size off in float32 (found by a probe). Started again every block of 16 tokens, it is
    within the float32 tolerance, 5e-4, beside float64 — as NumPy's own float32 backward is (2e-5, 1.4e-4)."""
    rec = linrec.load("examples/mamba2.lin")
    dims = {"dk": dk, "dv": dv}
    x = rec.random_inputs(batch=1, tokens=tokens, heads=heads, dims=dims, seed=seed, decay_scale=decay_scale)
    x["dt"] = x["dt"] * np.asarray(step_scales).reshape(1, 1, heads)
    up = {"y": np.random.default_rng(seed + 1000).standard_normal((1, tokens, heads, dv))}
    want = rec.vjp(x, up, dims=dims).grads
    as32 = lambda d: {k: v.astype(np.float32) for k, v in d.items()}  # noqa: E731
    got = rec.vjp(as32(x), as32(up), dims=dims, backend="c", chunk_size=tokens).grads
    for name in ("A", "A_log"):
        assert np.max(np.abs(got[name] - want[name])) <= 5e-4 * np.max(np.abs(want[name])), name


@pytest.mark.parametrize("lanes", [2, 4, 8, 16])
def test_the_checkpoint_transpose_shuffles(lanes):
    """Each window loads its checkpoint [dk, dv] transposed, VW × VW values at a time through registers
    (lr_transpose): grad_kernels.transpose_swaps' masks, applied as __builtin_shuffle applies them (an index
    ≥ lanes picks the second register's lane − lanes), transpose any block."""
    from linrec.c.grad_kernels import transpose_swaps
    block = np.arange(lanes * lanes).reshape(lanes, lanes)
    regs = [row.copy() for row in block]
    lo, hi = transpose_swaps(lanes)
    for level, (mask_lo, mask_hi) in enumerate(zip(lo, hi)):
        s = 1 << level
        for a in range(lanes):
            if not a & s:
                both = np.concatenate([regs[a], regs[a + s]])
                regs[a], regs[a + s] = both[mask_lo], both[mask_hi]
    assert np.array_equal(np.array(regs), block.T)
