"""The C backend's recurrent backward (linrec.c.grad, templates/c_grad.c.j2) against the NumPy recurrent
backward — the adjoint of the statements as written — at 1e-9 in float64 and 5e-4 in float32, on the
examples whose updates decompose into a decay plus rank-one terms: GLA, gated DeltaNet, DeltaNet, Mamba-2,
RetNet, the Linear Transformer, gdn2 and comba. Every case runs at one size (dk = 5, dv = 7: odd, not a
whole SIMD register) so that the kernels are built once per structure and shared; the cases vary what the
kernels take at run time: T (ragged, 1), the batch and heads against the threads, the checkpoint interval,
strong decays, random initial states and final-state gradients."""
import weakref

import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import build as c_build, grad_kernels, scan_kernels
from linrec.dsl.errors import LinrecError, RuntimeInputError
from fuzzing import off_a_line
from test_grad import worst_error

DIMS = {"dk": 5, "dv": 7}
EXAMPLES = ("gla", "gated_deltanet", "deltanet", "mamba2", "retnet", "linear_transformer", "gdn2", "comba")
FLOAT32 = ("gla", "gated_deltanet")  # (a float32 kernel each: the structures of the others are float64's)


@pytest.fixture(scope="module")
def recs():
    return {name: linrec.load(f"examples/{name}.lin") for name in EXAMPLES}


def _call(rec, batch, tokens, heads, seed, dtype=np.float64, decay_scale=None):
    """Inputs, upstream gradients of the outputs and of the final states, and random initial states."""
    extra = {} if decay_scale is None else {"decay_scale": decay_scale}
    x = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=DIMS, seed=seed, **extra)
    rng = np.random.default_rng(seed + 100)
    up = {o.name: rng.standard_normal((batch, tokens, heads) + tuple(DIMS[d] for d in o.value.shape))
          for o in rec.program.outputs}
    states = {s.name: rng.standard_normal((batch, heads) + tuple(DIMS[d] for d in s.shape))
              for s in rec.program.states}
    final = {s.name: rng.standard_normal((batch, heads) + tuple(DIMS[d] for d in s.shape))
             for s in rec.program.states}
    cast = lambda d: {k: v.astype(dtype) for k, v in d.items()}  # noqa: E731
    return cast(x), cast(up), cast(states), cast(final)


# (batch, tokens, heads, chunk_size, decay_scale): ragged T with several checkpoint intervals (one token, a
# segment longer than the sequence, √T), T = 1, strong decays (log-decays down to about −20)
CASES = [(2, 13, 3, None, None), (1, 13, 2, 1, None), (2, 13, 1, 4, None), (1, 9, 2, 64, None),
         (2, 1, 2, None, None), (1, 12, 2, 5, 40.0)]


@pytest.mark.parametrize("name", EXAMPLES)
def test_float64_matches_the_numpy_recurrent_backward(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=chunk)
        assert worst_error(got.grads, want.grads) <= 1e-9, (name, CASES[i])
        assert worst_error(got.outputs, want.outputs) <= 1e-9
        assert worst_error(got.final_state, want.final_state) <= 1e-9
        assert all(g.dtype == np.float64 for g in got.grads.values())


@pytest.mark.parametrize("name", FLOAT32)
def test_float32_within_5e_4_of_float64(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=10 + i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        x32, up32, s32, g32 = ({k: v.astype(np.float32) for k, v in d.items()} for d in (x, up, s0, gT))
        got = rec.vjp(x32, up32, initial_state=s32, grad_final_state=g32, dims=DIMS, backend="c",
                      chunk_size=chunk)
        assert all(g.dtype == np.float32 for g in got.grads.values())
        assert worst_error(got.grads, want.grads) <= 5e-4, (name, CASES[i])


def test_rows_of_one_register_off_a_cache_line(recs):
    """Rows of exactly one SIMD register (float32, dk = dv = 16) that do not start on a 64-byte boundary, as
    NumPy's arrays often do, through the backward that keeps no states (mild decays): gcc 12 once vectorized
    the copy of a block's rows across its tokens with aligned loads, a segmentation fault here
    (templates/c_grad.c.j2, lr_fill_token). The gradients within float32's tolerance of NumPy's in float64."""
    rec, dims = recs["mamba2"], {"dk": 16, "dv": 16}
    x = rec.random_inputs(batch=1, tokens=16, heads=2, dims=dims, seed=3)
    x["dt"] = x["dt"] * 0.05  # (log-decays dt·A near 0: the two passes, not the states' way)
    up = {"y": np.random.default_rng(4).standard_normal((1, 16, 2, 16))}
    want = rec.vjp(x, up, dims=dims)
    got = rec.vjp({k: off_a_line(v.astype(np.float32), 8) for k, v in x.items()},
                  {k: off_a_line(v.astype(np.float32), 8) for k, v in up.items()}, dims=dims, backend="c")
    assert worst_error(got.grads, want.grads) <= 5e-4


def test_column_blocks_and_row_tiles(recs):
    """At dk = 71, dv = 61 (float64) the forward runs its columns in blocks, the last one partly padding, and
    without corrections its tiles of rows leave a tail of single rows (grad_kernels: forward_registers,
    tile_rows) — with 32-byte registers and with 64-byte ones; the tokens go in blocks that end at the
    checkpoints (T = 37 by 5): the gradients still those of the NumPy recurrent backward to 1e-9 — GLA (the
    tiled pass), gated DeltaNet and gdn2 (with corrections: token by token, a decay per token and per row). With
    corrections the backward's columns go in groups of a register's lanes, its adjoint two columns at once
    (LR_PAIR), then one at a time (LR_GROUPS): 61 columns leave a tail in float64 and in float32 at either width
    (to 5e-4 of float64 in float32)."""
    dims = {"dk": 71, "dv": 61}
    s = grad_kernels.Structure("row", 0, 1, (False,), 71, 61, "double", c_build.vector_bytes())
    registers = -(-61 // s.lanes)
    assert grad_kernels.forward_registers(s) < registers and 71 % grad_kernels.tile_rows(s) != 0
    rng = np.random.default_rng(21)
    for name in ("gla", "gated_deltanet", "gdn2"):
        rec = recs[name]
        x = rec.random_inputs(batch=1, tokens=37, heads=2, dims=dims, seed=21)
        up = {o.name: rng.standard_normal((1, 37, 2, 61)) for o in rec.program.outputs}
        s0 = {"S": rng.standard_normal((1, 2, 71, 61))}
        gT = {"S": rng.standard_normal((1, 2, 71, 61))}
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims)
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims, backend="c", chunk_size=5)
        assert worst_error(got.grads, want.grads) <= 1e-9, name
        assert worst_error(got.outputs, want.outputs) <= 1e-9, name
        assert worst_error(got.final_state, want.final_state) <= 1e-9, name
        if name != "gla":
            x32, up32, s32, g32 = ({k: v.astype(np.float32) for k, v in d.items()} for d in (x, up, s0, gT))
            got = rec.vjp(x32, up32, initial_state=s32, grad_final_state=g32, dims=dims, backend="c", chunk_size=5)
            assert worst_error(got.grads, want.grads) <= 5e-4, name


def test_threads_fewer_and_more_than_the_pairs(recs, monkeypatch):
    """(batch row, head) pairs fewer than the threads and more: the same gradients as on one thread (the
    kernels' small-work rule, which would run these tiny calls on one thread, is lifted)."""
    rec = recs["gated_deltanet"]
    monkeypatch.setattr(scan_kernels, "SMALL_WORK", 0)
    for batch, heads in ((1, 2), (3, 5)):
        x, up, s0, gT = _call(rec, batch, 11, heads, seed=3)
        monkeypatch.setenv("LINREC_NUM_THREADS", "1")
        one = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=3)
        monkeypatch.setenv("LINREC_NUM_THREADS", "4")
        many = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=3)
        assert worst_error(many.grads, one.grads) == 0.0


def test_checkpoint_interval_does_not_change_the_gradients(recs):
    rec = recs["gla"]
    x, up, s0, gT = _call(rec, 1, 17, 2, seed=4)
    grads = [rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=c).grads
             for c in (1, 3, 17, 100)]
    assert all(worst_error(g, grads[0]) <= 1e-12 for g in grads[1:])


def test_bad_input_is_refused_as_on_numpy(recs):
    rec = recs["gla"]
    x, up, _, _ = _call(rec, 1, 4, 2, seed=5)
    for bad in ({"o": up["o"].astype(np.float32)}, {"o": up["o"][:, :3]}, {}):
        messages = []
        for backend in ("numpy", "c"):
            with pytest.raises(RuntimeInputError) as err:
                rec.vjp(x, bad, dims=DIMS, backend=backend)
            messages.append(str(err.value))
        assert messages[0] == messages[1]
    with pytest.raises(RuntimeInputError, match="chunk size must be a positive integer"):
        rec.vjp(x, up, dims=DIMS, backend="c", chunk_size=0)


def test_refusals_give_the_structural_reason():
    gla = linrec.load("examples/gla.lin")
    assert gradients.gradient_refusal(gla, "recurrent", "c") is None
    assert gradients.gradient_refusal(gla, "chunkwise", "c") is None  # (c.grad_chunk: test_c_grad_chunkwise)
    assert gradients.gradient_refusal(linrec.load("examples/mamba1.lin"), "chunkwise", "c") is None  # (in a frame:
    # c.grad_chunk_scans, tests/test_c_grad_chunk_cover.py)
    summed = linrec.compile("recurrence summed(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                            "output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v\n", "summed.lin")
    assert "attention" in gradients.gradient_refusal(summed, "recurrent", "c")  # (softmax(K·q)·V alone: it builds)
    # no recurrent form at all: the reason, and no advice to run it elsewhere
    linformer = gradients.gradient_refusal(linrec.load("examples/linformer.lin"), "recurrent", "c")
    assert "no recurrent forward form" in linformer and "NumPy" not in linformer
    with pytest.raises(LinrecError, match="attention"):
        summed.vjp({}, {}, backend="c")


def test_emitted_backward_calls_the_kernels(recs):
    text = recs["gated_deltanet"].emit_gradient("recurrent", "c")
    assert "adjoint_checkpoints(" in text and "adjoint_recurrent(" in text
    assert "# adjoint of S.correction0_u" in text  # the corrections' adjoints, into the expressions they come from


def test_key_blocks_and_both_ways_of_the_decay_gradient(recs):
    """Without corrections the backward runs in blocks of the key axis, two passes each, and takes the decay's
    gradient from sums over the tokens — or, for a pair whose decays are all but total (log-decays averaging below
    −20), keeps the states (templates/c_grad.c.j2, LR_FORGETFUL_LOG_DECAY). Sizes of several key blocks in
    float64, the first pair's decays so and the second's mild, a decay per row (GLA) and per token (Mamba-2)."""
    dims = {"dk": 96, "dv": 80}
    s = grad_kernels.Structure("row", 0, 1, (False,), 96, 80, "double", c_build.vector_bytes())
    assert -(-96 // s.lanes) // grad_kernels.backward_registers(s) >= 2  # (key blocks)
    for name, decay in (("gla", "g"), ("mamba2", "dt")):
        rec = recs[name]
        x = rec.random_inputs(batch=2, tokens=21, heads=1, dims=dims, seed=3)
        x[decay][0] *= 100.0  # (log-decays averaging −40 or below for the first pair)
        rng = np.random.default_rng(4)
        up = {o.name: rng.standard_normal(np.shape(x[rec.program.inputs[0].name])[:3] + (80,)) for o in rec.program.outputs}
        want = rec.vjp(x, up, dims=dims)
        got = rec.vjp(x, up, dims=dims, backend="c")
        assert worst_error(got.grads, want.grads) <= 1e-9, name
        assert worst_error({k: v[1:] for k, v in got.grads.items() if np.ndim(v) == 4},
                           {k: v[1:] for k, v in want.grads.items() if np.ndim(v) == 4}) <= 1e-9, name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sums_for_the_values_gradient_in_the_tiles_or_after_them(recs, dtype):
    """∂x sums the adjoint over the key axis, across a register's lanes: where the tiles of pass 2 hold the
    value rows whole, in groups that divide the lanes, a tile combines its rows' partial sums as they come and the
    tree of shuffles ends after the tiles (templates/c_grad.c.j2, LR_TILE_SUMS); elsewhere the whole tree runs
    after them. Each way against NumPy's backward; a lane order wrong in the tiles' way gives another row's
    ∂v (tested by that mutation)."""
    lanes = c_build.vector_bytes() // np.dtype(dtype).itemsize
    ctype = "double" if dtype == np.float64 else "float"
    ways = {}
    for dv in (2 * lanes, 2 * lanes + 2, 3):
        s = grad_kernels.Structure("row", 0, 1, (False,), 32, dv, ctype, c_build.vector_bytes())
        ways[dv] = grad_kernels.tile_sum_levels(s)
    assert ways[2 * lanes] is not None and ways[3] is None  # (both ways are run)
    rec = recs["gla"]
    for dv, levels in ways.items():
        dims = {"dk": 32, "dv": dv}
        x = rec.random_inputs(batch=2, tokens=37, heads=2, dims=dims, seed=dv, dtype=dtype)
        rng = np.random.default_rng(dv)
        up = {"o": rng.standard_normal((2, 37, 2, dv)).astype(dtype)}
        want = rec.vjp({k: v.astype(np.float64) for k, v in x.items()}, {"o": up["o"].astype(np.float64)}, dims=dims)
        got = rec.vjp(x, up, dims=dims, backend="c")
        assert worst_error(got.grads, want.grads) <= (1e-9 if dtype == np.float64 else 5e-4), (dv, levels)


def test_gradients_held_by_the_caller_are_never_reused(recs):
    """The kernels' gradient arrays are recycled between calls (c.grad_calls.GRADIENT_ARRAYS) only once the
    caller has dropped them: a result kept — or a view of one — keeps its values through later calls."""
    rec = recs["gla"]
    x, up, s0, gT = _call(rec, 1, 13, 2, seed=7)
    first = rec.vjp(x, up, initial_state=s0, dims=DIMS, backend="c")
    kept = {k: v.copy() for k, v in first.grads.items()}
    view = first.grads["q"][0]
    x2, up2, _, _ = _call(rec, 1, 13, 2, seed=8)
    rec.vjp(x2, up2, initial_state=s0, dims=DIMS, backend="c")
    assert all(np.array_equal(first.grads[k], kept[k]) for k in kept)
    del first
    rec.vjp(x2, up2, initial_state=s0, dims=DIMS, backend="c")
    assert np.array_equal(view, kept["q"][0])


def test_resets(recs):
    """Log-decays of exactly −∞ (a decay of 0): as on NumPy, and ∂g is 0 at a reset (float32 too)."""
    rec = recs["gla"]
    x, up, s0, gT = _call(rec, 1, 12, 2, seed=6)
    x["g"][0, 4] = -np.inf
    x["g"][0, 9, 1] = -np.inf
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for dtype, tolerance in ((np.float64, 1e-9), (np.float32, 5e-4)):
        cast = lambda d: {k: v.astype(dtype) for k, v in d.items()}  # noqa: E731
        got = rec.vjp(cast(x), cast(up), initial_state=cast(s0), grad_final_state=cast(gT), dims=DIMS,
                      backend="c", chunk_size=5)
        assert worst_error(got.grads, want.grads) <= tolerance
        assert np.all(got.grads["g"][0, 4] == 0) and np.all(got.grads["g"][0, 9, 1] == 0)


def test_blocks_at_a_running_scale_and_blocks_without_one(recs):
    """Without corrections the two passes carry a block of tokens' state and adjoint divided by the product of
    the block's decays so far (templates/c_grad.c.j2, lr_scale_forward and lr_scale_adjoint); a block where that
    product leaves its range multiplies by each decay instead. Here one pair runs both kinds of blocks: mild
    decays, with a token of log-decay −40 in a few channels (the product underflows in its blocks) every 40
    tokens and a reset (−∞) once — GLA, and readouts before and after the update (STRUCTURES["before"], a
    decay through sigmoid). Against NumPy at 1e-9 in float64 and 5e-4 in float32."""
    for rec, decay in ((recs["gla"], "g"), (linrec.compile(STRUCTURES["before"], "before.lin"), "a")):
        x, up, s0, gT = _call(rec, 2, 90, 2, seed=11, decay_scale=0.1)
        if decay == "a":
            x["a"] = np.abs(x["a"]) + 3.0  # (sigmoid ≈ 0.95…1: mild)
        x[decay][:, 5::40, :, 1:3] = -40.0  # (for "a": sigmoid(−40) = e^−40)
        x[decay][0, 61, 0] = -np.inf if decay == "g" else -800.0
        _c_matches_numpy(rec, x, up, s0, gT, outputs=True)


def _c_matches_numpy(rec, x, up, s0, gT, outputs=False):
    """The C recurrent backward against NumPy's in float64: 1e-9 in float64, 5e-4 in float32 (the outputs too,
    if asked)."""
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for dtype, tolerance in ((np.float64, 1e-9), (np.float32, 5e-4)):
        cast = lambda d: {k: v.astype(dtype) for k, v in d.items()}  # noqa: E731
        got = rec.vjp(cast(x), cast(up), initial_state=cast(s0), grad_final_state=cast(gT), dims=DIMS, backend="c")
        assert worst_error(got.grads, want.grads) <= tolerance, (rec.name, dtype)
        if outputs:
            assert worst_error(got.outputs, want.outputs) <= tolerance, (rec.name, dtype)


def test_blocks_whose_running_scale_starts_again(recs):
    """Where a block's product of decays leaves the running scale's range though no decay alone does, the scale
    starts again at that token (templates/c_grad.c.j2, lr_scale_forward's restart): the tiles multiply their
    registers by the scale so far and go on from 1. Log-decays of −3 to −5 (nine or so tokens leave the range)
    in a few channels or whole tokens — GLA (per row), Mamba-2 (per token, through dt), and readouts before and
    after the update (STRUCTURES["before"]): against NumPy at 1e-9 in float64 and 5e-4 in float32."""
    cases = ((recs["gla"], "g"), (recs["mamba2"], "dt"), (linrec.compile(STRUCTURES["before"], "before.lin"), "a"))
    for rec, decay in cases:
        x, up, s0, gT = _call(rec, 2, 90, 2, seed=12, decay_scale=0.1)
        rng = np.random.default_rng(13)
        strong = rng.uniform(3.0, 5.0, size=np.shape(x[decay][:, 20:70]))
        if decay == "g":
            x["g"][:, 20:70, :, 1:4] = -strong[..., 1:4]
        elif decay == "dt":  # (dt·A: A from −1 to −16, so dt of 5 over the largest |A| and more)
            x["dt"][:, 20:70] = strong
        else:  # (sigmoid(a) = e^−3 … e^−5)
            x["a"] = np.abs(x["a"]) + 3.0
            x["a"][:, 20:70, :, 1:4] = -strong[..., 1:4]
        _c_matches_numpy(rec, x, up, s0, gT)


def test_decay_gradient_of_strong_decays_in_two_passes(recs):
    """With every readout after the update the two passes take ∂l from each token's own terms with the parts that
    cancel taken out (templates/c_grad.c.j2, lr_split_terms): under strong decays those terms are as small as ∂l,
    so a pair keeps two passes down to log-decays averaging −20. Mamba-2 in float32, `random_inputs`' dt times 3
    (log-decays averaging −1.5 to −13 by head), at model sizes: every gradient, ∂A_log — a sum of ∂l over the
    tokens — the farthest, within a tenth of the tolerance of float64 (measured 9e-6; the sums with each token's
    whole terms, in two passes, were 1.1e-4 off here)."""
    rec = recs["mamba2"]
    dims = {"dk": 64, "dv": 64}
    x = rec.random_inputs(batch=1, tokens=1024, heads=4, dims=dims, seed=7)
    x["dt"] = x["dt"] * 3.0
    rng = np.random.default_rng(6)
    up = {"y": rng.standard_normal((1, 1024, 4, 64))}
    want = rec.vjp(x, up, dims=dims)
    got = rec.vjp({k: v.astype(np.float32) for k, v in x.items()}, {"y": up["y"].astype(np.float32)}, dims=dims,
                  backend="c")
    assert worst_error(got.grads, want.grads) <= 5e-5


# decays given as values (their logs computed numerically): a scalar, one per row, one per column, a vector
# state's, and 1 − beta
VALUE_DECAYS = {
    "scalar": ("input a in (0, 1)", "S = a·S + k⊗v", "a"),
    "rows": ("input a[dk] in (0, 1)", "S = diag(a)·S + k⊗v", "a"),
    "columns": ("input a[dv] in (0, 1)", "S = S·diag(a) + k⊗v", "a"),
    "ema": ("input a in (0, 1)", "S = (1 − a)·S + a·k⊗v", "a"),
    # exact logs that divide by the value all the same (found by probing: exp(log(a)) at a = 1e-12 gave ∂a
    # 2.5e-5 off in float64, sigmoid(log(a)) at 1e-300 1e283)
    "exp_log": ("input a[dk] in (0, 1)", "S = diag(exp(log(a)))·S + k⊗v", "a"),
    "sigmoid_log": ("input a in (0, 1)", "S = sigmoid(log(a))·S + k⊗v", "a"),
}


@pytest.mark.parametrize("name", sorted(VALUE_DECAYS))
def test_small_decays_given_as_values(name):
    """A decay given as a value reaches its gradient through ∂a = ∂l / a, which multiplies the C kernels'
    rounding of ∂l (exact to its terms, not to itself) by 1/a: a = 1e-4 gave 3e-3 of the largest ∂a in float32,
    a = 1e-300 in float64 1e284 (found by probing). Where such decays are small the C module's scans run NumPy's
    decomposed backward (c.small_decays): every C gradient form within 5e-4 (float32) and 1e-9 (float64) of
    NumPy's recurrent backward, with decays of 1e-4 (float32) and 1e-300 (float64; 1 − a: 1e-12) at three tokens."""
    declaration, update, decay = VALUE_DECAYS[name]
    rec = linrec.compile(f"recurrence {name}(dk = 5, dv = 7)\ninput q[dk], k[dk], v[dv]\n{declaration}\n"
                         f"state S[dk, dv]\n{update}\noutput o = q·S\n", f"{name}.lin")
    x, up, s0, gT = _call(rec, 1, 40, 2, seed=5)
    for dtype, small, tolerance in ((np.float32, 1e-4, 5e-4), (np.float64, 1e-300, 1e-9)):
        y = dict(x, **{decay: x[decay].copy()})
        y[decay][:, 5:8] = 1 - max(small, 1e-12) if name == "ema" else small  # (1 − 1e-300 is 1)
        want = rec.vjp(y, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        cast = lambda d: {k: v.astype(dtype) for k, v in d.items()}  # noqa: E731
        for form in gradients.derived_forms(rec):
            got = rec.vjp(cast(y), cast(up), initial_state=cast(s0), grad_final_state=cast(gT), dims=DIMS,
                          form=form, backend="c")
            assert worst_error(got.grads, want.grads) <= tolerance, (form, dtype)


def test_per_key_decays_in_whole_registers(recs):
    """GLA in float32 at dk = 20 (whole registers of decays and a tail, with 32- and 64-byte registers), mild
    decays (the blocks' two passes, where strong ones take the states' way): the blocks take exp of the
    log-decays a register at a time (templates/c_grad.c.j2, lr_expf_v; 0.1% off there gives 7e-3 here). The
    gradients within float32's tolerance of NumPy's float64 recurrent backward."""
    rec, dims = recs["gla"], {"dk": 20, "dv": 8}
    x = rec.random_inputs(batch=1, tokens=40, heads=2, dims=dims, seed=17)
    x["g"] = np.random.default_rng(18).uniform(-0.3, 0.0, x["g"].shape)
    up = {"o": np.random.default_rng(19).standard_normal((1, 40, 2, 8))}
    want = rec.vjp(x, up, dims=dims)
    got = rec.vjp({k: v.astype(np.float32) for k, v in x.items()}, {"o": up["o"].astype(np.float32)}, dims=dims,
                  backend="c", chunk_size=7)
    assert worst_error(got.grads, want.grads) <= 5e-4
    assert worst_error(got.outputs, want.outputs) <= 5e-4


def test_subnormal_decays_given_as_values():
    """A decay given as a value below its dtype's normal range keeps too few bits for any log-space backward:
    ∂a was 0.74 off at a = 5e-324 (float64) and 1.5e-2 at 1e-43 (float32) in every form but NumPy's recurrent
    one (found by probing). Such a call runs the statements as written: every form on both backends within the
    forms' tolerance of NumPy's recurrent backward in the same dtype."""
    declaration, update, decay = VALUE_DECAYS["scalar"]
    rec = linrec.compile(f"recurrence subnormal(dk = 5, dv = 7)\ninput q[dk], k[dk], v[dv]\n{declaration}\n"
                         f"state S[dk, dv]\n{update}\noutput o = q·S\n", "subnormal.lin")
    x, up, s0, _ = _call(rec, 1, 20, 2, seed=9)
    for dtype, tiny, tolerance in ((np.float64, 5e-324, 1e-9), (np.float32, 1e-43, 5e-4)):
        y = dict(x, a=x["a"].copy())
        y["a"][:, 4:6] = tiny
        cast = lambda d: {k: v.astype(dtype) for k, v in d.items()}  # noqa: E731
        want = rec.vjp(cast(y), cast(up), initial_state=cast(s0), dims=DIMS, form="recurrent").grads
        for backend in ("numpy", "c"):
            for form in gradients.derived_forms(rec):
                got = rec.vjp(cast(y), cast(up), initial_state=cast(s0), dims=DIMS, form=form, backend=backend)
                assert worst_error(got.grads, want) <= tolerance, (backend, form, dtype)


def test_a_decay_of_zero_given_as_a_param():
    """A per-head decay param of exactly 0: the C recurrent backward gave ∂gamma = NaN (∂l = 0 there, and the
    chain rule divides it by gamma), where the statements' derivative is finite; the parallel and chunkwise
    backward refused it. vjp now runs the statements as written for such a call in every form: each equals
    NumPy's recurrent backward, which equals a central difference."""
    rec = linrec.compile("recurrence pdecay(dk = 5, dv = 7)\ninput q[dk], k[dk], v[dv]\nparam gamma per head = 0.9\n"
                         "state S[dk, dv]\nS = gamma·S + k⊗v\noutput o = q·S\n", "pdecay.lin")
    x, up, _, _ = _call(rec, 1, 6, 2, seed=0)
    params = {"gamma": np.array([0.0, 0.5])}
    want = rec.vjp(x, up, dims=DIMS, params=params).grads["gamma"]
    for backend in ("numpy", "c"):
        for form in gradients.derived_forms(rec):
            got = rec.vjp(x, up, dims=DIMS, params=params, backend=backend, form=form).grads["gamma"]
            assert np.all(np.isfinite(got)) and np.max(np.abs(got - want)) <= 1e-12 * np.max(np.abs(want))

    def loss(g0):
        return np.sum(up["o"] * rec.run(x, dims=DIMS, params={"gamma": np.array([g0, 0.5])}).outputs["o"])
    assert abs((loss(1e-6) - loss(-1e-6)) / 2e-6 - want[0]) <= 1e-6 * abs(want[0])


# readouts before the update, two readouts of one state, a vector state beside a matrix one, a decay whose
# log is taken numerically; a state carried transposed (multiplied and read from the right)
STRUCTURES = {
    "before": """recurrence before(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], a[dk]
param gamma per head = uniform(0.5, 0.9, seed=1)
state S[dk, dv], z[dk]
output o = (q·S) / (1 + sigmoid(q)·z)
S = diag(sigmoid(a))·S + k⊗v
z = gamma*z + sigmoid(k)
output p = (2*q)·S
""",
    "transposed": """recurrence transposed(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dv, dk]
S = S·diag(exp(g)) + v⊗k
output o = S·q
""",
}


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_other_structures(name):
    rec = linrec.compile(STRUCTURES[name], f"{name}.lin")
    x, up, s0, gT = _call(rec, 2, 11, 3, seed=7)
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=4)
    assert worst_error(got.grads, want.grads) <= 1e-9
    assert worst_error(got.outputs, want.outputs) <= 1e-9


def test_checkpoint_arrays_are_reused_only_when_nobody_holds_them(recs):
    """The kernel's forward writes its checkpoints into arrays recycled between calls (grad_calls: a fresh one
    pays a page fault per page): one still held is never written again, one dropped is, and a vjp on recycled
    checkpoints gives the same gradients to the bit."""
    rng = np.random.default_rng(7)
    tokens, heads, dk, dv = 11, 2, 5, 7  # (a shape no other test uses: only this test's arrays are in the pool)

    def checkpoints(scale):
        per = lambda n: rng.standard_normal((1, tokens, heads, n))  # noqa: E731
        s0 = scale * rng.standard_normal((1, heads, dk, dv))
        _, _, ckpt = grad_kernels.adjoint_checkpoints(s0, -np.abs(per(dk)), [(per(dk), per(dv))], [(per(dk), False)],
                                                      chunk=3)
        return ckpt

    held = checkpoints(1.0)
    before = held.copy()
    other = checkpoints(2.0)
    assert not np.shares_memory(held, other)
    np.testing.assert_array_equal(held, before)  # (the second call did not write into the held array)
    dropped = weakref.ref(other)
    del other
    again = checkpoints(3.0)
    assert again is dropped()  # dropped by its caller: kept, and written again rather than a fresh allocation
    np.testing.assert_array_equal(held, before)

    rec = recs["gla"]
    x, up, s0, gT = _call(rec, 1, 9, 2, seed=3)
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    first = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=4)
    second = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=4)
    assert worst_error(first.grads, want.grads) <= 1e-9
    for name, g in first.grads.items():
        np.testing.assert_array_equal(second.grads[name], g)
