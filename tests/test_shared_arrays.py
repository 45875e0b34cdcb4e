"""A per-token array that several states' parts of a generated module compute is computed once, and the chain
rule through an expression several arrays are computed from runs once (backends/numpy/shared_arrays.py,
compiler.adjoint.derive_over_readouts): the linear transformer's φ(k) = elu(k) + 1 is the key of S and of its
normalizer z, φ(q) the query of both."""
import numpy as np

import linrec
from linrec.numpy.shared_arrays import shared_per_token

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
