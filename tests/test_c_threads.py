"""The C recurrent kernels give the same numbers on any number of threads, and how their threads wait.

A (batch row, head) pair is computed by one thread at a time, in the same order of operations whichever
thread it is (lr_claim may move it between threads at segment ends), so the outputs and final states on two
threads must equal those on one bit for bit — in the fused kernel (GLA, gated DeltaNet, heads split between
threads at every segment end), the statement-by-statement one, and the decode step run in parts on the
helper pool or as an OpenMP loop. The thread count a call uses depends on its work (LR_THREAD_WORK: a thread per 2M multiply-adds
by default); these tests set it to 1 multiply-add so that their tiny sizes run on every thread asked for, and
check that the default runs them too (on one thread). Each result is also checked against the float64 NumPy
recurrent form (1e-10, as in test_c_backend).

When B·H is below the thread count, the fused kernel splits the value axis (c.value_split): a work item is a
(batch row, head, block of value columns), and since no sum of the kernel runs over the value axis, the split
gives the unsplit kernel's numbers bit for bit — checked here at B = H = 1, dv = 128 (float64: two parts of
eight registers), one thread unsplit against two threads split, for a diagonal decay (GLA), a scalar decay
with a delta-rule correction (gated DeltaNet), a scalar decay with a value-side input in the output
(Mamba-2) and a vector state every part holds whole (the linear transformer's normalizer). The decode step
does not split (a step of one head is microseconds: not worth a second thread).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_c_backend import DIMS, F32_RTOL, F64_RTOL, random_state, rec_for, rel_err
from test_c_statements import PROGRAMS
from test_c_token_pairs import TWO_CORRECTIONS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def linrec(cache_dir):
    import linrec
    return linrec


def _program(linrec, name):
    if name in PROGRAMS:
        return linrec.compile(PROGRAMS[name], f"{name}.lin")
    return rec_for(linrec, name)


def _prefill(rec, inputs, state0, threads):
    from linrec.c import build as c_build
    with c_build.threads(threads):
        return rec.run(inputs, form="recurrent", backend="c", initial_state=state0)


def _assert_identical(a, b, what):
    for k in a:
        assert np.array_equal(a[k], b[k]), (what, k, float(np.max(np.abs(a[k] - b[k]))))


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "cross"])
def test_prefill_identical_on_one_and_two_threads(linrec, monkeypatch, name):
    from linrec.c import fused as c_fused
    from linrec.c import kernel_source
    rec = _program(linrec, name)
    dims = {d.name: d.default for d in rec.program.dims} if name in PROGRAMS else DIMS
    batch, heads = 2, 3
    inputs = rec.random_inputs(batch=batch, tokens=97, heads=heads, dims=dims, seed=5)
    state0 = random_state(rec, batch, heads, dims, np.float64, 5)
    ref = rec.run(inputs, form="recurrent", backend="numpy", initial_state=state0)
    default = _prefill(rec, inputs, state0, 2)  # LR_THREAD_WORK as shipped: this small call on one thread
    monkeypatch.setattr(kernel_source, "THREAD_WORK", 1)
    monkeypatch.setattr(c_fused, "SEGMENT_WORK", 1)  # segments of one block …
    monkeypatch.setattr(c_fused, "SPLIT_ALWAYS", True)  # … and groups split at every segment end
    source = rec.module("recurrent", "c").source(np.float64, dims)
    assert "#define LR_THREAD_WORK ((int64_t)1)" in source
    one, two = _prefill(rec, inputs, state0, 1), _prefill(rec, inputs, state0, 2)
    for got in (one, default):
        _assert_identical(got.outputs, two.outputs, "outputs")
        _assert_identical(got.final_state, two.final_state, "final state")
    for k in ref.outputs:
        assert rel_err(two.outputs[k], ref.outputs[k]) <= F64_RTOL, k
    for k in ref.final_state:
        assert rel_err(two.final_state[k], ref.final_state[k]) <= F64_RTOL, k


@pytest.mark.parametrize("batch, heads", [(2, 8), (8, 512)])
@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "cross"])
def test_decode_step_identical_alone_and_in_parts(linrec, monkeypatch, name, batch, heads):
    """Steps on the caller's thread alone and on two threads give the same states and outputs, bit for bit:
    B·H = 16 heads on the caller alone (the default at this size) and in parts on the helper pool
    (POOL_PART_WORK = 1: as many parts as threads); 4096 heads (over 1M multiply-adds) as an OpenMP loop."""
    from linrec.c import build as c_build
    from linrec.c import fused as c_fused
    rec = _program(linrec, name)
    dims = {d.name: d.default for d in rec.program.dims} if name in PROGRAMS else DIMS
    inputs = rec.random_inputs(batch=batch, tokens=6, heads=heads, dims=dims, seed=6)
    state0 = random_state(rec, batch, heads, dims, np.float64, 6)
    ref = rec.run(inputs, form="recurrent", backend="numpy", initial_state=state0)
    results = []
    default = c_fused.POOL_PART_WORK
    runs = ((default, 2), (1, 1), (1, 2)) if heads == 8 else ((default, 1), (default, 2))
    for part_work, threads in runs:
        monkeypatch.setattr(c_fused, "POOL_PART_WORK", part_work)
        state = {k: v.copy() for k, v in state0.items()}
        outs = []
        with c_build.threads(threads):
            for t in range(6):
                token = {k: np.ascontiguousarray(v[:, t]) for k, v in inputs.items()}
                out, state = rec.step(token, state, backend="c", inplace=True)
                outs.append({k: v.copy() for k, v in out.items()})
        results.append(({k: np.stack([o[k] for o in outs], axis=1) for k in outs[0]}, state))
    for outs, state in results[1:]:
        _assert_identical(results[0][0], outs, "outputs")
        _assert_identical(results[0][1], state, "state")
    outs, state = results[-1]
    for k in ref.outputs:
        assert rel_err(outs[k], ref.outputs[k]) <= F64_RTOL, k
    for k in ref.final_state:
        assert rel_err(state[k], ref.final_state[k]) <= F64_RTOL, k


_WAIT_POLICY = """\
import os, sys
import numpy as np
import linrec
from linrec.c import build
rec = linrec.load(sys.argv[1])
rec.run(rec.random_inputs(batch=1, tokens=4, heads=1, seed=0), form="recurrent", backend="c")
print(build.openmp_wait_policy())
print(os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("given", [None, "active"])
def test_openmp_threads_sleep_unless_the_environment_says(linrec, given):
    """A fresh process: the first kernel loads the OpenMP runtime with OMP_WAIT_POLICY=passive, and the
    environment is as it was afterwards (child processes get the user's); a policy the environment sets is
    left alone and reported. The runtime's own settings (GCC's libgomp prints them under OMP_DISPLAY_ENV)
    show it took the policy: no spinning (it had been loaded before the variable was set — by
    importlib's module_from_spec, outside the part that set it — and spun 300000 rounds at every wait)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if given:
        env["OMP_WAIT_POLICY"] = given
    res = subprocess.run([sys.executable, "-c", _WAIT_POLICY, str(ROOT / "examples" / "gla.lin")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    policy, variable = res.stdout.strip().splitlines()[-2:]
    if given:
        assert policy == "as the environment sets it: OMP_WAIT_POLICY=active" and variable == "active"
    else:
        assert policy.startswith("passive (set by linrec") and variable == "None"
        if "GOMP_SPINCOUNT" in res.stderr:  # (GCC's runtime; LLVM's prints other names)
            assert "GOMP_SPINCOUNT = '0'" in res.stderr, res.stderr


# ---- the value axis split across threads (c.value_split) ------------------------------------------------
SPLIT_DIMS = {"dk": 7, "dv": 128}  # dk: an odd row count (the passes' last row); dv: two parts of whole registers


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "mamba2", "linear_transformer"])
def test_value_split_identical_to_the_whole_head(linrec, monkeypatch, name):
    """One thread on whole heads, two threads on the two parts of the value axis, and the split kernel on
    one thread (its parts one after the other, each a whole segment: a part that wrote its final states
    before the next part read the initial ones would show here)."""
    from linrec.c import build as c_build
    from linrec.c import kernel_source
    rec = linrec.load(ROOT / "examples" / f"{name}.lin")
    monkeypatch.setattr(kernel_source, "THREAD_WORK", 1)  # tiny work still pays for two threads
    inputs = rec.random_inputs(batch=1, tokens=97, heads=1, dims=SPLIT_DIMS, seed=7)
    state0 = random_state(rec, 1, 1, SPLIT_DIMS, np.float64, 7)
    module = rec.module("recurrent", "c")
    assert module.value_parts(np.float64, SPLIT_DIMS, heads=1, tokens=97, threads=1) == 1
    assert module.value_parts(np.float64, SPLIT_DIMS, heads=1, tokens=97, threads=2) == 2
    runs = {}
    for threads in (1, 2):
        with c_build.threads(threads):
            runs[threads] = rec.run(inputs, form="recurrent", backend="c", initial_state=state0, dims=SPLIT_DIMS)
    monkeypatch.setattr(module, "value_parts", lambda *args, **kwargs: 2)
    with c_build.threads(1):
        runs["split on one thread"] = rec.run(inputs, form="recurrent", backend="c", initial_state=state0,
                                              dims=SPLIT_DIMS)
    assert "#define LR_PARTS 2" in module.kernel(np.float64, SPLIT_DIMS, parts=2).source
    for split in (2, "split on one thread"):
        _assert_identical(runs[1].outputs, runs[split].outputs, ("outputs", split))
        _assert_identical(runs[1].final_state, runs[split].final_state, ("final state", split))
    ref = rec.run(inputs, form="recurrent", backend="numpy", initial_state=state0, dims=SPLIT_DIMS)
    for k in ref.outputs:
        assert rel_err(runs[2].outputs[k], ref.outputs[k]) <= F64_RTOL, k
    for k in ref.final_state:
        assert rel_err(runs[2].final_state[k], ref.final_state[k]) <= F64_RTOL, k
    assert set(state0) == set(ref.final_state)
    for k, v in state0.items():  # the caller's initial states are not written
        assert np.array_equal(v, random_state(rec, 1, 1, SPLIT_DIMS, np.float64, 7)[k]), k


@pytest.mark.parametrize("dtype, dims", [(np.float64, {"dk": 9, "dv": 32}), (np.float32, {"dk": 16, "dv": 64})])
def test_value_split_identical_with_corrections_in_pairs(linrec, monkeypatch, dtype, dims):
    """The pass over a state with corrections two tokens at a time (passes.pair_pass) under the split: three
    corrections and two write groups under a strong decay (slow tokens go alone between pairs), 97 tokens
    (a block's odd token left alone at its end), float64 and float32. Both sizes are ones where a part's
    own per-token values would have given it blocks of 16 tokens against the whole head's 64 (where a block
    starts decides which tokens pair and which p a block's first pass sums anew): a part runs the whole
    head's blocks. And the passes' multiply-adds are lr_fma, rounded once whatever the compiler's contraction
    decides: a product the slow and the lazy update shared was fused into neither in one kernel and into
    both in the other (float32, main before: 29 of 97 tokens' outputs apart in the last bit)."""
    from linrec.c import build as c_build
    rec = linrec.compile(TWO_CORRECTIONS, "two_corrections.lin")
    module = rec.module("recurrent", "c")
    inputs = {k: v.astype(dtype) if v.dtype == np.float64 else v
              for k, v in rec.random_inputs(batch=1, tokens=97, heads=1, dims=dims, seed=8, decay_scale=10.0).items()}
    state0 = {k: v.astype(dtype) for k, v in random_state(rec, 1, 1, dims, np.float64, 8).items()}
    with c_build.threads(1):
        whole = rec.run(inputs, form="recurrent", backend="c", initial_state=state0, dims=dims)
    assert "two tokens a pass" in module.kernel(dtype, dims, parts=2).source
    monkeypatch.setattr(module, "value_parts", lambda *args, **kwargs: 2)
    for threads in (1, 2):
        with c_build.threads(threads):
            split = rec.run(inputs, form="recurrent", backend="c", initial_state=state0, dims=dims)
        _assert_identical(whole.outputs, split.outputs, ("outputs", threads))
        _assert_identical(whole.final_state, split.final_state, ("final state", threads))
    ref = rec.run({k: v.astype(np.float64) for k, v in inputs.items()}, form="recurrent", backend="numpy",
                  initial_state={k: v.astype(np.float64) for k, v in state0.items()}, dims=dims)
    tol = F64_RTOL if dtype == np.float64 else F32_RTOL
    for k in ref.outputs:
        assert rel_err(split.outputs[k], ref.outputs[k]) <= tol, k
    for k in ref.final_state:
        assert rel_err(split.final_state[k], ref.final_state[k]) <= tol, k


def test_value_split_only_where_the_columns_are_independent(linrec):
    """The split is derived from the structure: a norm over the value axis (RetNet's group norm), a size of
    it, a parameter along it, an output without it, stabilized feature maps refuse it; the update kinds that
    keep the columns apart (decays of the rows, key-side corrections, writes) allow it."""
    from linrec.c import value_split
    allowed = {"gla", "gated_deltanet", "mamba2", "linear_transformer", "deltanet", "gdn2", "comba"}
    for name in allowed:
        assert value_split.value_axis(linrec.load(ROOT / "examples" / f"{name}.lin").compiled) == "dv", name
    refused = {
        "retnet": "mixes the columns",
        "performer": "stabilized",
    }
    for name, why in refused.items():
        compiled = linrec.load(ROOT / "examples" / f"{name}.lin").compiled
        assert value_split.value_axis(compiled) is None and why in value_split.split_refusal(compiled), name
    head = "recurrence r(dk = 4, dv = 8)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\nS = S + k⊗v\n"
    programs = {
        "output o = dv^(-1/2)·q·S": "mixes the columns",
        "output o = sum(q·S)": "has no value axis",
        "param w[dv] per head = randn(seed=0)\noutput o = w*(q·S)": "parameter 'w'",
        "output o = l2norm(q·S)": "mixes the columns",
        "output o = silu(q·S)*v": None,
    }
    for tail, why in programs.items():
        compiled = linrec.compile(head + tail, "r.lin").compiled
        refusal = value_split.split_refusal(compiled)
        assert (refusal is None) if why is None else (why in refusal), (tail, refusal)


def test_value_parts_follow_the_work_rule():
    """Parts only when the threads the work pays for (one per THREAD_WORK) outnumber the heads; equal parts
    of whole registers, none when there are no such parts."""
    from linrec.c.value_split import value_parts
    assert value_parts(128, 16, heads=1, threads=2, work=10 << 21, thread_work=1 << 21) == 2
    assert value_parts(128, 16, heads=1, threads=2, work=1 << 21, thread_work=1 << 21) == 1  # one thread's work
    assert value_parts(128, 16, heads=2, threads=2, work=10 << 21, thread_work=1 << 21) == 1  # a head per thread
    assert value_parts(128, 16, heads=1, threads=3, work=10 << 21, thread_work=1 << 21) == 4  # 3 ∤ 8 registers
    assert value_parts(256, 16, heads=3, threads=8, work=10 << 23, thread_work=1 << 21) == 4
    assert value_parts(16, 16, heads=1, threads=2, work=10 << 21, thread_work=1 << 21) == 1  # one register
    assert value_parts(24, 8, heads=1, threads=2, work=10 << 21, thread_work=1 << 21) == 3
