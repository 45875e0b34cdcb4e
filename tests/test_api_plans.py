"""Recurrence.run keeps a plan per call signature (inputs' names, shapes and dtypes, states' shapes, form,
backend, sizes): a repeated call skips the checks and choices its signature settled. The plan must never
carry values from one call to the next, and every check that depends on values or on a different signature
must still run. Results are compared exactly (==) with a fresh Recurrence that has no plans."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.dsl.errors import RuntimeInputError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIMS = {"dk": 5, "dv": 19}  # the C tests' sizes: their kernels are already built in a test session


def fresh(name: str):
    return linrec.load(EXAMPLES / f"{name}.lin")


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_repeated_signature_reuses_the_plan_not_the_values(backend):
    rec = fresh("gla")
    x1 = rec.random_inputs(batch=1, tokens=9, heads=2, dims=DIMS, seed=1)
    x2 = rec.random_inputs(batch=1, tokens=9, heads=2, dims=DIMS, seed=2)
    s2 = {"S": np.random.default_rng(3).standard_normal((1, 2, 5, 19))}
    first = rec.run(x1, form="recurrent", backend=backend)
    second = rec.run(x2, form="recurrent", backend=backend)
    assert len(rec._plans) == 1  # the second call found the first one's plan
    expected = fresh("gla").run(x2, form="recurrent", backend=backend)
    np.testing.assert_array_equal(second.outputs["o"], expected.outputs["o"])
    np.testing.assert_array_equal(second.final_state["S"], expected.final_state["S"])
    assert not np.array_equal(first.outputs["o"], second.outputs["o"])
    # an initial state is a value too: two calls with states of one shape share a plan, not the state
    with_state = rec.run(x2, form="recurrent", backend=backend, initial_state=s2)
    again = rec.run(x2, form="recurrent", backend=backend, initial_state={"S": 2 * s2["S"]})
    assert len(rec._plans) == 2
    expected = fresh("gla").run(x2, form="recurrent", backend=backend, initial_state={"S": 2 * s2["S"]})
    np.testing.assert_array_equal(again.final_state["S"], expected.final_state["S"])
    assert not np.array_equal(with_state.final_state["S"], again.final_state["S"])


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_checks_still_run_after_a_plan_is_kept(backend):
    rec = fresh("gla")
    x = rec.random_inputs(batch=1, tokens=9, heads=2, dims=DIMS, seed=1)
    rec.run(x, form="recurrent", backend=backend)
    outside = dict(x, g=x["g"].copy())
    outside["g"][0, 4, 1, 2] = 0.5  # g ≤ 0 is declared: a value, not a signature
    with pytest.raises(RuntimeInputError, match=r"input 'g'.*\[0, 4, 1, 2\]"):
        rec.run(outside, form="recurrent", backend=backend)
    with pytest.raises(RuntimeInputError, match="input 'g' is float32 but 'q' is float64"):
        rec.run(dict(x, g=x["g"].astype(np.float32)), form="recurrent", backend=backend)
    with pytest.raises(RuntimeInputError, match=r"input 'v' has \[B, T, H\] = \[1, 8, 2\]"):
        rec.run(dict(x, v=x["v"][:, :8]), form="recurrent", backend=backend)
    with pytest.raises(RuntimeInputError, match="unknown input"):
        rec.run(dict(x, w=x["v"]), form="recurrent", backend=backend)
    with pytest.raises(RuntimeInputError, match="initial state 'S' should have shape"):
        rec.run(x, form="recurrent", backend=backend, initial_state={"S": np.zeros((1, 2, 5, 18))})


def test_params_of_a_plan_are_shared_read_only():
    """Every call of a plan, and every result, holds the same parameter arrays: none of them can change
    what a later call computes."""
    rec = fresh("retnet")
    x = rec.random_inputs(batch=1, tokens=6, heads=3, dims=DIMS, seed=4)
    res = rec.run(x, form="recurrent")
    with pytest.raises(ValueError, match="read-only"):
        res.params["gamma"][0] = 0.5
    np.testing.assert_array_equal(res.params["gamma"], rec.run(x, form="recurrent").params["gamma"])
    # given params are values: such calls keep no plan, and use what they are given
    gamma = np.array([0.5, 0.6, 0.7])
    given = rec.run(x, form="recurrent", params={"gamma": gamma})
    np.testing.assert_array_equal(given.params["gamma"], gamma)
    assert len(rec._plans) == 1


def test_plans_kept_are_bounded():
    """A long-running caller with ever new shapes keeps at most PLANS_KEPT plans, the newest."""
    from linrec.api import PLANS_KEPT
    rec = fresh("gla")
    for tokens in range(1, PLANS_KEPT + 9):
        rec.run(rec.random_inputs(batch=1, tokens=tokens, heads=1, dims={"dk": 2, "dv": 3}), form="recurrent")
    assert len(rec._plans) == PLANS_KEPT
    kept_tokens = sorted(key[3][1][1] for key in rec._plans)  # (name, shape, dtype) of the first input
    assert kept_tokens == list(range(9, PLANS_KEPT + 9))
