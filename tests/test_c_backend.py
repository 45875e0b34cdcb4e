"""The C backend (recurrent form and decode step) against the NumPy recurrent form, and its build cache.

Tolerances, measured as max|actual − expected| / max|expected| per output and final state, against the
float64 NumPy recurrent form:
    C float64:  1e-10
    C float32:  2e-5  (≈ 160 float32 ulps; measured ≤ 5e-7 at mild and strong gates)
Every kernel is built once per test session, into a cache directory of its own (LINREC_CACHE_DIR).
"""
from __future__ import annotations

import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from compare import rel_err

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NAMES = ["gla", "retnet", "mamba2", "deltanet", "gated_deltanet", "linear_transformer"]
F64_RTOL = 1e-10
F32_RTOL = 2e-5
# dk ≠ dv, neither a multiple of the vector width; dv > one AVX-512 register of float32 so that both the
# whole-register loop and the column tail run
DIMS = {"dk": 5, "dv": 19}

MIX = """\
recurrence mix(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], c[dk]
input a
param w[dv] per head = randn(seed=3)
param m[dk] = uniform(0.5, 1, seed=4)
state S[dk, dv], z[dk]
kk = l2norm(silu(k))
S = sigmoid(a)·S − 0.5*softplus(a)·kk⊗(kk·S) + kk⊗(tanh(v)*w)
z = diag(m*exp(logsigmoid(c)))·z + relu(k) + abs(c)
output o = rmsnorm(q·S) + mean(v)*w / (1 + norm(q))
output s = ((elu(q) + 1)·z) / sum(exp(c)) + sqrt(abs(a)) − log(1 + a*a)^2
"""
NONCAUSAL = """\
recurrence enc(dk = 4, dv = 3) noncausal
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = groupnorm(q·S)
"""
# a readout before the update and one after, with a diagonal decay and a delta-rule correction (EARLY2:
# without the correction, which takes the register-tiled path)
EARLY = """\
recurrence early(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0
input beta in (0, 1)
state S[dk, dv]
output o = q·S
S = diag(exp(g))·S − beta*k⊗(k·S) + k⊗v
output p = q·S
"""
EARLY2 = EARLY.replace("early(", "early2(").replace(" − beta*k⊗(k·S)", "")
# feature maps through the register-wise helpers (lr_sigmoid_v, lr_silu_v, lr_elu_plus_one_v): in the lazy
# bookkeeping of a per-row decay (lanes), into block arrays (rows), and S's keys and queries shared with z
FEATURES = """\
recurrence features(dk = 37, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
phi(x) = elu(x) + 1
state S[dk, dv], z[dk], U[dk, dv]
S = diag(exp(g))·S + (sigmoid(k)*phi(k))⊗v
z = z + phi(k)
U = U + silu(k)⊗v
output o = (phi(q)·U) / (phi(q)·z + 1) + sigmoid(q)·S
"""
RIGHT = """\
recurrence rightdecay(dk = 4, dv = 4)
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv]
S = S·diag(exp(g)) + k⊗v
output o = q·S
"""


@pytest.fixture(scope="session")
def linrec(cache_dir):
    import linrec
    return linrec


_RECS: dict = {}


def rec_for(linrec, name):
    if name not in _RECS:
        if name == "mix":
            _RECS[name] = linrec.compile(MIX, "mix.lin")
        elif name == "enc":
            _RECS[name] = linrec.compile(NONCAUSAL, "enc.lin")
        elif name == "features":
            _RECS[name] = linrec.compile(FEATURES, "features.lin")
        elif name in ("early", "early2"):
            _RECS[name] = linrec.compile(EARLY if name == "early" else EARLY2, f"{name}.lin")
        elif name == "right":
            _RECS[name] = linrec.compile(RIGHT, "right.lin")
        else:
            _RECS[name] = linrec.load(EXAMPLES / f"{name}.lin")
    return _RECS[name]


def random_state(rec, batch, heads, dims, dtype, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for s in rec.program.states:
        shape = (batch, heads) + tuple(dims[d] for d in s.shape)
        x = rng.standard_normal(shape)
        out[s.name] = (np.abs(x) if len(s.shape) == 1 else x).astype(dtype)  # normalizers stay positive
    return out


def compare(rec, inputs, state0, dtype, rtol, params=None):
    x = {k: v.astype(dtype) for k, v in inputs.items()}
    s0 = {k: v.astype(dtype) for k, v in state0.items()}
    got = rec.run(x, form="recurrent", backend="c", initial_state=s0, params=params)
    ref = rec.run({k: v.astype(np.float64) for k, v in x.items()}, form="recurrent", backend="numpy",
                  initial_state={k: v.astype(np.float64) for k, v in s0.items()}, params=params)
    for k in ref.outputs:
        assert got.outputs[k].dtype == dtype
        assert got.outputs[k].shape == ref.outputs[k].shape
        assert rel_err(got.outputs[k], ref.outputs[k]) <= rtol, (k, rel_err(got.outputs[k], ref.outputs[k]))
    for k in ref.final_state:
        assert got.final_state[k].shape == ref.final_state[k].shape
        assert rel_err(got.final_state[k], ref.final_state[k]) <= rtol, k
    for k, v in s0.items():  # the caller's initial state is not modified
        np.testing.assert_array_equal(v, state0[k].astype(dtype))
    return got


# ---- C recurrent form = NumPy recurrent form --------------------------------------------------------
@pytest.mark.parametrize("name", NAMES + ["mix", "enc", "early", "early2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_recurrent_matches_numpy(linrec, name, dtype):
    rec = rec_for(linrec, name)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    for batch, tokens, heads, seed in [(2, 7, 3, 0), (1, 1, 2, 1), (3, 33, 1, 2)]:
        inputs = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=DIMS, seed=seed)
        compare(rec, inputs, random_state(rec, batch, heads, DIMS, np.float64, seed), dtype, rtol)


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "mamba2"])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_float32_under_mild_and_strong_gates(linrec, name, scale):
    rec = rec_for(linrec, name)
    inputs = rec.random_inputs(batch=2, tokens=40, heads=2, dims=DIMS, seed=3, decay_scale=scale)
    compare(rec, inputs, random_state(rec, 2, 2, DIMS, np.float64, 3), np.float32, F32_RTOL)


def test_user_params_and_noncontiguous_inputs(linrec):
    rec = rec_for(linrec, "mamba2")
    inputs = rec.random_inputs(batch=2, tokens=6, heads=3, dims=DIMS, seed=4)
    params = {"A": -np.linspace(0.5, 2.0, 3), "D": np.array([0.3, -1.0, 2.0])}
    # a non-contiguous view with the same values: converted, same result
    strided = {k: np.asfortranarray(v) for k, v in inputs.items()}
    a = compare(rec, strided, {}, np.float64, F64_RTOL, params=params)
    b = rec.run(inputs, form="recurrent", backend="c", params=params)
    np.testing.assert_array_equal(a.outputs["y"], b.outputs["y"])


def test_non_native_byte_order_is_a_layout(linrec):
    """Big-endian float64 ('>f8', non-native here) is float64 in another layout: converted on every form, the
    step and the slot pool, as strided arrays are (it was refused on the recurrent form and the step with 'has
    dtype >f8; pass float32 or float64', and mixed with '<f8' as two dtypes); the results equal the native
    ones. A state updated in place (inplace=True, bind_step, a slot pool) cannot be converted: refused, naming
    the array and the fix."""
    rec = rec_for(linrec, "gla")
    x = rec.random_inputs(batch=1, tokens=5, heads=2, dims={"dk": 4, "dv": 4}, seed=1)
    swapped = ">f8" if np.little_endian else "<f8"
    other = {k: v.astype(swapped) for k, v in x.items()}
    for form in ("recurrent", "auto", "parallel", "chunkwise"):
        want = rec.run(x, form=form, backend="c")
        for given in (other, {**x, "q": other["q"]}, other):  # (twice: the plan the first call cached)
            got = rec.run(given, form=form, backend="c", initial_state={"S": want.final_state["S"].astype(swapped)})
            again = rec.run(x, form=form, backend="c", initial_state={"S": want.final_state["S"]})
            np.testing.assert_allclose(got.outputs["o"], again.outputs["o"], rtol=1e-12)
    state = rec.run(x, form="recurrent", backend="c").final_state
    token, native_token = {k: v[:, 0] for k, v in other.items()}, {k: v[:, 0] for k, v in x.items()}
    for backend in ("c", "numpy"):
        o, s = rec.step(token, {k: v.astype(swapped) for k, v in state.items()}, backend=backend)
        o_ref, s_ref = rec.step(native_token, state, backend=backend)
        np.testing.assert_allclose(o["o"], o_ref["o"], rtol=1e-12)
        np.testing.assert_allclose(s["S"], s_ref["S"], rtol=1e-12)
        pool = {k: np.concatenate([v, v]) for k, v in state.items()}
        rec.step(token, pool, backend=backend, slots=np.array([1]))
        np.testing.assert_allclose(pool["S"][1:], s_ref["S"], rtol=1e-12)
        fix = f"state['S'] is {'big' if swapped[0] == '>' else 'little'}-endian ({swapped}): pass state['S'].astype('=f8')"
        with pytest.raises(linrec.RuntimeInputError, match=re.escape(fix)):
            rec.step(native_token, {k: v.astype(swapped) for k, v in state.items()}, backend=backend, inplace=True)
        with pytest.raises(linrec.RuntimeInputError, match=re.escape(fix)):
            rec.bind_step(native_token, {k: v.astype(swapped) for k, v in state.items()}, backend=backend)
        with pytest.raises(linrec.RuntimeInputError, match=re.escape(fix.replace("state[", "pool["))):
            rec.step(native_token, {k: v.astype(swapped) for k, v in pool.items()}, backend=backend,
                     slots=np.array([1]))


def test_emit_is_readable_c(linrec):
    rec = rec_for(linrec, "gated_deltanet")
    src = rec.emit("recurrent", backend="c")
    assert "int lr_forward(" in src and "int lr_step(" in src
    assert "#pragma omp" in src and "vec" in src
    assert "S = exp(g)·(I − beta·kn⊗kn)·S + beta·kn⊗v" in src  # the source program, quoted


# ---- decode: prefill then step ----------------------------------------------------------------------
def _prefills(rec, backend, batch, tokens, heads, split, seed):
    """Random inputs and initial state; the prefill of every token, and the prefill of the first `split`."""
    inputs = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=DIMS, seed=seed)
    state0 = random_state(rec, batch, heads, DIMS, np.float64, seed)
    full = rec.prefill(inputs, backend=backend, initial_state=state0)
    head = rec.prefill({k: v[:, :split] for k, v in inputs.items()}, backend=backend, initial_state=state0)
    return inputs, full, head


def _assert_matches_prefill(full, outs: dict, state: dict, split: int = 0):
    """Stepped outputs ([B, T − split, H, *] by name) and final state equal the prefill of every token."""
    for k, v in full.outputs.items():
        assert rel_err(outs[k], v[:, split:]) <= F64_RTOL, k
    for k, v in full.final_state.items():
        assert rel_err(state[k], v) <= F64_RTOL, k


@pytest.mark.parametrize("name", NAMES + ["mix", "early"])
@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_steps_chained_equal_prefill(linrec, name, backend):
    rec = rec_for(linrec, name)
    tokens, split = 9, 4
    inputs, full, head = _prefills(rec, backend, 2, tokens, 3, split, seed=5)
    state = head.final_state
    outs = {k: [v] for k, v in head.outputs.items()}
    for t in range(split, tokens):
        token = {k: v[:, t] for k, v in inputs.items()}
        before = {k: v.copy() for k, v in state.items()}
        out, new = rec.step(token, state, backend=backend)
        for k in state:  # not in place: the previous state is untouched
            np.testing.assert_array_equal(state[k], before[k])
        state = new
        for k, v in out.items():
            outs[k].append(v[:, None])
    _assert_matches_prefill(full, {k: np.concatenate(v, axis=1) for k, v in outs.items()}, state)


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_steps_in_place_float32(linrec, backend):
    rec = rec_for(linrec, "gated_deltanet")
    inputs = rec.random_inputs(batch=1, tokens=12, heads=4, dims=DIMS, dtype=np.float32, seed=6)
    full = rec.prefill(inputs, backend=backend)
    state = {"S": np.zeros((1, 4, DIMS["dk"], DIMS["dv"]), np.float32)}
    token = {k: np.empty(v.shape[:1] + v.shape[2:], np.float32) for k, v in inputs.items()}  # reused buffers
    buffers = {"o": np.empty((1, 4, DIMS["dv"]), np.float32)}
    outs = []
    for t in range(12):
        for k, v in inputs.items():
            token[k][...] = v[:, t]
        # every array the same object each call: the C backend's fastest path (from the 2nd call on)
        out, new = rec.step(token, state, backend=backend, inplace=True, out=buffers if t % 2 else None)
        assert new["S"] is state["S"]
        outs.append(out["o"].copy())
    assert rel_err(np.stack(outs, axis=1), full.outputs["o"]) <= F32_RTOL
    assert rel_err(state["S"], full.final_state["S"]) <= F32_RTOL


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "mix", "early"])
@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_bound_step_equals_prefill(linrec, name, backend):
    """bind_step: every array checked once, then one call per token on the refilled token buffers."""
    rec = rec_for(linrec, name)
    tokens, split = 11, 3
    inputs, full, head = _prefills(rec, backend, 2, tokens, 5, split, seed=12)
    state = head.final_state
    token = {k: np.empty(v.shape[:1] + v.shape[2:]) for k, v in inputs.items()}
    for k, v in inputs.items():
        token[k][...] = v[:, split]  # the bind checks these values' ranges once
    step = rec.bind_step(token, state, backend=backend)
    outs = []
    for t in range(split, tokens):
        for k, v in inputs.items():
            token[k][...] = v[:, t]
        outs.append({k: v.copy() for k, v in step().items()})
    _assert_matches_prefill(full, {k: np.stack([o[k] for o in outs], axis=1) for k in outs[0]}, state, split)


def test_refilled_token_out_of_range_is_an_error_and_changes_nothing(linrec):
    """The decode loop's token buffers are refilled in place, so Python sees no new array: the C step tests
    the declared ranges itself, before it touches a state."""
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "gated_deltanet")
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in
             rec.random_inputs(batch=1, tokens=1, heads=4, dims=DIMS, seed=13).items()}
    state = {"S": np.ones((1, 4, DIMS["dk"], DIMS["dv"]))}
    out = {"o": np.empty((1, 4, DIMS["dv"]))}
    rec.step(token, state, backend="c", inplace=True, out=out)
    rec.step(token, state, backend="c", inplace=True, out=out)  # the fast path from here on
    step = rec.bind_step(token, state, backend="c")
    before = state["S"].copy()
    token["beta"][0, 2] = 1.5
    with pytest.raises(RuntimeInputError, match=r"'beta' must lie in \(0, 1\).*found 1.5"):
        rec.step(token, state, backend="c", inplace=True, out=out)
    with pytest.raises(RuntimeInputError, match="'beta' must lie in"):
        step()
    np.testing.assert_array_equal(state["S"], before)
    token["beta"][0, 2] = 0.5
    step()
    assert not np.array_equal(state["S"], before)


def test_bind_step_rejects_what_it_cannot_bind(linrec):
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "gla")
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in
             rec.random_inputs(batch=1, tokens=1, heads=2, dims=DIMS, seed=14).items()}
    state = {"S": np.zeros((1, 2, DIMS["dk"], DIMS["dv"]))}
    with pytest.raises(RuntimeInputError, match="state arrays in place"):
        rec.bind_step(token, None, backend="c")
    # (a token buffer in another layout is read every call: test_reliability's …_of_any_layout_every_call)
    with pytest.raises(RuntimeInputError, match="C-contiguous"):
        rec.bind_step(token, {"S": state["S"].astype(np.float32)}, backend="c")
    soft = linrec.load(EXAMPLES / "softmax.lin")
    tok = {k: v[:, 0] for k, v in soft.random_inputs(batch=1, tokens=1, heads=1, dims=DIMS).items()}
    with pytest.raises(RuntimeInputError, match="KV cache"):
        soft.bind_step(tok, {"k": tok["k"]}, backend="c")


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_an_output_sharing_memory_with_the_state_a_token_or_an_output_is_refused(linrec, backend, inplace):
    """An `out` array of the right shape, dtype and strides that overlaps a state, a token input or another
    output would be written over what the step reads or updates (a wrong state and output, silently): refused
    before anything is written, by step (after the C step's fast path too) and bind_step, naming both arrays."""
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "early")  # two outputs, o and p, both [B, H, dv] like the token's v
    inputs = rec.random_inputs(batch=2, tokens=3, heads=3, dims=DIMS, seed=21)
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in inputs.items()}
    state = {"S": np.ascontiguousarray(random_state(rec, 2, 3, DIMS, np.float64, 22)["S"])}
    shape = (2, 3, DIMS["dv"])
    n = int(np.prod(shape))
    good = {"o": np.empty(shape), "p": np.empty(shape)}
    rec.step(token, state, backend=backend, inplace=True, out=good)
    rec.step(token, state, backend=backend, inplace=True, out=good)  # (C: the fast path from here on)
    shared = np.empty(n + 1)
    cases = [({"o": state["S"].reshape(-1)[:n].reshape(shape), "p": good["p"]}, "out['o'] shares memory with state 'S'"),
             ({"o": good["o"], "p": token["v"]}, "out['p'] shares memory with input 'v'"),
             ({"o": shared[:n].reshape(shape), "p": shared[1:].reshape(shape)}, "out['p'] shares memory with out['o']"),
             ({"o": good["o"], "p": good["o"]}, "out['p'] shares memory with out['o']")]
    before, tokens_before = state["S"].copy(), {k: v.copy() for k, v in token.items()}
    for out, message in cases:
        assert all(a.flags.c_contiguous and a.flags.writeable for a in out.values())
        with pytest.raises(RuntimeInputError, match=re.escape(message) + ".*pass a separate array for out"):
            rec.step(token, state, backend=backend, inplace=inplace, out=out)
        with pytest.raises(RuntimeInputError, match=re.escape(message)):
            rec.bind_step(token, state, backend=backend, out=out)
        np.testing.assert_array_equal(state["S"], before)
        for k, v in tokens_before.items():
            np.testing.assert_array_equal(token[k], v)
    out, new = rec.step(token, state, backend=backend, inplace=inplace, out=good)  # separate arrays: fine
    assert out["o"] is good["o"]


def _chained_steps(rec, inputs, split, state, dtype=np.float64):
    """Steps split … T−1 in place, in the decode loop's way (token buffers refilled, outputs reused): the
    outputs [B, T − split, H, *] and the final state."""
    token = {k: np.empty(v.shape[:1] + v.shape[2:], dtype) for k, v in inputs.items()}
    buffers = None
    outs = []
    for t in range(split, next(iter(inputs.values())).shape[1]):
        for k, v in inputs.items():
            token[k][...] = v[:, t]
        out, state = rec.step(token, state, backend="c", inplace=True, out=buffers)
        buffers = out
        outs.append({k: v.copy() for k, v in out.items()})
    return {k: np.stack([o[k] for o in outs], axis=1) for k in outs[0]}, state


# (B, H): enough heads that the step is split between the caller and a helper thread, or so many that it
# runs as an OpenMP loop
@pytest.mark.parametrize("batch, heads", [(4, 32), (8, 512)])
@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "mix", "early"])
def test_steps_on_threads_equal_prefill(linrec, monkeypatch, name, batch, heads):
    from linrec.c import fused as c_fused
    monkeypatch.setenv("LINREC_NUM_THREADS", "2")
    monkeypatch.setattr(c_fused, "POOL_PART_WORK", 16384)  # (4, 32): a step of 2 parts at these tiny sizes
    rec = rec_for(linrec, name)
    inputs, full, head = _prefills(rec, "c", batch, 7, heads, 2, seed=8)
    outs, state = _chained_steps(rec, inputs, 2, head.final_state)
    _assert_matches_prefill(full, outs, state, split=2)


_FORKED_STEPS = """\
import os, sys
import numpy as np
sys.path[:0] = [{tests!r}]
os.environ["LINREC_NUM_THREADS"] = "2"
import linrec
from linrec.c import fused
from test_c_backend import DIMS, _chained_steps, rel_err
fused.POOL_PART_WORK = 16384  # a step of 2 parts (a helper thread) at these tiny sizes
rec = linrec.load({path!r})
inputs = rec.random_inputs(batch=4, tokens=9, heads=32, dims=DIMS, seed=9)
full = rec.prefill(inputs, backend="c")


def steps():
    outs, state = _chained_steps(rec, inputs, 0, {{"S": np.zeros((4, 32, DIMS["dk"], DIMS["dv"]))}})
    return rel_err(outs["o"], full.outputs["o"]) <= 1e-10 and rel_err(state["S"], full.final_state["S"]) <= 1e-10


assert steps()  # this process's helper thread now waits for the next step
pid = os.fork()
if pid == 0:  # the child has no helper: it starts its own
    os._exit(0 if steps() else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert steps()
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_step_threads_survive_fork_and_exit(linrec):
    """A process forked after steps on helper threads steps on its own, and both exit (helpers waiting)."""
    code = _FORKED_STEPS.format(tests=str(ROOT / "tests"), path=str(EXAMPLES / "gated_deltanet.lin"))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_step_rejects_bad_arrays(linrec):
    from linrec.dsl.errors import LinrecError, RuntimeInputError
    rec = rec_for(linrec, "gla")
    token = {k: v[:, 0] for k, v in rec.random_inputs(batch=2, tokens=1, heads=3, dims=DIMS).items()}
    state = {"S": np.zeros((2, 3, 5, 19))}
    rec.step(token, state, backend="c")
    with pytest.raises(RuntimeInputError):
        rec.step({**token, "v": token["v"][:, :, :4]}, state, backend="c")
    with pytest.raises(RuntimeInputError):
        rec.step({**token, "q": token["q"].astype(np.float32)}, state, backend="c")
    with pytest.raises(RuntimeInputError):
        rec.step(token, {"S": np.zeros((2, 3, 5, 4))}, backend="c")
    with pytest.raises(RuntimeInputError):  # in place needs the exact array
        rec.step(token, {"S": np.zeros((2, 3, 5, 19), np.float32)}, backend="c", inplace=True)
    with pytest.raises(LinrecError, match="non-causal"):
        enc = rec_for(linrec, "enc")
        tok = {k: v[:, 0] for k, v in enc.random_inputs(batch=1, tokens=1, heads=1, dims=DIMS).items()}
        enc.step(tok, None, backend="c")


# ---- boundary checks --------------------------------------------------------------------------------
def test_wrong_shapes_and_dtypes(linrec):
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "gla")
    inputs = rec.random_inputs(batch=2, tokens=5, heads=3, dims=DIMS)
    with pytest.raises(RuntimeInputError):
        rec.run({**inputs, "q": inputs["q"].astype(np.int64)}, form="recurrent", backend="c")
    with pytest.raises(RuntimeInputError):
        rec.run({**inputs, "q": inputs["q"].astype(np.float32)}, form="recurrent", backend="c")
    with pytest.raises(RuntimeInputError):
        rec.run({**inputs, "v": inputs["v"][:, :4]}, form="recurrent", backend="c")
    with pytest.raises(RuntimeInputError):
        rec.run(inputs, form="recurrent", backend="c", initial_state={"S": np.zeros((2, 3, 19, 5))})
    # the module itself checks too (it is callable without the API's checks)
    mod = rec.module("recurrent", "c")
    with pytest.raises(RuntimeInputError):
        mod.forward({**inputs, "g": inputs["g"][..., :3]}, {}, {}, DIMS)
    with pytest.raises(RuntimeInputError):
        mod.forward({**inputs, "k": inputs["k"].astype(np.float32)}, {}, {}, DIMS)
    with pytest.raises(RuntimeInputError):
        mod.forward(inputs, {}, {"S": np.zeros((2, 3, 5, 19), np.int32)}, DIMS)


@pytest.mark.parametrize("name, bad", [("gla", ("g", 0.5)), ("gla", ("g", np.nan)),
                                       ("gated_deltanet", ("beta", 1.0)), ("gated_deltanet", ("beta", -0.2))])
def test_declared_ranges_are_checked_by_the_kernel(linrec, name, bad):
    """lr_forward tests the declared ranges as it reads (run() skips its own scan for it); a value outside
    is reported with the input, the range and the index, exactly as the NumPy backend reports it."""
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, name)
    inputs = rec.random_inputs(batch=2, tokens=37, heads=3, dims=DIMS)
    arr, value = inputs[bad[0]], bad[1]
    where = (1, 29, 2) + (0,) * (arr.ndim - 3)
    arr[where] = value
    messages = []
    for backend in ("c", "numpy"):
        with pytest.raises(RuntimeInputError) as err:
            rec.run(inputs, form="recurrent", backend=backend)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert f"input '{bad[0]}'" in messages[0] and str(list(where)) in messages[0]


def test_output_arrays_are_recycled_only_when_nobody_holds_them(linrec):
    rec = rec_for(linrec, "gla")
    inputs = rec.random_inputs(batch=1, tokens=40, heads=2, dims=DIMS, dtype=np.float32)
    first = rec.run(inputs, form="recurrent", backend="c").outputs["o"]
    expected = first.copy()
    held = rec.run(inputs, form="recurrent", backend="c")  # a Result still referenced …
    view = rec.run(inputs, form="recurrent", backend="c").outputs["o"][0, 3]  # … and a view of another
    view_before = view.copy()
    addresses = set()
    for _ in range(3):
        again = rec.run(inputs, form="recurrent", backend="c").outputs["o"]
        addresses.add(again.ctypes.data)
        assert not np.shares_memory(again, first) and not np.shares_memory(again, held.outputs["o"])
        assert not np.shares_memory(again, view)
        assert again.ctypes.data % 64 == 0  # whole cache lines for the streamed rows
        np.testing.assert_array_equal(again, expected)
    np.testing.assert_array_equal(view, view_before)
    del again
    reused = rec.run(inputs, form="recurrent", backend="c").outputs["o"]
    assert reused.ctypes.data in addresses  # nobody held those: one is written again, not a fresh allocation
    np.testing.assert_array_equal(reused, expected)


def test_value_axis_decay_runs_statement_by_statement(linrec):
    """A decay of the value axis (S·diag(d)) is no fused kernel's: on C its statements run one by one
    (c_statements); its parallel and chunkwise forms run C's elementwise-decay kernels (a decay per column is
    one per element), and agree with NumPy's."""
    rec = rec_for(linrec, "right")
    assert "statement by statement" in rec.emit("recurrent", backend="c")
    inputs = rec.random_inputs(batch=2, tokens=9, heads=2, seed=1)
    got = compare(rec, inputs, {}, np.float64, F64_RTOL)
    for backend in ("numpy", "c"):
        chunked = rec.run(inputs, form="chunkwise", backend=backend, chunk_size=4)
        assert rel_err(chunked.outputs["o"], got.outputs["o"]) <= F64_RTOL
    # form="auto" on C: no fused recurrent kernel and off the measured table, so it times the recurrent and
    # chunkwise forms and takes the faster (the reason lists them, fastest first)
    longer = rec.random_inputs(batch=1, tokens=40, heads=2, seed=2)
    form, reason = rec.choose_form("c", 40)
    timed = re.match(r"measured on \d+ tokens \((\w+) [\d.]+ µs/token, (\w+) [\d.]+ µs/token\)", reason)
    assert timed, reason
    assert form == timed.group(1) and {timed.group(1), timed.group(2)} == {"recurrent", "chunkwise"}
    assert rel_err(rec.run(longer, backend="c").outputs["o"], rec.run(longer, form="recurrent").outputs["o"]) \
        <= F64_RTOL


def test_no_compiler_is_a_clear_error(linrec, monkeypatch):
    from linrec.c import build as c_build
    from linrec.dsl.errors import LinrecError
    monkeypatch.setenv("CC", "/nonexistent/linrec-no-such-cc")
    with pytest.raises(LinrecError, match="no C compiler.*NumPy backend"):
        c_build.build("int f(void) { return 1; }", "int f(void);", "nocc")


def test_a_kernel_is_built_beside_its_glue_and_linked(linrec):
    """The kernel and cffi's glue compile as two objects at once, then link: the extension calls the kernel,
    exports none of the kernel's symbols, and its cache entry keeps the sources but no objects; a compiler
    error in the kernel is a LinrecError with the compiler's message."""
    from linrec.c import build as c_build
    from linrec.dsl.errors import LinrecError
    source = "#include <stdint.h>\nint64_t lr_twice(int64_t x) { return 2 * x + LR_ONE; }\n"
    module = c_build.build("#define LR_ONE 1\n" + source, "int64_t lr_twice(int64_t x);", "glue_test")
    assert module.lib.lr_twice(20) == 41
    entry = Path(module.__file__).parent
    assert {p.suffix for p in entry.iterdir() if p.is_file()} >= {".c", ".so"}
    assert not list(entry.glob("*.o"))
    if shutil.which("nm"):
        exported = subprocess.run(["nm", "-D", "--defined-only", module.__file__], capture_output=True,
                                  text=True, check=True).stdout
        assert "PyInit_" in exported and "lr_twice" not in exported
    with pytest.raises(LinrecError, match=r"building the C kernel failed(.|\n)*LR_ONE(.|\n)*NumPy backend"):
        c_build.build(source, "int64_t lr_twice(int64_t x);", "glue_test_broken")


# ---- what the build produced ------------------------------------------------------------------------
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("objdump"),
                    reason="needs x86-64 and objdump")
def test_kernels_use_vector_instructions(linrec):
    from linrec.c import build as c_build
    rec = rec_for(linrec, "gla")
    kernel = rec.module("recurrent", "c").kernel(np.float32, DIMS)
    so = Path(kernel.module.__file__)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                         check=True).stdout
    width = c_build.vector_bytes()
    register = {64: "%zmm", 32: "%ymm"}.get(width, "%xmm")
    fma = [line for line in asm.splitlines() if "vfmadd" in line and register in line]
    assert fma, f"no {register} FMA instructions in {so.name}"


# ---- the cache -------------------------------------------------------------------------------------
_CACHE_PROGRAM = """\
recurrence cachetest(dk = 3, dv = 9)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
"""


def _build_in_child(args):
    cache, tag = args
    os.environ["LINREC_CACHE_DIR"] = cache
    import linrec
    rec = linrec.compile(_CACHE_PROGRAM.replace("cachetest", tag))
    x = rec.random_inputs(batch=1, tokens=4, heads=2, dims={"dk": 3, "dv": 9})
    res = rec.run(x, form="recurrent", backend="c")
    return float(np.abs(res.outputs["o"]).sum())


def test_two_processes_build_the_same_kernel(tmp_path):
    cache = tmp_path / "shared-cache"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_build_in_child, [(str(cache), "concurrent")] * 2)
    assert results[0] == results[1] > 0
    entries = [p for p in cache.iterdir() if len(p.name) == 64]
    assert len(entries) == 1  # one float64 kernel, built by whichever process got there first
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def _run_child(cache: Path, tag: str) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from test_c_backend import _build_in_child; "
            f"print(_build_in_child(({str(cache)!r}, {tag!r})))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_corrupted_entry_is_rebuilt(tmp_path):
    from linrec.c import build as c_build
    cache = tmp_path / "cache"
    first = _run_child(cache, "corrupt")
    assert first.returncode == 0, first.stderr
    (entry,) = [p for p in cache.iterdir() if len(p.name) == 64]
    (so,) = [p for p in entry.iterdir() if p.name.endswith(c_build._ext_suffix())]
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])  # truncated
    second = _run_child(cache, "corrupt")
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert so.stat().st_size > 0 and c_build._valid(entry, so.name[: -len(c_build._ext_suffix())])


def test_cache_info_and_clear(tmp_path, monkeypatch):
    from linrec.c import build as c_build
    monkeypatch.setenv("LINREC_CACHE_DIR", str(tmp_path / "c"))
    assert c_build.cache_info() == {"dir": str(tmp_path / "c"), "entries": 0, "bytes": 0}
    c_build.build("int lr_one(void) { return 1; }", "int lr_one(void);", "one")
    info = c_build.cache_info()
    assert info["entries"] == 1 and info["bytes"] > 1000
    assert c_build.cache_clear()["removed"] == 1
    assert c_build.cache_info()["entries"] == 0


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "retnet", "mix", "early", "early2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_long_sequences_with_strong_decay(linrec, name, dtype):
    """Long enough for the lazily applied decay to be rescaled many times (and not at all for retnet's
    mild constant decay within float32's threshold)."""
    rec = rec_for(linrec, name)
    inputs = rec.random_inputs(batch=1, tokens=300, heads=2, dims=DIMS, seed=7, decay_scale=10.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 1, 2, DIMS, np.float64, 7), dtype, rtol)


# dk: whole SIMD registers (16 float32 lanes, 8 float64) and a tail; dv: whole registers, so that an output
# that is a readout as it is goes straight from the last tile of rows to its row (gla: that tile is the
# last of the tile loop; early2: the tail tile of 2 rows)
WIDE = {"gla": {"dk": 20, "dv": 32}, "early2": {"dk": 22, "dv": 32}}


@pytest.mark.parametrize("name", ["gla", "early2"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_whole_registers_with_strong_decay(linrec, name, dtype):
    """Phase 1 over whole registers and a tail (exp, the lazy decay's bookkeeping and factors) and the
    outputs streamed by the last tile of rows, over a sequence that rescales the lazy decay many times."""
    rec = rec_for(linrec, name)
    dims = WIDE[name]
    assert "the finished output row, streamed" in rec.module("recurrent", "c").source(dtype, dims)
    inputs = rec.random_inputs(batch=2, tokens=300, heads=3, dims=dims, seed=5, decay_scale=10.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 2, 3, dims, np.float64, 5), dtype, rtol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_prefetches_paced_over_the_tile_loop(linrec, dtype):
    """dk = 72: nine or more tiles of rows, so the tile loop issues a row of the next block every few steps
    (a counter), and a sequence of 150 tokens ends in a partial block (whose rows go when the passes end)."""
    rec = rec_for(linrec, "gla")
    dims = {"dk": 72, "dv": 32}
    assert "if (++pf_tick == " in rec.module("recurrent", "c").source(dtype, dims)
    inputs = rec.random_inputs(batch=1, tokens=150, heads=3, dims=dims, seed=8, decay_scale=3.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 1, 3, dims, np.float64, 8), dtype, rtol)


# two matrix states, each decayed lazily: two tiled passes (each paced on its own) and two rescales at the
# end of a pass
TWO_LAZY = """\
recurrence two_lazy(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
state R[dk, dv]
S = diag(exp(g))·S + k⊗v
R = diag(exp(2*g))·R + q⊗v
output o = q·S + k·R
"""


@pytest.mark.parametrize("dims", [{"dk": 5, "dv": 19}, {"dk": 72, "dv": 32}], ids=["small", "paced"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_two_lazily_decayed_states(linrec, dims, dtype):
    rec = linrec.compile(TWO_LAZY, "two_lazy.lin")
    inputs = rec.random_inputs(batch=1, tokens=150, heads=2, dims=dims, seed=9, decay_scale=10.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 1, 2, dims, np.float64, 9), dtype, rtol)


# a per-row decay and the vectors that meet Ŝ built from a per-head parameter, a subexpression they share,
# a scalar input and constants: the lazy bookkeeping computes them a register at a time (c_printer.lanes)
LANES = """\
recurrence lanes(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0, a
param m[dk] per head = uniform(0.5, 1, seed=2)
state S[dk, dv]
S = diag(exp(g*m))·S + ((a/2)*k)⊗v
output o = (q - g*m)·S
"""
# … and with vectors that have no register-wise form (computed into a local row first)
LANES_ROWS = """\
recurrence lanes_rows(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + l2norm(k)⊗v
output o = sigmoid(q)·S
"""


@pytest.mark.parametrize("program", [LANES, LANES_ROWS])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lazy_decay_computed_in_registers(linrec, program, dtype):
    from linrec.c import backend as c_backend
    rec = linrec.compile(program, "lanes.lin")
    dims = WIDE["early2"]
    source = c_backend.emit_recurrent(rec.compiled, dtype, dims)
    assert "lr_exp_v(" in source and "T mx_" not in source  # not through arrays of factors
    inputs = rec.random_inputs(batch=2, tokens=200, heads=3, dims=dims, seed=4, decay_scale=10.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 2, 3, dims, np.float64, 4), dtype, rtol)


@pytest.mark.parametrize("index", [3, 18])  # in a whole register, in the tail
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_range_checked_in_whole_registers_and_tail(linrec, index, dtype):
    from linrec.dsl.errors import RuntimeInputError
    rec = rec_for(linrec, "gla")
    inputs = rec.random_inputs(batch=1, tokens=50, heads=2, dims=WIDE["gla"], seed=6, dtype=dtype)
    inputs["g"][0, 41, 1, index] = 0.25
    with pytest.raises(RuntimeInputError, match=rf"input 'g'.*\[0, 41, 1, {index}\]"):
        rec.run(inputs, form="recurrent", backend="c")


def test_growing_and_negative_decays(linrec):
    """A "decay" above 1 or below 0 is legal: the lazily applied scale is rescaled, results stay exact."""
    src = """\
recurrence grow(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a
state S[dk, dv]
S = a·S + k⊗v
output o = q·S
"""
    rec = linrec.compile(src, "grow.lin")
    x = rec.random_inputs(batch=1, tokens=400, heads=2, dims=DIMS, seed=8)
    x["a"] = np.where(np.arange(400) % 7 == 0, -0.9, 1.06)[None, :, None] * np.ones((1, 400, 2))
    compare(rec, x, {}, np.float64, F64_RTOL)


@pytest.mark.parametrize("target", ["portable", "avx2"])
def test_other_targets(linrec, monkeypatch, target):
    """The same kernels built for narrower vector registers (the fallback on other CPUs)."""
    from linrec.c import backend as c_backend
    from linrec.c import build as c_build
    if target == "avx2" and "avx2" not in c_build._cpu_flags():
        pytest.skip("needs AVX2")
    if target == "avx2" and c_build.vector_bytes() == 32:  # (a build each: the suite's time is its builds)
        pytest.skip("the native kernels are AVX2's already: 32-byte registers")
    monkeypatch.setenv("LINREC_C_TARGET", target)
    for name in ("gated_deltanet", "early2", "gla", "right"):  # (right: statement by statement, c_statements)
        rec = rec_for(linrec, name)
        mod = c_backend.CRecurrent(rec.compiled)  # a fresh module: kernels are keyed by target
        inputs = rec.random_inputs(batch=2, tokens=20, heads=2, dims=DIMS, seed=9, dtype=np.float32)
        got, _ = mod.forward(inputs, {}, {}, DIMS)
        ref = rec.run({k: v.astype(np.float64) for k, v in inputs.items()}, form="recurrent", backend="numpy")
        for k in ref.outputs:
            assert rel_err(got[k], ref.outputs[k]) <= F32_RTOL


def test_thread_count_argument_gives_the_same_result():
    import linrec
    rec = linrec.load(Path(__file__).resolve().parent.parent / "examples" / "gla.lin")
    x = rec.random_inputs(2, 40, 3, dims={"dk": 8, "dv": 8}, seed=3)
    one = rec.run(x, backend="c", form="recurrent", threads=1).outputs["o"]
    two = rec.run(x, backend="c", form="recurrent", threads=2).outputs["o"]
    assert np.max(np.abs(one - two)) < 1e-12
    with pytest.raises(linrec.LinrecError, match="thread count"):
        rec.run(x, backend="c", threads=0)


def test_thread_count_of_an_enclosing_block_holds(monkeypatch):
    """run(threads=None) inside c_build.threads(n) runs on n threads (the bench sets its count that way)."""
    from linrec.c import build as c_build
    monkeypatch.setenv("LINREC_NUM_THREADS", "2")
    seen = []
    with c_build.threads(1):
        with c_build.threads(None):
            seen.append(c_build.num_threads())
        seen.append(c_build.num_threads())
    with c_build.threads(None):
        seen.append(c_build.num_threads())
    assert seen == [1, 1, 2]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "enc", "performer"])
def test_heads_taken_in_turns_by_threads(linrec, monkeypatch, name, split):
    """Threads claim groups of heads segment by segment (lr_claim), so a head's state moves between
    threads mid-sequence; with segments of one block (SEGMENT_WORK = 1) every block boundary is a segment
    boundary. A group holds a thread's share of the heads, at most a batch row: 4 batch rows of 2 heads
    make 4 groups, more than the threads; 2 rows of 5 heads make groups of 5 (2 threads) or of 4 that
    straddle two rows (3 threads). split: every segment end splits a group in two (lr_release), down to
    single heads, as when a slow thread sheds heads to a fast one. A non-causal program makes two passes
    per head; Performer's running maximum (c_stabilize) moves with its head. Against NumPy float64."""
    from linrec.c import backend as c_backend
    from linrec.c import build as c_build
    from linrec.c import fused as c_fused
    from linrec.c import kernel_source
    monkeypatch.setattr(c_fused, "SEGMENT_WORK", 1)
    monkeypatch.setattr(kernel_source, "THREAD_WORK", 1)  # every thread asked for, at these tiny sizes
    monkeypatch.setattr(c_fused, "SPLIT_ALWAYS", split)
    rec = rec_for(linrec, name)
    mod = c_backend.CRecurrent(rec.compiled)
    dims = DIMS | ({"m": 12} if name == "performer" else {})
    source = mod.source(np.float64, dims)
    assert re.search(r"#define LR_SEGMENT (\d+)", source)[1] == re.search(r"#define LR_BLOCK (\d+)", source)[1]
    assert re.search(r"#define LR_SPLIT_ALWAYS (\d)", source)[1] == str(int(split))
    for batch, heads in ((4, 2), (2, 5)):
        inputs = rec.random_inputs(batch=batch, tokens=203, heads=heads, dims=dims, seed=11)
        state0 = random_state(rec, batch, heads, dims, np.float64, 11)
        params = rec.default_params(heads, dims)
        ref = rec.run(inputs, form="recurrent", backend="numpy", initial_state=state0, params=params)
        for threads in (1, 2, 3) if split else (2, 3):
            with c_build.threads(threads):
                got, final = mod.forward(inputs, params, state0, dims)
            for k in ref.outputs:
                assert rel_err(got[k], ref.outputs[k]) <= F64_RTOL, (batch, heads, threads, k)
            for k in ref.final_state:
                assert rel_err(final[k], ref.final_state[k]) <= F64_RTOL, (batch, heads, threads, k)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_feature_maps_on_whole_registers(linrec, dtype):
    """sigmoid, silu and elu(x) + 1 computed a register at a time (and their scalar forms on the tail:
    dk = 37 is 2 registers of floats and 4 of doubles, plus 5), in the lazy bookkeeping of a per-row decay
    and into block arrays, the keys and queries of U and z shared: the run and chained steps against NumPy."""
    rec = rec_for(linrec, "features")
    dims = {"dk": 37, "dv": 5}
    source = rec.module("recurrent", "c").source(dtype, dims)
    assert "lr_elu_plus_one_row(" in source and "lr_sigmoid_v(" in source and "lr_silu_row(" in source
    inputs = rec.random_inputs(batch=2, tokens=45, heads=2, dims=dims, seed=8)
    state0 = random_state(rec, 2, 2, dims, np.float64, 8)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    got = compare(rec, inputs, state0, dtype, rtol)
    state = {k: v.astype(dtype) for k, v in state0.items()}
    for t in range(45):
        out, state = rec.step({k: v[:, t].astype(dtype) for k, v in inputs.items()}, state, backend="c")
        assert rel_err(out["o"], got.outputs["o"][:, t]) <= rtol, t
