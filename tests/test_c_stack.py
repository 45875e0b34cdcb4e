"""The C kernels keep a token's vectors on the stack (linrec.c.stack): sizes whose arrays would overflow a
thread's stack are refused with an error naming the dimension, its size, the size that fits and the NumPy
backend — before any kernel runs (they were a SIGSEGV: a vector state z[dk] at dk = 2·10⁶ in the decode
step, Performer's features at m = 524288 in the prefill) — and a size at the limit still runs."""
from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.c import backend as c_backend
from linrec.c import stack, standalone
from linrec.dsl.errors import LinrecError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="needs a C compiler")

VECTOR_STATE = """recurrence vecstate(dk = 8)
input k[dk], q[dk]
input g[dk] <= 0
state z[dk]
z = exp(g)*z + relu(k)
output s = q·z
"""
# its decode step holds two vectors of dk values (exp(g), relu(k)): float64 fits up to this dk
AT_THE_LIMIT = stack.STACK_BUDGET // (2 * 8)


def test_a_vector_state_of_millions_is_refused_before_the_step_runs():
    rec = linrec.compile(VECTOR_STATE, "vecstate.lin")
    x = rec.random_inputs(1, 1, 1, dims={"dk": 2_000_000}, dtype=np.float32)
    said = (r"dk = 2000000 is too large for the C kernel of 'vecstate' \(float32\): it would keep 15.3 MiB of "
            r"per-token arrays on the stack of one call \(2 arrays of dk values, in lr_step_heads\), above the 1 MiB "
            r"the C kernels allow .*OMP_STACKSIZE.*; dk up to 131072 fits with the other sizes as they are\. Use the "
            r"NumPy backend \(backend='numpy'\), which runs any size, or a smaller dk")
    with pytest.raises(LinrecError, match=said):
        rec.step({k: v[:, 0].copy() for k, v in x.items()}, None, backend="c")
    with pytest.raises(LinrecError, match=said):  # (one kernel holds the prefill and the step)
        rec.run(x, backend="c", form="recurrent")


def test_performer_features_of_half_a_million_are_refused_before_the_prefill_runs():
    """The limit the message names: the largest m whose 9 arrays of m values stay within 1 MiB (29127 float32
    values, 14563 float64), less what rounding each array up to whole registers takes (the registers' width is
    the machine's: a few values either way)."""
    perf = linrec.load(EXAMPLES / "performer.lin")
    dims = {"m": 524288, "dk": 16, "dv": 4}
    x = perf.random_inputs(1, 2, 1, dims=dims, dtype=np.float32)
    given = {"W": np.zeros((524288, 16))}  # (the refusal does not need the seconds its random features take)
    with pytest.raises(LinrecError, match=r"m = 524288 is too large for the C kernel of 'performer' \(float32\): "
                                          r"it would keep 18.0 MiB .* m up to (\d+) fits .*backend='numpy'") as said:
        perf.prefill(x, dims={"m": 524288}, backend="c", params=given)
    assert 29127 - 16 <= _named_limit(said) <= 29127
    # float64: dk = 16 divides 524288 too, and is no longer within a register's lanes; m is the one to name
    with pytest.raises(LinrecError, match=r"m = 524288 is too large .*\(float64\): it would keep 36.0 MiB .*9 arrays "
                                          r"of m values.* m up to (\d+) fits") as said:
        perf.prefill({k: v.astype(np.float64) for k, v in x.items()}, dims={"m": 524288}, backend="c", params=given)
    assert 14563 - 8 <= _named_limit(said) <= 14563


def _named_limit(raised) -> int:
    return int(re.search(r"m up to (\d+) fits", str(raised.value)).group(1))


def test_the_emitted_source_and_the_standalone_export_are_refused_alike():
    rec = linrec.compile(VECTOR_STATE, "vecstate.lin")
    with pytest.raises(LinrecError, match=rf"dk = {AT_THE_LIMIT + 1} is too large .*dk up to {AT_THE_LIMIT} fits"):
        c_backend.emit_recurrent(rec.compiled, np.float64, {"dk": AT_THE_LIMIT + 1})
    c_backend.emit_recurrent(rec.compiled, np.float64, {"dk": AT_THE_LIMIT})
    # (the export holds the float32 and the float64 kernel: the float64 one is refused)
    with pytest.raises(LinrecError, match=rf"dk = {AT_THE_LIMIT + 1} is too large for the C kernel of 'vecstate' "
                                          r"\(float64\)"):
        standalone.export(rec.compiled, {"dk": AT_THE_LIMIT + 1}, heads=1)


def test_a_size_at_the_limit_runs_and_agrees_with_numpy():
    rec = linrec.compile(VECTOR_STATE, "vecstate.lin")
    dims = {"dk": AT_THE_LIMIT}
    x = rec.random_inputs(1, 3, 1, dims=dims, seed=3)
    ref = rec.run(x, backend="numpy", form="recurrent")
    got = rec.run(x, backend="c", form="recurrent")
    np.testing.assert_allclose(got.outputs["s"], ref.outputs["s"], rtol=1e-12)
    # the decode step on a thread with the smallest stack the budget allows for (2 MiB)
    results = []
    previous = threading.stack_size(2 << 20)
    try:
        thread = threading.Thread(target=lambda: results.append(
            rec.step({k: v[:, 0].copy() for k, v in x.items()}, None, backend="c")[0]))
        thread.start()
        thread.join()
    finally:
        threading.stack_size(previous)
    np.testing.assert_allclose(results[0]["s"], ref.outputs["s"][:, 0], rtol=1e-12)


def test_the_frames_are_read_from_the_declarations():
    source = """
    #define N 4
    static int g(int x) { T a[N * 2]; static T kept[1000]; return x; }
    int f(void) { T b[10], c[3] = {1, 2, 3}; const T d[2][5]; /* T e[99]; */ return g(1); }
    int h(void) { double e[7]; T *p[9]; return 0; }
    """
    frames = {f.function: f for f in stack.frames(source, "float")}
    assert frames["g"].arrays == (("a", 8, 32),)  # (static: not on the stack)
    assert frames["f"].arrays == (("b", 10, 40), ("c", 3, 12), ("d", 10, 40)) and frames["f"].calls == {"g"}
    assert frames["h"].arrays == (("e", 7, 56),)  # (an array of pointers is not a dimension's)
    worst = stack.deepest(list(frames.values()))
    assert worst.function == "f → g" and worst.bytes == 124


@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_a_state_of_millions_of_rows_is_refused_by_the_scan_kernels_too(form):
    """The parallel and chunkwise forms' kernels (and the gradients' ones, built the same way: c.scan_kernels.
    cached_kernel) keep a row of the state per token on the stack too: GLA with dk = 2·10⁶ was a SIGSEGV in
    both. Their check names the state's rows, the size they are specialized for. (It also found that a function
    declared `static __attribute__((…)) void f(` was read as one named __attribute__, and every such function
    as the first one's frame: c.stack._without_attributes.)"""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(1, 4, 1, dims={"dk": 2_000_000, "dv": 4}, dtype=np.float32)
    with pytest.raises(LinrecError, match=r"dk \(the state's rows\) = 2000000 is too large for the C scan kernel "
                                          r"\(float\): it would keep 30\.5 MiB .* in lr_prepare\), .*Use the NumPy "
                                          r"backend \(backend='numpy'\)"):
        rec.run(x, backend="c", form=form)
