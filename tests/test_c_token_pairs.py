"""The fused kernel's pass over a state with rank-one corrections two tokens at a time (passes.pair_pass,
templates/c_fused.c.j2 `token_pass`: p(u + 1) = the previous pass's partial sums w(u + 1)ᵀ·S plus
Σ_g (w(u + 1)·x_g(u))·y_g(u)), against the float64 NumPy recurrent form.

A program with three corrections and two write groups (each group's right vector sums several p's) under
a strong scalar decay, so that slow tokens (the decay applied to the rows: a token alone) fall between
pairs, at dims that are not powers of two; and the delta rule without a decay (every token in a pair). 133
and 97 tokens: two and one block ends, an odd token left at the end of a block. Tolerances as in
test_c_backend.py: 1e-10 (float64), 2e-5 (float32). Two kernels are built.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_c_backend import F32_RTOL, F64_RTOL, compare, random_state

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# (I − β·k⊗k)(I − β·a⊗a)·S: the three terms it multiplies out to share their u vectors, so two corrections,
# u = kn (w = kn − β(kn·an)·an) and u = an (w = an) (transitions._merged); left vectors k and a
TWO_CORRECTIONS = """recurrence two_corrections(dk = 16, dv = 16)
input q[dk], k[dk], a[dk], v[dv], e[dv]
input beta in (0, 1)
input g <= 0
kn = l2norm(k)
an = l2norm(a)
state S[dk, dv]
S = exp(g)·(I − beta·kn⊗kn)·(I − beta·an⊗an)·S + beta·kn⊗v + an⊗e
output o = q·S
"""


@pytest.fixture(scope="module")
def linrec(cache_dir):
    import linrec
    return linrec


def test_pairs_with_several_corrections_and_slow_tokens(linrec):
    rec = linrec.compile(TWO_CORRECTIONS)
    dims = {"dk": 40, "dv": 48}
    (transition,) = rec.decomposition.transitions
    assert len(transition.corrections) == 2 and len(transition.writes) == 2
    source = rec.module("recurrent", "c").source(np.float64, dims)
    assert "two tokens a pass" in source
    # what token u's writes add to token u + 1's p: one dot per (correction, left vector)
    assert source.count("[u] = acc;") == 2 * 2
    inputs = rec.random_inputs(batch=1, tokens=133, heads=2, dims=dims, seed=21, decay_scale=10.0)
    compare(rec, inputs, random_state(rec, 1, 2, dims, np.float64, 21), np.float64, F64_RTOL)


def test_pairs_without_a_decay(linrec):
    rec = linrec.load(EXAMPLES / "deltanet.lin")
    dims = {"dk": 64, "dv": 64}
    source = rec.module("recurrent", "c").source(np.float32, dims)
    assert "if (u + 1 < nb && 1) {" in source  # no slow token: every pair of the block in one pass
    inputs = rec.random_inputs(batch=2, tokens=97, heads=1, dims=dims, seed=22)
    compare(rec, inputs, random_state(rec, 2, 1, dims, np.float64, 22), np.float32, F32_RTOL)
