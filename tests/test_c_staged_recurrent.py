"""The C recurrent form of a program the fused kernel takes only stage by stage (c.staged_recurrent): its
sequences run one fused kernel per stage, its decode step the statements as written.

Every sequence is checked against NumPy's recurrent form (the program as written, float64) at a relative 1e-9
in float64 and 1e-4 in float32 — max|C − NumPy| / max|NumPy| per output and final state, and per checkpoint
and kept state for serving — on odd sizes, several batch rows and heads, given and zero initial states. The
recurrences are module-level: each keeps the kernels it built.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec import registry
from compare import rel_err
from test_stages import (ATTEND, CYCLE, DECAYED_BY_A_STATE, PRECONDITIONED,  # (ATTEND: stage 2's key a softmax
                         assert_close, preconditioned_case)                # over stage 1's readout q·U)

ROOT = Path(__file__).resolve().parent.parent
DIMS = {"dk": 7, "dv": 5}  # (odd sizes: no whole register)

# a combination no example has: a vector state of key energy whose value sets the delta rule's writing
# strength — stage 1 hands n_t on, stage 2 is a gated delta rule whose beta is computed from it
ENERGY_GATED = linrec.compile("""
recurrence energy_gated(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0
state n[dk], S[dk, dv]
n = exp(g)*n + k*k
kn = l2norm(k)
b = beta*sigmoid(1 − n·(kn*kn))
S = exp(g)·(I − b·kn⊗kn)·S + b·kn⊗v
output o = dk^(−1/2)·q·S
output energy = n
""")


def preconditioned_inputs(B=2, T=37, H=3, seed=0, dtype=np.float64):
    x, s0 = preconditioned_case(B=B, T=T, H=H, dk=DIMS["dk"], dv=DIMS["dv"], seed=seed)
    return {k: v.astype(dtype) for k, v in x.items()}, {k: v.astype(dtype) for k, v in s0.items()}


def test_the_sequences_run_stage_by_stage_only_where_the_fused_kernel_takes_every_stage_and_not_the_whole():
    c = registry.backend("c")
    assert c.sequences_in_stages(PRECONDITIONED.compiled)
    assert c.sequences_in_stages(ENERGY_GATED.compiled) and c.sequences_in_stages(ATTEND.compiled)
    gla = linrec.load(ROOT / "examples" / "gla.lin")  # (fused as a whole: one kernel)
    assert not c.sequences_in_stages(gla.compiled)
    assert not c.sequences_in_stages(CYCLE.compiled)  # (no stages: the states read each other)
    elementwise = DECAYED_BY_A_STATE  # (stage 2 decays elementwise, which the fused kernel does not take)
    assert len(elementwise.decomposition.stages) == 2 and not c.sequences_in_stages(elementwise.compiled)
    module = PRECONDITIONED.module("recurrent", "c")
    assert module.capabilities.snapshots and module.capabilities.checks_ranges
    assert not module.capabilities.steps_slots  # (the step runs the program as written)
    check = linrec.cli.format_check(linrec.cli.describe(PRECONDITIONED, "preconditioned_deltanet.lin"))
    assert "  recurrent   available (backends: numpy, c; C runs a fused kernel per stage)" in check


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-9), (np.float32, 1e-4)], ids=["f64", "f32"])
def test_the_preconditioned_rule_on_c_matches_the_program_as_written(dtype, rtol):
    x, s0 = preconditioned_inputs(dtype=dtype)
    for state in (s0, None):
        want = PRECONDITIONED.run({k: v.astype(np.float64) for k, v in x.items()}, form="recurrent",
                                  backend="numpy", dims=DIMS,
                                  initial_state=None if state is None else {k: v.astype(np.float64)
                                                                            for k, v in state.items()})
        got = PRECONDITIONED.run(x, form="recurrent", backend="c", dims=DIMS, initial_state=state)
        assert got.outputs["o"].dtype == dtype
        assert_close(got, want, rtol)
    assert all(np.array_equal(s0[k], preconditioned_inputs(dtype=dtype)[1][k]) for k in s0)  # (not modified)


@pytest.mark.parametrize("rec", [ENERGY_GATED, ATTEND], ids=lambda r: r.name)
def test_other_staged_programs_on_c_match_the_program_as_written(rec):
    x = rec.random_inputs(batch=2, tokens=29, heads=2, seed=3)
    rng = np.random.default_rng(4)
    sizes = {d.name: d.default for d in rec.program.dims}
    s0 = {s.name: np.abs(rng.standard_normal((2, 2) + tuple(sizes[d] for d in s.shape))) for s in rec.program.states}
    want = rec.run(x, form="recurrent", backend="numpy", initial_state=s0)
    assert_close(rec.run(x, form="recurrent", backend="c", initial_state=s0), want, 1e-9)


def test_checkpoints_last_states_and_packed_sequences_come_from_the_stages():
    x, s0 = preconditioned_inputs(B=1, T=23, seed=6)
    got = PRECONDITIONED.run(x, form="recurrent", backend="c", dims=DIMS, initial_state=s0, state_every=5,
                             keep_last=3)
    want = PRECONDITIONED.run(x, form="recurrent", backend="numpy", dims=DIMS, initial_state=s0, state_every=5,
                              keep_last=3)
    assert_close(got, want, 1e-9)
    for name in s0:
        assert got.checkpoints[name].shape == want.checkpoints[name].shape
        assert rel_err(got.checkpoints[name], want.checkpoints[name]) <= 1e-9
        assert rel_err(got.last_states[name], want.last_states[name]) <= 1e-9
    cu = np.array([0, 9, 9, 23])
    states = {k: np.concatenate([v] * 3) for k, v in s0.items()}
    got = PRECONDITIONED.run(x, form="recurrent", backend="c", dims=DIMS, initial_state=states, cu_seqlens=cu)
    want = PRECONDITIONED.run(x, form="recurrent", backend="numpy", dims=DIMS, initial_state=states, cu_seqlens=cu)
    assert_close(got, want, 1e-9)


def test_the_snapshots_of_every_state_and_output_arrays_given_by_the_caller():
    x, s0 = preconditioned_inputs(B=2, T=19, H=2, seed=7)
    module = PRECONDITIONED.module("recurrent", "c")
    params = PRECONDITIONED.run(x, form="recurrent", backend="c", dims=DIMS).params
    outputs, final, snapshots = module.forward_snapshots(x, params, s0, DIMS, np.array([4, 11, 19]))
    for stop, i in ((4, 0), (11, 1), (19, 2)):
        want = PRECONDITIONED.run({k: v[:, :stop] for k, v in x.items()}, form="recurrent", backend="numpy",
                                  dims=DIMS, initial_state=s0)
        for name in s0:
            assert rel_err(snapshots[name][:, i], want.final_state[name]) <= 1e-9, (name, stop)
    out = {"o": np.full((2, 19, 2, DIMS["dv"]), np.nan)}
    got, _ = module.forward(x, params, s0, DIMS, out=out)
    assert got["o"] is out["o"] and rel_err(out["o"], outputs["o"]) <= 1e-12


def test_an_input_outside_its_range_in_a_later_stage_is_named_and_no_state_changes():
    x, s0 = preconditioned_inputs(B=1, T=9, H=2, seed=8)
    x["beta"][0, 5, 1] = 1.5  # (read by stage 2 only)
    before = {k: v.copy() for k, v in s0.items()}
    with pytest.raises(linrec.LinrecError, match="'beta'"):
        PRECONDITIONED.run(x, form="recurrent", backend="c", dims=DIMS, initial_state=s0)
    assert all(np.array_equal(s0[k], before[k]) for k in s0)


def test_the_decode_step_runs_the_program_as_written_and_continues_a_staged_sequence():
    x, s0 = preconditioned_inputs(B=2, T=12, H=2, seed=5)
    head = PRECONDITIONED.run({k: v[:, :8] for k, v in x.items()}, form="recurrent", backend="c", dims=DIMS,
                              initial_state=s0)
    state, outputs = {k: v.copy() for k, v in head.final_state.items()}, []
    for t in range(8, 12):
        out, state = PRECONDITIONED.step({k: v[:, t] for k, v in x.items()}, state, backend="c")
        outputs.append(out["o"])
    want = PRECONDITIONED.run(x, form="recurrent", backend="numpy", dims=DIMS, initial_state=s0)
    assert rel_err(np.stack(outputs, axis=1), want.outputs["o"][:, 8:]) <= 1e-9
    for name in s0:
        assert rel_err(state[name], want.final_state[name]) <= 1e-9


def test_the_emitted_recurrent_c_is_each_stages_fused_kernel_and_the_programs_step():
    source = PRECONDITIONED.emit("recurrent", backend="c")
    first = "/* ==== stage 1: state(s) A; hands on A_t = A (after this token's update): its sequences' fused kernel"
    second = "/* ==== stage 2: state(s) S; takes A_t: its sequences' fused kernel ==== */"
    step = "/* ==== the decode step (lr_step): the program as written, its statements one by one ==== */"
    assert source.index(first) < source.index(second) < source.index(step)
