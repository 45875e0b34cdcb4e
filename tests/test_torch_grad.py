"""Gradients through linrec.torch's custom op: torch.autograd.gradcheck (float64, against finite differences of
the op itself) for every example that has a recurrent form — inputs, params (a Layer's nn.Parameters) and
initial states; the op's gradients equal Recurrence.vjp's on the same arrays; the decode step's gradient; a
compiled model's backward pass (fullgraph); a program without a derived backward is refused when it would need
one. Skipped without torch (CI installs it)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linrec  # noqa: E402
import linrec.torch as lt  # noqa: E402
from test_gradient_choice import fixed_costs  # noqa: E402

EXACT = 1e-12  # float64: the op's backward runs rec.vjp itself, so only a different evaluation could differ
SMALL = {"dk": 3, "dv": 4}  # (gradcheck perturbs every element: keep it small)
# every example with a recurrent form, with the sizes of its dimensions
GRADIENT_EXAMPLES = [("gla", SMALL), ("retnet", SMALL), ("mamba2", SMALL), ("deltanet", SMALL),
                     ("gated_deltanet", SMALL), ("linear_transformer", SMALL), ("performer", dict(SMALL, m=4)),
                     ("softmax", SMALL)]


def layer_of(name: str, dims: dict, heads: int = 1) -> lt.Layer:
    return lt.Layer(f"examples/{name}.lin", heads=heads, dims=dims, dtype=torch.float64, backend="numpy")


def arguments(layer: lt.Layer, batch: int = 1, tokens: int = 5, seed: int = 0):
    """Inputs, initial states and params as float64 leaf tensors that require grad."""
    rec, heads = layer.rec, layer.heads
    x = rec.random_inputs(batch, tokens, heads, dims=layer.dims, seed=seed)
    sizes = {d.name: layer.dims.get(d.name, d.default) for d in rec.program.dims}
    rng = np.random.default_rng(seed + 1)
    states = {s.name: 0.5 * rng.standard_normal((batch, heads, *(sizes[d] for d in s.shape)))
              for s in rec.program.states}
    leaf = {}
    for group in (x, states):
        for name, value in group.items():
            leaf[name] = torch.from_numpy(value).requires_grad_()
    return {k: leaf[k] for k in x}, {k: leaf[k] for k in states}


def call(layer: lt.Layer, inputs: dict, states: dict, params: dict, **options):
    o, final = lt.apply(layer.rec, inputs, initial_state=states or None, params=params, output_final_state=True,
                        backend=layer.backend, dims=layer.dims, **options)
    outputs = [o] if isinstance(o, torch.Tensor) else list(o.values())
    return (*outputs, *final.values())


@pytest.mark.parametrize("name, dims", GRADIENT_EXAMPLES, ids=[e[0] for e in GRADIENT_EXAMPLES])
def test_gradcheck(name, dims):
    layer = layer_of(name, dims)
    inputs, states = arguments(layer)
    params = dict(layer.params.items())
    names = [*inputs, *states, *params]

    def f(*tensors):
        given = dict(zip(names, tensors))
        return call(layer, {k: given[k] for k in inputs}, {k: given[k] for k in states},
                    {k: given[k] for k in params})

    assert torch.autograd.gradcheck(f, (*inputs.values(), *states.values(), *params.values()), eps=1e-6,
                                    atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("name, form", [("gla", "chunkwise"), ("mamba2", "auto"), ("deltanet", "recurrent"),
                                        ("linear_transformer", "auto"), ("softmax", "auto")])
def test_gradients_equal_vjp(name, form):
    """loss.backward() through the op gives rec.vjp's gradients on the same arrays (outputs and final states
    both carry a cotangent), and its forward rec.run's outputs."""
    layer = layer_of(name, SMALL, heads=2)
    inputs, states = arguments(layer, batch=2, tokens=9, seed=4)
    params = dict(layer.params.items())
    results = call(layer, inputs, states, params, form=form, chunk_size=4)
    rng = np.random.default_rng(9)
    cotangents = [rng.standard_normal(tuple(r.shape)) for r in results]
    sum(torch.sum(r * torch.from_numpy(c)) for r, c in zip(results, cotangents)).backward()

    rec = layer.rec
    outputs = [o.name for o in rec.program.outputs]
    gradient_form = {"auto": "recurrent"}  # (the backward form="auto" runs: gradients.AUTO_ORDER)
    arrays = {k: v.detach().numpy() for k, v in inputs.items()}
    state0 = {k: v.detach().numpy() for k, v in states.items()}
    values = {k: v.detach().numpy() for k, v in params.items()}
    ref = rec.vjp(arrays, dict(zip(outputs, cotangents)), form=gradient_form.get(form, form),
                  grad_final_state=dict(zip(states, cotangents[len(outputs):])), initial_state=state0 or None,
                  params=values or None, dims=layer.dims, chunk_size=4)
    run = rec.run(arrays, form=form, initial_state=state0 or None, params=values or None, chunk_size=4)
    for got, name_ in zip(results, outputs):
        assert np.abs(got.detach().numpy() - run.outputs[name_]).max() <= EXACT
    for name_, tensor in [*inputs.items(), *states.items(), *params.items()]:
        assert tensor.grad is not None, name_
        assert np.abs(tensor.grad.numpy() - ref.grads[name_]).max() <= EXACT * max(1, np.abs(ref.grads[name_]).max())


def test_mamba2_A_log_gets_the_gradient_of_A():
    """A Layer holds A_log, not A = −exp(A_log): the gradient reaches A_log through the program's default."""
    layer = layer_of("mamba2", SMALL, heads=2)
    inputs, _ = arguments(layer)
    y, _ = layer(**inputs)
    y.sum().backward()
    ref = layer.rec.vjp({k: v.detach().numpy() for k, v in inputs.items()}, {"y": np.ones(tuple(y.shape))},
                        params={k: v.detach().numpy() for k, v in layer.params.items()}, dims=layer.dims)
    assert layer.params["A_log"].grad is not None and np.abs(layer.params["A_log"].grad.numpy()).max() > 0
    assert np.abs(layer.params["A_log"].grad.numpy() - ref.grads["A_log"]).max() <= EXACT


@pytest.mark.parametrize("name", ["gla", "performer", "softmax"])
def test_gradcheck_through_the_decode_step(name):
    """form='step' (one token from a state; softmax: the KV cache and the new token) differentiates too."""
    dims = dict(SMALL, m=4) if name == "performer" else SMALL
    layer = layer_of(name, dims)
    inputs, states = arguments(layer, tokens=4, seed=2)
    if name == "softmax":  # the state is the KV cache: the tokens so far
        def f(*tensors):
            given = dict(zip(inputs, tensors))
            o, _ = layer(**{k: v[:, 3:] for k, v in given.items()}, state={k: v[:, :3] for k, v in given.items()})
            return o
        assert torch.autograd.gradcheck(f, tuple(inputs.values()), eps=1e-6, atol=1e-7, rtol=1e-6)
        return
    names = [*inputs, *states]

    def step(*tensors):
        given = dict(zip(names, tensors))
        o, state = layer(**{k: given[k][:, :1] for k in inputs}, state={k: given[k] for k in states})
        return (o, *state.values())

    assert torch.autograd.gradcheck(step, (*inputs.values(), *states.values()), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_compiled_backward_fullgraph():
    """A small model with the op compiles whole with its backward pass (loss.backward()), and its gradients
    are the eager model's."""
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4 * 2 * 4, dtype=torch.float64)
            self.gla = lt.Layer("examples/gla.lin", heads=2, dims={"dk": 4, "dv": 4}, dtype=torch.float64)

        def forward(self, x):
            q, k, v, g = self.proj(x).unflatten(-1, (4, 2, 4)).unbind(2)
            o, state = self.gla(q=q, k=k, v=v, g=-torch.nn.functional.softplus(g))
            return (o ** 2).mean() + state["S"].pow(2).mean()

    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    model(x).backward()
    eager = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).backward()
    assert sorted(eager) == ["proj.bias", "proj.weight"]  # (GLA has no params)
    for k, p in model.named_parameters():
        assert (p.grad - eager[k]).abs().max() <= 1e-12, k


NOISY = """recurrence noisy(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
param s per head = 1
param w per head = s + randn(seed=0)
state S[dk, dv]
S = S + w*k⊗v
output o = q·S
"""


def test_a_program_without_a_backward_is_refused_when_it_needs_one():
    """Every gradient form refused for one reason (a param's default mixing a random draw with another param):
    the reason once, with the forms form="auto" tried."""
    rec = linrec.compile(NOISY, "noisy.lin")
    x = {k: torch.from_numpy(v) for k, v in rec.random_inputs(1, 8, 1).items()}
    with pytest.raises(linrec.LinrecError) as refused:
        lt.apply(rec, dict(x, q=x["q"].requires_grad_()), backend="numpy")
    assert str(refused.value) == (
        "error: 'noisy' has no derived backward for form 'auto', so no gradient through linrec.torch (recurrent, "
        "chunkwise, parallel: the default of param 'w' combines a random draw with another param: the gradient "
        "through it is not derived (define the draw as a param of its own)); run it under torch.no_grad(), or see "
        "`linrec check`")
    with torch.no_grad():  # (the forward alone is fine)
        lt.apply(rec, x, backend="numpy")


@pytest.mark.parametrize("name, dims, gradient_form", [("reformer", {}, "chunkwise"),
                                                       ("linformer", {"kproj": 4, "T": 16}, "parallel")])
def test_auto_backward_of_a_program_without_a_recurrent_form(name, dims, gradient_form):
    """form="auto" without a recurrent backward: the chunkwise one (Reformer), else the parallel one
    (Linformer) — on C where it builds them; autograd's gradients are Recurrence.vjp's of that form."""
    from linrec.torch import backward
    rec = linrec.load(f"examples/{name}.lin")
    assert backward.gradient_plan(rec, "auto", "c") == (gradient_form, "c")
    assert backward.gradient_plan(rec, "auto", "numpy") == (gradient_form, "numpy")
    arrays = rec.random_inputs(1, 16, 1, dims=dims or None, seed=3)
    q = torch.from_numpy(arrays["q"]).requires_grad_()
    out = lt.apply(rec, dict({k: torch.from_numpy(v) for k, v in arrays.items()}, q=q), dims=dims or None,
                   backend="numpy")
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    ones = np.ones_like(rec.run(arrays, dims=dims or None).outputs["o"])  # (the gradient of the sum)
    ref = rec.vjp(arrays, {"o": ones}, form=gradient_form, dims=dims or None)
    assert np.abs(q.grad.numpy() - ref.grads["q"]).max() <= EXACT * max(1, np.abs(ref.grads["q"]).max())


def test_auto_backward_on_c_is_the_one_measured_faster(monkeypatch):
    """form="auto"'s backward on C from 1024 tokens on: the faster of the recurrent and the chunkwise one as
    measured (gradient_choice.backward_costs, fixed here: no kernel is built); shorter calls, the NumPy backend,
    calls whose heads are not known yet and a backend without one of the two run the recurrent one unmeasured;
    a form asked for by name runs as asked."""
    from linrec.torch import backward
    gla, big = linrec.load("examples/gla.lin"), {"dk": 128, "dv": 128}
    for costs in ({"recurrent": 2.0, "chunkwise": 1.0}, {"recurrent": 1.0, "chunkwise": 2.0}):
        asked = fixed_costs(monkeypatch, costs)
        assert backward.gradient_plan(gla, "auto", "c", big, 4096, 8) == (min(costs, key=costs.get), "c")
        assert asked == [8]
    asked = fixed_costs(monkeypatch, {"recurrent": 2.0, "chunkwise": 1.0})
    assert backward.gradient_plan(gla, "auto", "c", big, 1000, 8) == ("recurrent", "c")
    assert backward.gradient_plan(gla, "auto", "numpy", big, 4096, 8) == ("recurrent", "numpy")
    assert backward.gradient_plan(gla, "auto", "c", big, 4096) == ("recurrent", "c")  # (heads not known)
    assert backward.gradient_plan(gla, "recurrent", "c", big, 4096, 8) == ("recurrent", "c")  # (asked)
    assert backward.gradient_plan(gla, "chunkwise", "c", {"dk": 8, "dv": 8}, 16) == ("chunkwise", "c")
    assert asked == []
    refused = lambda rec, form, where: None if (form, where) != ("chunkwise", "c") else "not on C"  # noqa: E731
    from linrec import gradients
    monkeypatch.setattr(backward, "gradient_refusal", refused)
    monkeypatch.setattr(gradients, "gradient_refusal", refused)  # (measured_form asks it too)
    assert backward.gradient_plan(gla, "auto", "c", big, 4096, 8) == ("recurrent", "c")
    assert asked == []


def test_a_reset_in_the_chunkwise_backward_auto_picks(monkeypatch):
    """form="auto" picks the chunkwise backward on C where it is measured faster; a reset (a log-decay of −∞, as
    at the boundary of packed documents) it once refused, so the training step failed with "use
    form='recurrent'", which the caller never chose. It takes resets now, auto's choice and a form asked for by
    name alike: the recurrent backward's gradients. (The calibration's tokens lowered and its measurement fixed
    here, so that the kernels are the small ones of the other tests.)"""
    from linrec import gradient_choice
    monkeypatch.setattr(gradient_choice, "CALIBRATION_TOKENS", 8)
    fixed_costs(monkeypatch, {"recurrent": 2.0, "chunkwise": 1.0})
    gla, dims = linrec.load("examples/gla.lin"), {"dk": 4, "dv": 4}
    x = gla.random_inputs(1, 24, 2, dims=dims, seed=1)
    x["g"][:, 10] = -np.inf
    assert gradient_choice.auto_gradient_form(gla, "c", dims, 24, 2) == "chunkwise"
    ref = gla.vjp(x, {"o": np.ones((1, 24, 2, 4))}, form="recurrent", backend="c", dims=dims)
    for form in ("auto", "chunkwise", "parallel"):
        tensors = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}
        o, _ = lt.apply(gla, **tensors, dims=dims, backend="c", form=form)
        o.sum().backward()
        assert np.all(tensors["g"].grad.numpy()[:, 10] == 0.0)
        for name, t in tensors.items():
            assert np.abs(t.grad.numpy() - ref.grads[name]).max() <= 1e-9 * max(1, np.abs(ref.grads[name]).max())


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_an_infinite_slope_on_the_way_to_a_constant_input_is_no_error(backend):
    """sqrt(abs(k)) at k = 0 with k a constant (no requires_grad): the gradients of q and v exist and are
    those of gradcheck; the backward refused them, as if k's were needed. With k requiring grad: the error."""
    rec = linrec.compile("recurrence sq(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S + sqrt(abs(k))⊗v\noutput o = q·S\n", "sq.lin")
    x = rec.random_inputs(batch=1, tokens=3, heads=1, seed=0)
    x["k"][0, 1, 0, 2] = 0.0
    k = torch.from_numpy(x["k"])
    q, v = (torch.from_numpy(x[n]).requires_grad_() for n in ("q", "v"))
    assert torch.autograd.gradcheck(lambda q, v: linrec.torch.apply(rec, q=q, k=k, v=v, backend=backend)[0], (q, v))
    with pytest.raises(linrec.RuntimeInputError, match="sqrt has no derivative at 0.*at index \\[0, 1, 0, 2\\]"):
        linrec.torch.apply(rec, q=q, k=k.clone().requires_grad_(), v=v, backend=backend)[0].sum().backward()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch.func's own)
def test_what_autograd_cannot_reach_is_refused_with_its_reason():
    """Forward mode (which would carry zero tangents through the op without a word), torch.func's transforms
    (which would fail inside torch) and a gradient of a gradient (no derived second-order backward) are
    LinrecErrors that say what to use instead, compiled or not; a first-order gradient under create_graph=True
    still works."""
    import torch.autograd.forward_ad as forward_ad

    rec = linrec.load("examples/gla.lin")
    x = {k: torch.from_numpy(v) for k, v in rec.random_inputs(1, 5, 1, dims={"dk": 4, "dv": 4}).items()}

    def o_of(q):
        return lt.apply(rec, dict(x, q=q), backend="numpy")[0]

    q, tangent = x["q"].clone(), torch.ones_like(x["q"])
    with pytest.raises(linrec.LinrecError, match="torch.func's transforms .* torch.autograd"):
        torch.func.jvp(o_of, (q,), (tangent,))
    with pytest.raises(linrec.LinrecError, match="torch.func's transforms"):
        torch.func.grad(lambda q: o_of(q).sum())(q)
    # the same where torch.compile traces the transform (its fake tensors are not functorch's wrappers), not
    # torch's error about autograd.Function's setup_context; with fullgraph=True torch.compile's error quotes
    # linrec's line that refuses it
    lt.op_for(rec)
    torch._dynamo.reset()
    with pytest.raises(linrec.LinrecError, match="torch.func's transforms"):
        torch.compile(torch.func.grad(lambda q: o_of(q).sum()), backend="eager")(q)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="torch.func's transforms .* use torch.autograd"):
        torch.compile(torch.func.grad(lambda q: o_of(q).sum()), fullgraph=True, backend="eager")(q)
    with forward_ad.dual_level():
        with pytest.raises(linrec.LinrecError, match="'q' carries a forward-mode tangent"):
            o_of(forward_ad.make_dual(q, tangent))
    q.requires_grad_(True)
    (g,) = torch.autograd.grad(o_of(q).square().sum(), q, create_graph=True)
    (plain,) = torch.autograd.grad(o_of(q).square().sum(), q)
    assert torch.equal(g.detach(), plain)
    with pytest.raises(linrec.LinrecError, match="second-order gradients through 'gla' are not derived"):
        g.square().sum().backward()


@pytest.mark.parametrize("name, form", [("gla", "chunkwise"), ("mamba2", "recurrent"), ("gated_deltanet", "auto")])
def test_gradcheck_over_packed_sequences(name, form):
    """cu_seqlens (it was refused: packed batches had no backward): one packed row [1, T_total, H, *] of
    sequences of 3, 0, 1 and 4 tokens, their initial states [N, H, *] and the params, through gradcheck on C;
    the final states come back one per sequence, the outputs those of each sequence run alone."""
    layer = layer_of(name, {"dk": 3, "dv": 2} if name != "mamba2" else {"dk": 2, "dv": 3})
    offsets = torch.tensor([0, 3, 3, 4, 8])
    x = layer.rec.random_inputs(1, 8, layer.heads, dims=layer.dims, seed=4)
    sizes = {d.name: layer.dims.get(d.name, d.default) for d in layer.rec.program.dims}
    rng = np.random.default_rng(5)
    inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}
    states = {s.name: torch.from_numpy(0.5 * rng.standard_normal((4, layer.heads, *(sizes[d] for d in s.shape))))
              .requires_grad_() for s in layer.rec.program.states}
    params = dict(layer.params.items())
    names = [*inputs, *states, *params]

    def f(*tensors):
        given = dict(zip(names, tensors))
        return call(layer, {k: given[k] for k in inputs}, {k: given[k] for k in states},
                    {k: given[k] for k in params}, form=form, cu_seqlens=offsets)

    assert torch.autograd.gradcheck(f, (*inputs.values(), *states.values(), *params.values()), eps=1e-6,
                                    atol=1e-7, rtol=1e-6)
    results = f(*inputs.values(), *states.values(), *params.values())
    alone = call(layer, {k: v[:, 4:8] for k, v in inputs.items()}, {k: v[3:4] for k, v in states.items()}, params,
                 form=form)
    assert torch.allclose(results[0][:, 4:8], alone[0], rtol=0, atol=1e-12)
    assert all(torch.allclose(a[3:4], b, rtol=0, atol=1e-12) for a, b in zip(results[1:], alone[1:]))


def test_packed_sequences_compile_whole_with_offsets_of_any_kind():
    """torch.compile(fullgraph=True) around a Layer given cu_seqlens as a tensor, a list or a NumPy array (found
    by probing: the last two failed in Dynamo, on NumPy's checks of the offsets inside apply), forward and
    backward as eager."""
    layer = lt.Layer("examples/gla.lin", heads=2, dims={"dk": 4, "dv": 4}, dtype=torch.float64)
    x = layer.rec.random_inputs(1, 12, 2, dims={"dk": 4, "dv": 4}, seed=6)
    for offsets in (torch.tensor([0, 5, 12]), [0, 5, 12], np.array([0, 5, 12])):
        results = []
        for compiled in (False, True):
            inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}

            def f(q, k, v, g):
                o, state = layer(q=q, k=k, v=v, g=g, cu_seqlens=offsets)
                return o.sum() + state["S"].sum()
            run = torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
            run(**inputs).backward()
            results.append([inputs[k].grad for k in x])
        assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(*results))


def test_auto_picks_the_backward_by_each_packed_sequences_length(monkeypatch):
    """form="auto" measures, and takes the chunkwise backward on C where it is faster, for long sequences only:
    with cu_seqlens, by the longest sequence, not by the packed row's length (found by probing: many short
    sequences took it). The calibration's tokens lowered and its measurement fixed as in
    test_a_reset_in_the_chunkwise_backward_auto_picks."""
    from linrec import gradient_choice, gradients
    monkeypatch.setattr(gradient_choice, "CALIBRATION_TOKENS", 8)
    fixed_costs(monkeypatch, {"recurrent": 2.0, "chunkwise": 1.0})
    ran = []
    vjp = gradients.vjp
    monkeypatch.setattr(gradients, "vjp", lambda *args, **kw: ran.append(kw["form"]) or vjp(*args, **kw))
    gla, dims = linrec.load("examples/gla.lin"), {"dk": 4, "dv": 4}
    x = gla.random_inputs(1, 24, 2, dims=dims, seed=1)
    for offsets, form in (([0, 4, 8, 12, 16, 20, 24], "recurrent"), ([0, 24], "chunkwise")):
        tensors = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}
        o, _ = lt.apply(gla, tensors, dims=dims, backend="c", cu_seqlens=torch.tensor(offsets))
        ran.clear()
        o.sum().backward()
        assert ran and set(ran) == {form}, (offsets, ran)


def _calls_of_the_kernel_that_keeps_states(monkeypatch) -> list:
    """A list that gets an entry per call of the fused kernel's forward that keeps the states before each chunk
    (CRecurrent.forward_snapshots): a training step's kept forward, or a backward's own."""
    from linrec.c.backend import CRecurrent
    ran, forward = [], CRecurrent.forward_snapshots

    def counted(self, *args, **kwargs):
        ran.append(1)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(CRecurrent, "forward_snapshots", counted)
    return ran


@pytest.mark.parametrize("name,form,kept", [("gla", "recurrent", 1), ("gated_deltanet", "auto", 1),
                                            ("mamba2", "recurrent", 1), ("retnet", "recurrent", 0)])
def test_a_training_step_runs_the_forward_once(monkeypatch, name, form, kept):
    """On C, the forward a training step runs (the fused recurrent kernel) keeps the states before each chunk,
    and the backward starts from them instead of running that forward again: one call of the kernel that keeps
    them per step, where there were two. RetNet's backward reads its readouts (groupnorm of q·S), which the fused
    kernel does not give: it keeps nothing, and its backward runs its own forward as before. The gradients are
    those of Recurrence.vjp (which runs its own forward), eager and under torch.compile(fullgraph=True), and
    again on a second backward through the same graph."""
    rec = linrec.load(f"examples/{name}.lin")
    dims = {d.name: 32 for d in rec.program.dims if d.name in ("dk", "dv", "dh", "d")}
    x = rec.random_inputs(1, 2048, 2, dims=dims, seed=0)  # (B·T·H·K·V past c.grad_forward.MIN_WORK)
    fixed_costs(monkeypatch, {"recurrent": 1.0, "chunkwise": 2.0})  # (auto's measurement: its runs would count)
    ran = _calls_of_the_kernel_that_keeps_states(monkeypatch)
    layer_inputs = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}
    first = rec.program.outputs[0].name

    def loss(**inputs):
        out, _ = lt.apply(rec, **inputs, form=form, backend="c", dims=dims)
        o = out if isinstance(out, torch.Tensor) else out[first]
        return (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).square().sum()

    upstream = None
    for run in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        for t in layer_inputs.values():
            t.grad = None
        ran.clear()
        value = run(**layer_inputs)
        eager = run is loss
        value.backward(retain_graph=eager)
        assert len(ran) == kept, ran  # (the forward's kernel, which the backward did not run again)
        grads = {k: t.grad.clone() for k, t in layer_inputs.items()}
        if eager:  # (the kept states are read, not written: a second backward gives the same again)
            value.backward()
            for k, t in layer_inputs.items():
                assert torch.equal(t.grad, 2 * grads[k]), k
        if upstream is None:
            with torch.no_grad():
                out, _ = lt.apply(rec, **layer_inputs, form=form, backend="c", dims=dims)
            o = (out if isinstance(out, torch.Tensor) else out[first]).numpy()
            w = np.linspace(-1, 1, o.shape[-1])
            upstream = {first: 2 * o * w * w}
        want = rec.vjp(x, upstream, form=lt.backward.gradient_plan(rec, form, "c", dims, 2048, 2)[0], backend="c",
                       dims=dims)
        for k in grads:
            assert np.max(np.abs(grads[k].numpy() - want.grads[k])) <= EXACT * np.max(np.abs(want.grads[k])), k


def test_recompute_keeps_nothing_and_gives_the_same_gradients(monkeypatch):
    """recompute=True (apply, Layer): the forward keeps no states for the backward (memory: none held until
    backward), which runs the forward again — two calls of the kernel that keeps states, where the default
    makes one — and the gradients are the same."""
    rec = linrec.load("examples/gla.lin")
    dims = {"dk": 32, "dv": 32}
    x = rec.random_inputs(1, 2048, 2, dims=dims, seed=0)
    ran = _calls_of_the_kernel_that_keeps_states(monkeypatch)
    grads = []
    for recompute in (False, True):
        leaves = {k: torch.from_numpy(v).requires_grad_() for k, v in x.items()}
        ran.clear()
        o, _ = lt.apply(rec, **leaves, form="recurrent", backend="c", dims=dims, recompute=recompute)
        kept = len(ran)
        o.square().sum().backward()
        assert (kept, len(ran)) == ((1, 1) if not recompute else (0, 1)), (recompute, kept, len(ran))
        grads.append({k: t.grad for k, t in leaves.items()})
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    layer = lt.Layer("examples/gla.lin", heads=2, dims=dims, dtype=torch.float64, recompute=True)
    ran.clear()
    o, _ = layer(**{k: torch.from_numpy(v).requires_grad_() for k, v in x.items()})
    assert ran == []  # (the Layer's forward kept nothing: its backward will run the kernel itself)


@pytest.mark.parametrize("backend, form", [("numpy", "auto"), ("numpy", "recurrent"), ("c", "chunkwise"),
                                           ("c", "parallel")])
def test_outputs_stay_free_where_no_forward_is_kept(backend, form):
    """Only the fused C forward is kept for the backward, and only then are the outputs saved with it (an output
    changed in place before backward() is then autograd's error). Elsewhere they were saved too (a probe's
    finding): changing one in place failed the backward, which never reads them."""
    rec = linrec.load("examples/gla.lin")
    arrays = rec.random_inputs(2, 8, 2, seed=2)
    grads = []
    for edit in (False, True):
        x = {n: torch.from_numpy(t).requires_grad_() for n, t in arrays.items()}
        o, _ = lt.apply(rec, x, backend=backend, form=form)
        doubled = 2 * o
        if edit:
            o.zero_()
        doubled.sum().backward()
        grads.append({n: t.grad for n, t in x.items()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
