"""The recurrent form of each example program against an independent NumPy implementation of its math
(tests/reference_impls.py: explicit loops over b, h, t; no linrec code).

Tolerances, all measured as max|actual − expected| / max|expected| (relative to the largest magnitude of
the expected array), separately for every output and every final state:
    float64 run vs float64 reference:            1e-10
    float32 run vs float64 reference:            5e-6  (≈ 40 float32 ulps; measured errors are ≤ 4e-7)
Inputs and initial states are drawn here with our own generator (not rec.random_inputs) so that the
check does not depend on linrec's input sampling; initial states are random and nonzero, dk ≠ dv.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linrec
import reference_impls as ref
from compare import rel_err

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["gla", "retnet", "mamba2", "deltanet", "gated_deltanet", "linear_transformer", "gdn2", "comba", "mamba1"]

FLOAT64_RTOL = 1e-10
FLOAT32_RTOL = 5e-6

# name → {input: (kind, feature dim or None)}; kinds follow each input's declared range
INPUT_SPECS = {
    "gla": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv"), "g": ("logdecay", "dk")},
    "retnet": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv")},
    "mamba2": {"x": ("normal", "dv"), "B": ("normal", "dk"), "C": ("normal", "dk"), "dt": ("positive", None)},
    "mamba1": {"x": ("normal", "dv"), "B": ("normal", "dk"), "C": ("normal", "dk"), "dt": ("positive", "dv")},
    "deltanet": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv"), "beta": ("unit", None)},
    "gated_deltanet": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv"),
                       "beta": ("unit", None), "g": ("logdecay", None)},
    "linear_transformer": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv")},
    "gdn2": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv"), "b": ("unit", "dk"),
             "w": ("unit", "dv"), "g": ("logdecay", "dk")},
    "comba": {"q": ("normal", "dk"), "k": ("normal", "dk"), "v": ("normal", "dv"), "beta": ("unit", None),
              "g": ("logdecay", None)},
}
STATE_SPECS = {name: {"S": ("normal", ("dk", "dv"))} for name in NAMES}
STATE_SPECS["linear_transformer"] = {"S": ("normal", ("dk", "dv")), "z": ("positive", ("dk",))}

# (B, T, H, dk, dv): T = 1 included, dk ≠ dv in both directions
SIZES = [(1, 1, 1, 5, 4), (2, 7, 3, 5, 4), (3, 1, 2, 3, 6), (1, 12, 2, 6, 3)]

_RECS: dict[str, linrec.Recurrence] = {}


def rec_for(name: str) -> linrec.Recurrence:
    if name not in _RECS:
        _RECS[name] = linrec.load(EXAMPLES / f"{name}.lin")
    return _RECS[name]


def make_inputs(name, B, T, H, dk, dv, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    dims = {"dk": dk, "dv": dv}
    out = {}
    for x, (kind, dim) in INPUT_SPECS[name].items():
        shape = (B, T, H) + ((dims[dim],) if dim else ())
        if kind == "normal":
            a = rng.standard_normal(shape)
        elif kind == "logdecay":       # g ≤ 0, decays exp(g) between ~0.2 and 1
            a = -0.5 * np.abs(rng.standard_normal(shape))
        elif kind == "positive":       # dt > 0
            a = 0.05 + 0.3 * np.abs(rng.standard_normal(shape))
        elif kind == "unit":           # beta ∈ (0, 1)
            a = rng.uniform(0.05, 0.95, shape)
        else:
            raise ValueError(kind)
        out[x] = a.astype(dtype)
    return out


def make_state(name, B, H, dk, dv, seed, dtype=np.float64):
    rng = np.random.default_rng(seed + 1000)
    dims = {"dk": dk, "dv": dv}
    out = {}
    for s, (kind, sdims) in STATE_SPECS[name].items():
        shape = (B, H) + tuple(dims[d] for d in sdims)
        a = rng.standard_normal(shape) if kind == "normal" else rng.uniform(0.5, 1.5, shape)
        out[s] = a.astype(dtype)
    return out


def ref_params(name, H, res_params):
    """The parameters the reference uses: RetNet's γ from its formula; Mamba-2's A, D as linrec used them."""
    if name == "retnet":
        return {"gamma": ref.retnet_gamma(H)}
    if name in ("mamba2", "mamba1"):
        return {"A": res_params["A"], "D": res_params["D"]}
    if name == "comba":
        return {"d": res_params["d"], "D": res_params["D"]}
    return {}


def assert_matches(res, expected_outputs, expected_states, rtol, dtype):
    assert set(res.outputs) == set(expected_outputs)
    assert set(res.final_state) == set(expected_states)
    for kind, got_all, want_all in (("output", res.outputs, expected_outputs),
                                    ("final state", res.final_state, expected_states)):
        for key, want in want_all.items():
            got = got_all[key]
            assert got.dtype == dtype, f"{kind} {key}: dtype {got.dtype}, expected {dtype}"
            err = rel_err(got, want)
            assert err <= rtol, f"{kind} '{key}': relative error {err:.3g} > {rtol:g}"


# ---- float64 against the reference ---------------------------------------------------------------
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "B{}T{}H{}dk{}dv{}".format(*s))
@pytest.mark.parametrize("name", NAMES)
def test_recurrent_matches_reference_float64(name, sizes):
    B, T, H, dk, dv = sizes
    rec = rec_for(name)
    x = make_inputs(name, B, T, H, dk, dv, seed=sum(sizes))
    s0 = make_state(name, B, H, dk, dv, seed=sum(sizes))
    s0_copy = {k: v.copy() for k, v in s0.items()}
    x_copy = {k: v.copy() for k, v in x.items()}
    res = rec.run(x, form="recurrent", initial_state=s0)
    # the caller's arrays are not modified
    for k in s0:
        np.testing.assert_array_equal(s0[k], s0_copy[k])
    for k in x:
        np.testing.assert_array_equal(x[k], x_copy[k])
    want_o, want_s = ref.REFERENCES[name](x, ref_params(name, H, res.params), s0)
    assert_matches(res, want_o, want_s, FLOAT64_RTOL, np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_initial_state_is_used(name):
    """A nonzero initial state changes the outputs (so the reference comparison above is not vacuous)."""
    B, T, H, dk, dv = 2, 3, 2, 4, 3
    rec = rec_for(name)
    x = make_inputs(name, B, T, H, dk, dv, seed=5)
    s0 = make_state(name, B, H, dk, dv, seed=5)
    with_s0 = rec.run(x, initial_state=s0, form="recurrent")
    without = rec.run(x, form="recurrent")
    out = next(iter(with_s0.outputs))
    assert rel_err(without.outputs[out], with_s0.outputs[out]) > 1e-3
    zeros = {k: np.zeros_like(v) for k, v in s0.items()}
    want_o, want_s = ref.REFERENCES[name](x, ref_params(name, H, without.params), zeros)
    assert_matches(without, want_o, want_s, FLOAT64_RTOL, np.float64)


# ---- float32 -------------------------------------------------------------------------------------
FLOAT32_CASES = NAMES


@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_recurrent_float32_close_to_float64_reference(name):
    B, T, H, dk, dv = 2, 16, 2, 7, 5
    rec = rec_for(name)
    x32 = make_inputs(name, B, T, H, dk, dv, seed=11, dtype=np.float32)
    s32 = make_state(name, B, H, dk, dv, seed=11, dtype=np.float32)
    res = rec.run(x32, initial_state=s32, form="recurrent")
    # reference in float64 on exactly the same (float32-representable) values
    want_o, want_s = ref.REFERENCES[name](x32, ref_params(name, H, res.params), s32)
    assert_matches(res, want_o, want_s, FLOAT32_RTOL, np.float32)
    # parameters are used in the inputs' dtype
    for k, v in res.params.items():
        assert v.dtype == np.float32, k


# ---- prefill then decode -------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_equals_full_sequence(name):
    B, T, H, dk, dv = 2, 9, 2, 4, 3
    rec = rec_for(name)
    x = make_inputs(name, B, T, H, dk, dv, seed=21)
    s0 = make_state(name, B, H, dk, dv, seed=21)
    full = rec.run(x, initial_state=s0, form="recurrent")
    state = s0
    pieces = {k: [] for k in full.outputs}
    for lo, hi in ((0, 4), (4, 5), (5, 9)):   # a prefill of 4, one decode step, then 4 more
        part = rec.run({k: v[:, lo:hi] for k, v in x.items()}, initial_state=state, form="recurrent")
        for k in pieces:
            pieces[k].append(part.outputs[k])
        state = part.final_state
    for k in full.outputs:
        assert rel_err(np.concatenate(pieces[k], axis=1), full.outputs[k]) <= FLOAT64_RTOL
    for k in full.final_state:
        assert rel_err(state[k], full.final_state[k]) <= FLOAT64_RTOL


# ---- parameters ----------------------------------------------------------------------------------
def test_retnet_default_gamma():
    rec = rec_for("retnet")
    x = make_inputs("retnet", 1, 2, 4, 3, 2, seed=0)
    res = rec.run(x, form="recurrent")
    np.testing.assert_allclose(res.params["gamma"], [1 - 2.0 ** -5, 1 - 2.0 ** -6, 1 - 2.0 ** -7,
                                                    1 - 2.0 ** -8], rtol=0, atol=1e-15)
    np.testing.assert_allclose(rec.default_params(4, {"dk": 3, "dv": 2})["gamma"], res.params["gamma"],
                               rtol=0, atol=0)


def test_retnet_overridden_gamma():
    B, T, H, dk, dv = 2, 6, 3, 5, 4
    rec = rec_for("retnet")
    x = make_inputs("retnet", B, T, H, dk, dv, seed=3)
    s0 = make_state("retnet", B, H, dk, dv, seed=3)
    gamma = np.array([0.5, 0.0, 1.0])
    res = rec.run(x, params={"gamma": gamma}, initial_state=s0, form="recurrent")
    np.testing.assert_array_equal(res.params["gamma"], gamma)
    want_o, want_s = ref.retnet(x, {"gamma": gamma}, s0)
    assert_matches(res, want_o, want_s, FLOAT64_RTOL, np.float64)
    # γ = 0 for head 1: the final state is exactly the last token's k vᵀ
    np.testing.assert_allclose(res.final_state["S"][:, 1],
                               np.einsum("bi,bj->bij", x["k"][:, -1, 1], x["v"][:, -1, 1]), rtol=1e-14)
    # and the result differs from the default γ
    default = rec.run(x, initial_state=s0, form="recurrent")
    assert rel_err(default.final_state["S"], res.final_state["S"]) > 1e-2


def test_mamba2_default_params():
    rec = rec_for("mamba2")
    p = rec.default_params(5, {"dk": 3, "dv": 2})
    assert p["A_log"].shape == p["A"].shape == p["D"].shape == (5,)
    assert np.all((p["A_log"] >= 0) & (p["A_log"] <= np.log(16)))
    np.testing.assert_allclose(p["A"], -np.exp(p["A_log"]), rtol=1e-15)
    assert np.all(p["A"] < 0)
    # seeded: the same defaults every time, different A and D draws
    p2 = rec.default_params(5, {"dk": 3, "dv": 2})
    np.testing.assert_array_equal(p["A"], p2["A"])
    np.testing.assert_array_equal(p["D"], p2["D"])


def test_mamba2_overridden_A_and_D():
    B, T, H, dk, dv = 2, 5, 2, 4, 3
    rec = rec_for("mamba2")
    x = make_inputs("mamba2", B, T, H, dk, dv, seed=4)
    s0 = make_state("mamba2", B, H, dk, dv, seed=4)
    A = np.array([-0.1, -2.0])
    D = np.array([0.0, 3.0])
    res = rec.run(x, params={"A": A, "D": D}, initial_state=s0, form="recurrent")
    np.testing.assert_array_equal(res.params["A"], A)
    np.testing.assert_array_equal(res.params["D"], D)
    want_o, want_s = ref.mamba2(x, {"A": A, "D": D}, s0)
    assert_matches(res, want_o, want_s, FLOAT64_RTOL, np.float64)
    default = rec.run(x, initial_state=s0, form="recurrent")
    assert rel_err(default.outputs["y"], res.outputs["y"]) > 1e-2


def test_mamba2_overriding_A_log_changes_A():
    rec = rec_for("mamba2")
    x = make_inputs("mamba2", 1, 2, 2, 3, 2, seed=0)
    res = rec.run(x, params={"A_log": np.array([0.0, 1.0])}, form="recurrent")
    np.testing.assert_allclose(res.params["A"], [-1.0, -np.e], rtol=1e-15)


# ---- property test over sizes and seeds ---------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(NAMES), B=st.integers(1, 2), T=st.integers(1, 6), H=st.integers(1, 3),
       dk=st.integers(1, 5), dv=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_recurrent_matches_reference_property(name, B, T, H, dk, dv, seed):
    rec = rec_for(name)
    x = make_inputs(name, B, T, H, dk, dv, seed=seed)
    s0 = make_state(name, B, H, dk, dv, seed=seed)
    res = rec.run(x, initial_state=s0, form="recurrent")
    want_o, want_s = ref.REFERENCES[name](x, ref_params(name, H, res.params), s0)
    if name == "retnet" and dv == 1:
        # groupnorm of one number is exactly 0
        assert np.all(res.outputs["o"] == 0.0)
    assert_matches(res, want_o, want_s, FLOAT64_RTOL, np.float64)


# ---- rec.random_inputs respects the declarations --------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_random_inputs_fit_declarations(name):
    rec = rec_for(name)
    x = rec.random_inputs(batch=2, tokens=7, heads=3, dims={"dk": 5, "dv": 4}, dtype=np.float32, seed=1)
    dims = {"dk": 5, "dv": 4}
    assert set(x) == set(INPUT_SPECS[name])
    for k, (kind, dim) in INPUT_SPECS[name].items():
        assert x[k].shape == (2, 7, 3) + ((dims[dim],) if dim else ())
        assert x[k].dtype == np.float32
        if kind == "logdecay":
            assert np.all(x[k] <= 0)
        elif kind == "positive":
            assert np.all(x[k] > 0)
        elif kind == "unit":
            assert np.all((x[k] > 0) & (x[k] < 1))
    res = rec.run(x, form="recurrent")  # and they are accepted as they are
    out = next(iter(res.outputs))
    assert res.outputs[out].dtype == np.float32 and np.all(np.isfinite(res.outputs[out]))
