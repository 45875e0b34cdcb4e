"""A per-token array that several states' parts of a generated module compute is computed once, and the chain
rule through an expression several arrays are computed from runs once (backends/numpy/shared_arrays.py,
compiler.adjoint.derive_over_readouts): the linear transformer's φ(k) = elu(k) + 1 is the key of S and of its
normalizer z, φ(q) the query of both."""
import numpy as np

import linrec
from linrec.numpy.shared_arrays import shared_calls, shared_per_token
from compare import worst_gradient_error

LT = "examples/linear_transformer.lin"


def test_a_call_made_twice_is_bound_to_a_name_before_its_first_use():
    call = "per_token(elu_plus_one(k), (batch, tokens, heads, dk), dtype, scalar=False)"
    lines = ["S_log_decay = None", f"S_writes = [({call}, v)]", "", "# z", f"z_writes = [({call}, ones)]"]
    assert shared_per_token(lines) == [
        "S_log_decay = None",
        f"elu_plus_one_k = {call}  # (read more than once below: computed once)",
        "S_writes = [(elu_plus_one_k, v)]", "", "# z", "z_writes = [(elu_plus_one_k, ones)]"]


def test_what_is_not_shared():
    bare = "per_token(v, (batch, tokens, heads, dv), dtype, scalar=False)"  # (an input itself: no work)
    call = "per_token(exp(g), (batch, tokens, heads, 1), dtype, scalar=True)"
    once = [f"a = [{bare}]", f"b = [{bare}]", f"c = {call}"]
    assert shared_per_token(once) == once
    in_a_branch = [f"c = {call}", "if fused is None:", f"    d = {call}"]  # (a branch may not run)
    assert shared_per_token(in_a_branch) == in_a_branch
    clash = ["exp_g = 1", f"c = {call}", f"d = {call}"]  # (a name the module uses is never taken)
    assert shared_per_token(clash)[1].startswith("exp_g_1 = per_token(exp(g)")


def test_the_linear_transformers_feature_maps_are_computed_once_forward_and_backward():
    rec = linrec.load(LT)
    forward = rec.emit("chunkwise", "numpy")
    assert forward.count("elu_plus_one(k)") == 1 and forward.count("elu_plus_one(q)") == 1
    for backend in ("numpy", "c"):
        backward = rec.emit_gradient("recurrent" if backend == "c" else "chunkwise", backend)
        assert backward.count("elu_plus_one(k)") == 1 and backward.count("elu_plus_one(q)") == 1, backend
        assert backward.count("vjp_elu(") == 2, backend  # (one chain rule for k's two arrays, one for q's)
        assert "# adjoint of S.key0, z.key0 = elu(k) + 1" in backward, backend


def test_the_shared_arrays_give_the_gradients_of_the_statements():
    """The chunkwise and recurrent backward on both backends against the NumPy recurrent one, which runs the
    statements token by token (no arrays shared), in float64."""
    rec = linrec.load(LT)
    x = rec.random_inputs(batch=2, tokens=37, heads=3, seed=4)
    up = {"o": np.random.default_rng(5).standard_normal(x["v"].shape)}
    want = rec.vjp(x, up, form="recurrent", backend="numpy")
    for form in ("recurrent", "chunkwise", "parallel"):
        for backend in ("numpy", "c"):
            got = rec.vjp(x, up, form=form, backend=backend)
            for name, g in want.grads.items():
                assert np.abs(got.grads[name] - g).max() <= 1e-9 * np.abs(g).max(), (form, backend, name)


def test_a_call_whose_names_change_between_its_uses_is_not_shared():
    call = "per_token(r1 * 2, (batch, tokens, heads, 1), dtype, scalar=True)"
    lines = [f"a = {call}", "r1 = r1[..., 0]", f"b = {call}"]
    assert shared_per_token(lines) == lines


# ---- shared_calls: a pure call the chain rule computes again (Performer's features) ----

def test_a_pure_call_read_twice_as_an_operand_is_computed_once():
    call = "np.exp(matvec(W, k) - n)"
    lines = ["m_ = dims[\"m\"]", f"f = per_token({call} / float(np.sqrt(m_)), shape)", "S = scan(f)",
             f"g = in_place(a + b, '*', 1.0) * {call}  # the chain rule: {call}"]
    assert shared_calls(lines) == [
        "m_ = dims[\"m\"]", f"exp_W_k_n = {call}  # (read more than once below: computed once)",
        "f = per_token(exp_W_k_n / float(np.sqrt(m_)), shape)", "S = scan(f)",
        f"g = in_place(a + b, '*', 1.0) * exp_W_k_n  # the chain rule: {call}"]  # (comments keep their text)


def test_what_shared_calls_leaves_alone():
    """Only operands are shared — a call assigned as it is, or handed to a helper that may keep or change its
    argument (in_place, own_array, a vector–Jacobian product), could end up changed in place — and only where
    the text is one value (no name it reads assigned between its uses, not in a branch); a call of sizes alone
    is a scalar; an impure NumPy call (random, copyto) is never shared."""
    kept = [
        ["a = np.exp(g)", "b = np.exp(g) * 2"],  # (a holds the array itself)
        ["a = in_place(np.exp(g), '*', x)", "b = np.exp(g) * 2"],
        ["a = own_array(np.exp(g), shape, dtype, True)", "b = 2 * np.exp(g)"],
        ["a = vjp_abs(np.abs(r), d)", "b = 1 + np.abs(r)"],
        ["a = 1 + np.abs(r)", "r = r * 2", "b = 1 + np.abs(r)"],
        ["a = 1 + np.abs(r)", "if fused is None:", "    b = 1 + np.abs(r)"],
        ["m_ = dims[\"m\"]", "a = x / float(np.sqrt(m_))", "b = y / float(np.sqrt(m_))"],
        ["a = x + np.random.default_rng(0).standard_normal(3)", "b = y + np.random.default_rng(0).standard_normal(3)"],
    ]
    for lines in kept:
        assert shared_calls(lines) == lines, lines


def test_a_shared_call_is_not_read_inside_a_longer_name():
    """sigmoid(beta) shared, logsigmoid(beta) kept: the text replaced only where it is the call (a fuzz finding:
    a NameError for 'logsigmoid_beta' in the NumPy parallel and chunkwise forms) — also on a line that has both
    (on a line with logsigmoid alone nothing is replaced at all: the call was not found there)."""
    lines = ["a = 1.0 - sigmoid(beta)", "b = per_token(logsigmoid(beta), shape)", "c = (1.0 - sigmoid(beta)) * x",
             "d = sigmoid(beta) * logsigmoid(beta)"]
    assert shared_calls(lines) == [
        "sigmoid_beta = sigmoid(beta)  # (read more than once below: computed once)", "a = 1.0 - sigmoid_beta",
        "b = per_token(logsigmoid(beta), shape)", "c = (1.0 - sigmoid_beta) * x", "d = sigmoid_beta * logsigmoid(beta)"]
    rec = linrec.compile(
        "recurrence fz(dk = 2, dv = 1)\ninput k[dk], v[dv]\ninput beta <= 0\nstate S[dk, dv], z[dk]\n"
        "S = (1 − sigmoid(beta))·S + beta·k⊗v\nz = sigmoid(beta)·z + (1 − sigmoid(beta))·k\n"
        "output o = k·S + k·z\n", "fz.lin")
    x = rec.random_inputs(batch=1, tokens=9, heads=2, seed=0)
    want = rec.run(x).outputs["o"]
    for form in ("parallel", "chunkwise"):
        assert np.abs(rec.run(x, form=form).outputs["o"] - want).max() <= 1e-12


def test_performers_features_are_computed_once_and_give_the_statements_gradients():
    """The chain rule through exp(W·x − |x|²/2)/√m reads the features the forward computed instead of computing
    them again (a matrix product and an exp over [B, T, H, m] each: Performer's C recurrent vjp 246 → 215 ms at
    d = 64, T = 4096, H = 8, bit for bit); the gradients against the NumPy recurrent backward, which runs the
    statements token by token, in float64."""
    rec = linrec.load("examples/performer.lin")
    for form in ("recurrent", "chunkwise"):
        backward = rec.emit_gradient(form, "c")
        assert backward.count("np.exp(matvec(W, dk ** (-1.0 / 4.0) * q)") == 1, form
    assert rec.emit_gradient("recurrent", "c").count("np.exp(matvec(W, dk ** (-1.0 / 4.0) * k)") == 1
    dims = {"dk": 4, "dv": 3, "m": 8}
    x = rec.random_inputs(batch=2, tokens=21, heads=2, dims=dims, seed=6)
    up = {"o": np.random.default_rng(7).standard_normal(x["v"].shape)}
    assert worst_gradient_error(rec, x, up, ("recurrent", "chunkwise"), ("numpy", "c"), dims) <= 1e-9
