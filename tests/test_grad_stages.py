"""The parallel and chunkwise backward of programs derived in stages (backends/stages.py StagedGradient): the
stages' backwards in reverse stage order, the gradients of the values a stage hands on seeding the earlier
stage's outputs of the same name; and of a vector state read as it is (a readout with no query, which the
first stage of the preconditioned delta rule hands on). Each against the recurrent backward (which
tests/test_grad.py checks against finite differences): 1e-9 in float64, 5e-4 in float32."""
import numpy as np
import pytest

import linrec
from linrec import gradients, verify_grad
from linrec.interface import Refusal
from linrec.numpy import BACKEND as NUMPY
from linrec.registry import backend
from linrec.stages import Staged
from test_grad import float32, worst_error

TWO_STAGES = """recurrence two_stage(dk = 5, dv = 4)
input q[dk], v[dv], g <= 0, gp <= 0, q2[dk], k2[dk], v2[dk]
param w[dk] per head = 1
state P[dk, dk]
P = exp(gp)·P + k2⊗v2
kp = softmax(w*(q2·P))            # stage 2 reads a softmax over a readout of stage 1's state
state S[dk, dv]
S = exp(g)·S + kp⊗v
output o = q·S
output y = q2·P                   # an output of stage 1 that stage 2 also takes
"""

ELEMENTWISE_STAGE = """recurrence elementwise_stage(dk = 4, dv = 3)
input q[dk], v[dv], G[dk, dk] <= 0, q2[dk], k2[dk], v2[dk]
state P[dk, dk]
P = exp(G)*P + k2⊗v2              # stage 1 decays elementwise
state S[dk, dv]
S = S + softmax(q2·P)⊗v
output o = q·S
"""

VALUE_READ = """recurrence value_read(d = 5)
input x[d], f[d] <= 0, z[d]
state hs[d]
output before = hs*sigmoid(z)     # the state itself, before the update
hs = exp(f)*hs + x
output after = hs*tanh(z)         # and after it
output dotted = z·hs              # a readout with a query of the same state, after those without one
"""



def _case(rec, tokens, dims, seed):
    """Inputs with strong decays, random initial states and upstream gradients of the outputs and final
    states (float64)."""
    x = rec.random_inputs(batch=2, tokens=tokens, heads=2, dims=dims, seed=seed, decay_scale=20.0)
    rng = np.random.default_rng(seed + 100)
    sizes = {d.name: d.default for d in rec.program.dims} | dims
    up = {o.name: rng.standard_normal((2, tokens, 2) + tuple(sizes[d] for d in o.value.shape))
          for o in rec.program.outputs}
    states = {s.name: (2, 2) + tuple(sizes[d] for d in s.shape) for s in rec.program.states}
    s0 = {name: np.abs(rng.standard_normal(shape)) for name, shape in states.items()}  # (energies ≥ 0)
    end = {name: rng.standard_normal(shape) for name, shape in states.items()}
    return x, up, s0, end


PROGRAMS = {
    "preconditioned_deltanet": (lambda: linrec.load("examples/preconditioned_deltanet.lin"), {"dk": 6, "dv": 5}),
    "two_stage": (lambda: linrec.compile(TWO_STAGES, "two_stage.lin"), {}),
    "value_read": (lambda: linrec.compile(VALUE_READ, "value_read.lin"), {}),
    "elementwise_stage": (lambda: linrec.compile(ELEMENTWISE_STAGE, "elementwise_stage.lin"), {}),
}


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def program(request):
    make, dims = PROGRAMS[request.param]
    rec = make()
    x, up, s0, end = _case(rec, 45, dims, seed=len(request.param))
    reference = rec.vjp(x, up, initial_state=s0, grad_final_state=end)
    return rec, x, up, s0, end, reference


@pytest.mark.parametrize("form, chunk", [("parallel", None), ("chunkwise", 8), ("chunkwise", 64)])
def test_against_the_recurrent_backward(program, form, chunk):
    rec, x, up, s0, end, reference = program
    got = rec.vjp(x, up, initial_state=s0, grad_final_state=end, form=form, chunk_size=chunk)
    assert worst_error(got.grads, reference.grads) < 1e-9
    for name, value in reference.outputs.items():
        np.testing.assert_allclose(got.outputs[name], value, rtol=1e-10, atol=1e-12)
    single = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(end), form=form,
                     chunk_size=chunk)
    assert all(g.dtype == np.float32 for g in single.grads.values())
    assert worst_error(single.grads, reference.grads) < 5e-4


def test_the_stages_are_differentiated_from_the_last():
    rec = linrec.compile(TWO_STAGES, "two_stage.lin")
    assert [s.states for s in rec.compiled.decomposition.stages] == [("P",), ("S",)]
    for form in ("parallel", "chunkwise"):
        assert backend("numpy").gradient_why_not(rec.compiled, form) is None
        source = rec.emit_gradient(form)
        assert source.index("backward of stage 2") < source.index("backward of stage 1")


class _RefusesStageOne:
    """NumPy, except that it derives no backward for stage 1's program (as a backend may not)."""

    def __init__(self):
        self.inner = NUMPY
        self.name = "numpy"

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)

    def gradient_why_not(self, compiled, form):
        if compiled.name.endswith("_stage1") and form != "recurrent":
            return Refusal("no backward of this kind here", "try another")
        return self.inner.gradient_why_not(compiled, form)


def test_a_stage_without_the_backward_is_named():
    rec = linrec.compile(TWO_STAGES, "two_stage.lin")
    staged = Staged(_RefusesStageOne())
    why = staged.gradient_why_not(rec.compiled, "chunkwise")
    assert "the chunkwise backward of stage 1 (state(s) P) is not derived: no backward of this kind here" \
        in why.reason and why.advice == "try another"
    assert staged.gradient_why_not(rec.compiled, "recurrent") is None
    with pytest.raises(linrec.LinrecError, match="stage 1"):
        staged.load_gradient(rec.compiled, "chunkwise")


def test_verify_grad_checks_the_staged_forms():
    """`linrec verify --grad` (backends/verify_grad.py) runs the staged parallel and chunkwise backward."""
    rec = linrec.load("examples/preconditioned_deltanet.lin")
    rows = verify_grad.run(rec, quick=True)
    assert {r.form for r in rows} == {"recurrent", "parallel", "chunkwise"}
    assert rows and all(r.passed for r in rows)


# ---- the emitted backward: one module (`linrec emit FILE --grad`) ----------------------------------------------
ATTEND_MEMORY = """recurrence attend_memory(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], p[dv], a <= 0
param tau per head = 1 + 0.5·h
param gain per head = 2·tau       # a default computed from another param, read by the other stage
state U[dk, dv], S[dv, dv]
U = exp(a)·U + k⊗(gain*v)
w = softmax(tau·(q·U))            # stage 2 attends over stage 1's readout
S = S + w⊗v
output o = p·S
output m = w
"""

EMITTED = {
    "preconditioned_deltanet": (lambda: linrec.load("examples/preconditioned_deltanet.lin"), {"dk": 6, "dv": 5}),
    "attend_memory": (lambda: linrec.compile(ATTEND_MEMORY, "attend_memory.lin"), {}),
}


@pytest.fixture(scope="module", params=sorted(EMITTED))
def emitted(request):
    make, dims = EMITTED[request.param]
    rec = make()
    x, up, s0, end = _case(rec, 19, dims, seed=3)
    return rec, x, up, s0, end, {d.name: d.default for d in rec.program.dims} | dims


def _saved_copy(text: str, name: str) -> dict:
    """Generated source run as a user's saved copy of it runs: no loader, nothing replaced."""
    module = {}
    exec(compile(text, name, "exec"), module)  # noqa: S102 - the generated module under test
    return module


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_the_emitted_backward_is_one_module_of_the_program(emitted, backend):
    """`linrec emit FILE --grad` of a staged program prints one module: each stage's backward (and the forward
    of the stages but the last) under a name of its own, and the program's default_params and backward, which
    chains them as StagedGradient does. It printed each stage's module in turn, so that a saved copy's
    backward was stage 1's alone (asking for the gradient of the value it hands on). Saved and run on its own,
    it gives Recurrence.vjp's outputs, final states and gradients (1e-12 in float64: on C the forwards of the
    stages but the last are NumPy's), in every form `linrec check` lists on the backend."""
    rec, x, up, s0, end, sizes = emitted
    forms = [f for f in rec.forms if gradients.gradient_refusal(rec, f, backend) is None]
    assert forms == ["recurrent", "parallel", "chunkwise"]
    for form in forms:
        text = rec.emit_gradient(form, backend)
        for function in ("backward", "default_params"):
            assert text.count(f"\ndef {function}(") == 1, (form, function)
        module = _saved_copy(text, f"{rec.name}_{form}_backward.py")
        params = module["default_params"](2, sizes)
        assert worst_error(params, rec.default_params(2, sizes)) == 0
        derived = tuple(p.name for p in rec.program.params)  # (the defaults used, as Recurrence.vjp says)
        outputs, final, grads = module["backward"](x, params, s0, sizes, up, end, derived)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=end, form=form, backend=backend, dims=sizes)
        assert list(grads) == list(want.grads), form
        assert worst_error(grads, want.grads) <= 1e-12, form
        assert worst_error(outputs, want.outputs) <= 1e-12 and worst_error(final, want.final_state) <= 1e-12, form


def test_the_emitted_backward_keeps_the_stages_apart():
    """The stages' modules in one: their functions renamed (stage2_backward, stage1_forward, …: each called by
    the chaining under that name); an import one stage binds to another object than an earlier one does
    (C's l2norm, NumPy's) renamed in the later; the stages' headers, backwards from the last, as before."""
    rec = linrec.load("examples/preconditioned_deltanet.lin")
    text = rec.emit_gradient("chunkwise", "c")
    assert [line for line in text.splitlines() if "====" in line] == [
        "# ==== backward of stage 2: state(s) S; takes A_t ====",
        "# ==== backward of stage 1: state(s) A; hands on A_t = A (after this token's update) ===="]
    for name in ("stage2_backward", "stage1_backward", "stage1_forward"):
        assert f"\ndef {name}(" in text and f"= {name}(" in text
    assert "from linrec.c.rows import l2norm, vjp_l2norm\n" in text
    assert "from linrec.numpy.runtime import l2norm as stage1_l2norm\n" in text
