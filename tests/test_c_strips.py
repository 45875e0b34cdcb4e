"""The fused kernel's pass token after token (a state with rank-one corrections: the delta rules) strip by
strip of columns, each strip a contiguous copy that stays in L1 for a block of 64 tokens
(passes.strip_registers, templates/c_fused.c.j2 `token_pass`), against the float64 NumPy recurrent form.

dk = 128 rows take strips of two registers (32 float32 columns, 16 float64, with 64-byte registers; half
that with 32-byte ones), so dv = 128 and dv = 64 run in several strips; 150 tokens cross two block ends and
end in a partial block; strong decays make tokens slow (the decay applied to the strip's rows) as the lazy
scale leaves its range. Tolerances as in test_c_backend.py: 1e-10 (float64), 2e-5 (float32). Three kernels
are built, one per case (the snapshots' test shares the first's).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_c_backend import F32_RTOL, F64_RTOL, compare, random_state, rel_err

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# gated DeltaNet: a scalar decay; gdn2: a decay per key channel and gates on both sides of the correction
CASES = [("gated_deltanet", {"dk": 128, "dv": 128}, np.float64), ("gdn2", {"dk": 128, "dv": 64}, np.float32)]


@pytest.fixture(scope="module")
def linrec(cache_dir):
    import linrec
    return linrec


@pytest.mark.parametrize("name,dims,dtype", CASES, ids=[c[0] for c in CASES])
def test_strips_match_the_recurrent_form(linrec, name, dims, dtype):
    rec = linrec.load(EXAMPLES / f"{name}.lin")
    source = rec.module("recurrent", "c").source(dtype, dims)
    assert "for (int js = 0; js < 128;" in source or "for (int js = 0; js < 64;" in source
    assert "T strip_st_S[" in source  # narrower than the state: the strips run on a contiguous copy
    inputs = rec.random_inputs(batch=1, tokens=150, heads=2, dims=dims, seed=11, decay_scale=10.0)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    compare(rec, inputs, random_state(rec, 1, 2, dims, np.float64, 11), dtype, rtol)


def test_strips_too_tall_to_copy_run_in_place(linrec):
    """Rows of a float64 strip of two registers (16 columns with 64-byte registers, 8 with 32-byte ones) that
    take more than STRIP_COPY_BYTES (dk = 520 and 1032): the strips run on the state's own rows, 32 columns
    apart."""
    from linrec.c import build as c_build
    from linrec.c.passes import STRIP_COPY_BYTES
    rec = linrec.load(EXAMPLES / "gated_deltanet.lin")
    width = 2 * c_build.vector_bytes() // 8  # (float64 columns of a strip)
    dims = {"dk": STRIP_COPY_BYTES // (width * 8) + 8, "dv": 32}
    source = rec.module("recurrent", "c").source(np.float64, dims)
    assert f"for (int js = 0; js < 32; js += {width})" in source
    assert "strip_st_S" not in source
    inputs = rec.random_inputs(batch=1, tokens=70, heads=1, dims=dims, seed=13, decay_scale=10.0)
    compare(rec, inputs, random_state(rec, 1, 1, dims, np.float64, 13), np.float64, F64_RTOL)


def test_strips_write_snapshots_and_agree_across_threads(linrec):
    """States after every 50th token (a block ends early at each) and the last 3, identical on one thread
    and two."""
    from linrec.c import build as c_build
    rec = linrec.load(EXAMPLES / "gated_deltanet.lin")
    dims = {"dk": 128, "dv": 128}
    inputs = rec.random_inputs(batch=1, tokens=150, heads=2, dims=dims, seed=12, decay_scale=10.0)
    state0 = random_state(rec, 1, 2, dims, np.float64, 12)
    ref = rec.run(inputs, form="recurrent", backend="numpy", initial_state=state0, state_every=50, keep_last=3)
    runs = []
    for threads in (1, 2):
        with c_build.threads(threads):
            runs.append(rec.run(inputs, form="recurrent", backend="c", initial_state=state0, state_every=50,
                                keep_last=3))
    one, two = runs
    for k in ref.outputs:
        assert np.array_equal(one.outputs[k], two.outputs[k]), k
        assert rel_err(one.outputs[k], ref.outputs[k]) <= F64_RTOL, k
    for k in ref.checkpoints:
        assert np.array_equal(one.checkpoints[k], two.checkpoints[k]), k
        assert rel_err(one.checkpoints[k], ref.checkpoints[k]) <= F64_RTOL, k
    for k in ref.last_states:
        assert rel_err(one.last_states[k], ref.last_states[k]) <= F64_RTOL, k
