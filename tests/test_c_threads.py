"""The C recurrent kernels give the same numbers on any number of threads, and how their threads wait.

A (batch row, head) pair is computed by one thread at a time, in the same order of operations whichever
thread it is (lr_claim may move it between threads at segment ends), so the outputs and final states on two
threads must equal those on one bit for bit — in the fused kernel (GLA, gated DeltaNet, heads split between
threads at every segment end), the statement-by-statement one, and the decode step run in parts on the
helper pool or as an OpenMP loop. The thread count a call uses depends on its work (LR_THREAD_WORK: a thread per 2M multiply-adds
by default); these tests set it to 1 multiply-add so that their tiny sizes run on every thread asked for, and
check that the default runs them too (on one thread). Each result is also checked against the float64 NumPy
recurrent form (1e-10, as in test_c_backend).

Not here: a split of the value axis across threads (when B·H is below the thread count) — the kernels do not
have one (docs/benchmarks.md, "Threads").
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_c_backend import DIMS, F64_RTOL, random_state, rec_for, rel_err
from test_c_statements import PROGRAMS

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
    left alone and reported."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
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
