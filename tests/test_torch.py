"""linrec.torch: tensors through the custom op equal Recurrence.run on the same arrays (float64, both backends),
without copies; Layer's params and forward; the decode step equals the full forward; torch.compile takes a
model that uses the op whole (fullgraph); bad tensors are clear errors. Skipped without torch (CI installs it)."""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linrec  # noqa: E402
import linrec.torch as lt  # noqa: E402
from linrec.api import Recurrence  # noqa: E402

EXACT = 1e-12  # float64: the op runs the very kernel run() runs, so only a different evaluation could differ

# (file, dims, forms to compare): one of each kind — a diagonal decay, params per head and one computed from
# another, two states, the delta rule, a stabilized feature map, a group norm, attention, a non-causal program
CASES = [
    ("gla", None, ("recurrent", "chunkwise")),
    ("mamba2", None, ("recurrent",)),
    ("linear_transformer", None, ("recurrent",)),
    ("deltanet", None, ("recurrent",)),
    ("performer", {"m": 8}, ("recurrent",)),
    ("retnet", None, ("parallel",)),
    ("softmax", None, ("recurrent",)),
    ("linformer", {"kproj": 4, "T": 16}, ("parallel",)),
]
ON_C = {"gla", "mamba2", "linear_transformer", "performer", "softmax"}  # (a C kernel each, built once)
RECS: dict[str, Recurrence] = {}


def rec_of(name: str) -> Recurrence:
    if name not in RECS:
        RECS[name] = linrec.load(f"examples/{name}.lin")
    return RECS[name]


def tensors(arrays: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # (the forward alone; gradients through the op: tests/test_torch_grad.py)
        yield


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("name, dims, forms", CASES, ids=[c[0] for c in CASES])
def test_apply_equals_run(name, dims, forms, backend):
    if backend == "c" and name not in ON_C:
        pytest.skip("C kernels built for a subset (each costs a compile)")
    rec = rec_of(name)
    x = rec.random_inputs(2, 7, 3, dims=dims or {}, seed=11)
    state0 = {s.name: np.random.default_rng(5).standard_normal(
        (2, 3, *(dict({d.name: d.default for d in rec.program.dims}, **(dims or {}))[d] for d in s.shape)))
        for s in rec.program.states}
    for form in forms:
        ref = rec.run(x, form=form, backend=backend, dims=dims, initial_state=state0 or None, chunk_size=3)
        o, final = lt.apply(rec, tensors(x), form=form, backend=backend, dims=dims, chunk_size=3,
                            initial_state=tensors(state0) or None, output_final_state=True)
        outputs = o if isinstance(o, dict) else {rec.program.outputs[0].name: o}
        assert set(outputs) == set(ref.outputs) and set(final) == {s.name for s in rec.program.states}
        for k, v in outputs.items():
            assert v.dtype == torch.float64 and v.shape == ref.outputs[k].shape
            assert np.abs(v.numpy() - ref.outputs[k]).max() <= EXACT, (form, k)
        for k, v in final.items():
            assert np.abs(v.numpy() - ref.final_state[k]).max() <= EXACT, (form, k)


def test_the_return_convention():
    rec = rec_of("linear_transformer")
    x = tensors(rec.random_inputs(1, 4, 2))
    o, final = lt.apply(rec, x)
    assert isinstance(o, torch.Tensor) and final is None  # one output: the tensor (flash-linear-attention's pair)
    o, final = lt.apply(rec, x, output_final_state=True, backend="numpy")
    assert sorted(final) == ["S", "z"]
    again, _ = lt.apply(rec, {k: v[:, :2] for k, v in x.items()}, backend="numpy", output_final_state=True)
    rest, end = lt.apply(rec, {k: v[:, 2:] for k, v in x.items()}, backend="numpy", output_final_state=True,
                         initial_state=_)  # the final state dict is what initial_state takes back
    assert torch.allclose(torch.cat([again, rest], 1), o, atol=1e-5)
    two = linrec.compile("recurrence two(d = 4)\ninput x[d]\nstate S[d]\nS = S + x\noutput a = S\noutput b = 2·x\n")
    o, _ = lt.apply(two, x=torch.ones(1, 3, 2, 4), backend="numpy")
    assert sorted(o) == ["a", "b"] and float(o["a"][0, 2, 0, 0]) == 3.0 and float(o["b"][0, 0, 0, 0]) == 2.0


def test_zero_copy(monkeypatch):
    """Contiguous float tensors reach the kernel as views of their memory, and its result arrays come back as
    the tensors' memory; a non-contiguous tensor is copied once, with the same result."""
    rec = rec_of("gla")
    seen = {}
    real_run = Recurrence.run

    def spy(self, inputs=None, **options):
        result = real_run(self, inputs, **options)
        seen["inputs"] = {k: v.ctypes.data for k, v in inputs.items()}
        seen["outputs"] = {k: v.ctypes.data for k, v in result.outputs.items()}
        seen["states"] = {k: v.ctypes.data for k, v in result.final_state.items()}
        return result

    monkeypatch.setattr(Recurrence, "run", spy)
    x = tensors(rec.random_inputs(2, 8, 2, dtype=np.float32))
    o, final = lt.apply(rec, x, backend="c", output_final_state=True)
    assert seen["inputs"] == {k: v.data_ptr() for k, v in x.items()}
    assert seen["outputs"] == {"o": o.data_ptr()} and seen["states"] == {"S": final["S"].data_ptr()}

    strided = {k: v.transpose(1, 2).contiguous().transpose(1, 2) for k, v in x.items()}  # same values
    assert not strided["q"].is_contiguous()
    o2, _ = lt.apply(rec, strided, backend="c")
    assert seen["inputs"]["q"] != strided["q"].data_ptr()  # (copied)
    assert torch.equal(o2, o)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_types_are_computed_in_float32(half):
    rec = rec_of("gla")
    x = {k: v.to(half) for k, v in tensors(rec.random_inputs(1, 6, 2, dtype=np.float32)).items()}
    o, final = lt.apply(rec, x, backend="numpy", output_final_state=True)
    ref = rec.run({k: v.float().numpy() for k, v in x.items()}, backend="numpy")
    assert o.dtype == half and final["S"].dtype == torch.float32
    assert torch.equal(o, torch.from_numpy(ref.outputs["o"]).to(half))
    assert torch.equal(final["S"], torch.from_numpy(ref.final_state["S"]))


def test_layer_params_are_the_files_defaults():
    layer = lt.Layer("examples/mamba2.lin", heads=3, dtype=torch.float64)
    defaults = layer.rec.default_params(3)
    names = dict(layer.named_parameters())
    assert sorted(names) == ["params.A_log", "params.D"]  # A = −exp(A_log) is computed from A_log, not held
    for name in ("A_log", "D"):
        assert isinstance(layer.params[name], torch.nn.Parameter) and layer.params[name].shape == (3,)
        assert np.array_equal(layer.params[name].detach().numpy(), defaults[name])

    x = layer.rec.random_inputs(2, 5, 3, seed=4)
    layer.params["A_log"].copy_(torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))  # a trained value
    o, state = layer(**tensors(x))
    ref = layer.rec.run(x, backend="c", params={"A_log": np.array([0.5, 1.0, 2.0]), "D": defaults["D"]})
    assert np.abs(o.numpy() - ref.outputs["y"]).max() <= EXACT
    assert np.abs(state["S"].numpy() - ref.final_state["S"]).max() <= EXACT
    positional, _ = layer(*tensors(x).values())  # inputs in declaration order
    assert torch.equal(positional, o)


def test_layer_params_given_and_missing():
    layer = lt.Layer("examples/retnet.lin", heads=2, params={"gamma": torch.tensor([0.5, 0.25])})
    assert layer.params["gamma"].tolist() == [0.5, 0.25] and layer.params["gamma"].dtype == torch.float32
    nodefault = linrec.compile("recurrence p(d = 4)\ninput x[d]\nparam w[d]\noutput o = w·x\n")
    with pytest.raises(linrec.RuntimeInputError, match=r"parameter 'w' of 'p' has no default; pass its initial"):
        lt.Layer(nodefault, heads=2)


def test_a_param_only_given_params_read_is_not_held():
    """Mamba-2 with A given: A_log, which only A's default reads, is not held (it would get gradient 0); A is
    held and trained, and the Layer runs as linrec.run with that A."""
    layer = lt.Layer("examples/mamba2.lin", heads=2, params={"A": torch.tensor([-0.5, -2.0])},
                     dtype=torch.float64)
    assert sorted(dict(layer.named_parameters())) == ["params.A", "params.D"]
    x = layer.rec.random_inputs(1, 6, 2, seed=3)
    with torch.enable_grad():  # (this module's tests run under no_grad)
        o, _ = layer(**tensors(x))
        o.sum().backward()
    ref = layer.rec.run(x, backend="c", params={"A": np.array([-0.5, -2.0]),
                                                "D": layer.params["D"].detach().numpy()})
    assert np.abs(o.detach().numpy() - ref.outputs["y"]).max() <= EXACT
    assert float(layer.params["A"].grad.abs().min()) > 0
    # given both, both are held, as given (A_log then reads nothing)
    both = lt.Layer("examples/mamba2.lin", heads=2, params={"A": torch.tensor([-0.5, -2.0]),
                                                           "A_log": torch.zeros(2)})
    assert sorted(both.params) == ["A", "A_log", "D"]


def test_a_layers_arguments_are_checked_where_it_is_made():
    rec = rec_of("mamba2")
    for kwargs, message in [
        (dict(heads=0), r"heads must be a positive integer \(the H of \[B, T, H, \*\]\), got 0"),
        (dict(heads=2.0), "heads must be a positive integer"),
        (dict(heads=2, form="bogus"), "unknown form 'bogus'; choose one of auto, recurrent"),
        (dict(heads=2, backend="cuda"), "unknown backend 'cuda'"),
        (dict(heads=2, params={"a_log": torch.zeros(2)}), r"unknown parameter\(s\) 'a_log'; the parameters "
                                                           r"of 'mamba2' are A_log"),
        (dict(heads=2, params={"A_log": torch.zeros(3)}), r"params\['A_log'\] has shape \[3\], but 'A_log' is "
                                                           r"\[H\] \(heads = 2\)"),
        (dict(heads=2, params={"D": 0.5}), r"params\['D'\] has shape \[\], but 'D' is \[H\]"),
        (dict(heads=2, params={"D": "x"}), r"params\['D'\] is a str that holds no numbers"),
    ]:
        with pytest.raises(linrec.LinrecError, match=message):
            lt.Layer(rec, **kwargs)


def test_a_layer_copies_pickles_and_saves_whole(tmp_path):
    """copy.deepcopy (an EMA of the weights), pickle and torch.save of the whole module: the copy holds the
    program as its source, compiled again, and computes what the original does."""
    import copy
    import pickle

    layer = lt.Layer(rec_of("gla"), heads=2, dtype=torch.float64)
    x = tensors(layer.rec.random_inputs(1, 5, 2, seed=4))
    want, _ = layer(**x)
    torch.save(layer, tmp_path / "layer.pt")
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer)),
                  torch.load(tmp_path / "layer.pt", weights_only=False)):
        assert other.rec is not layer.rec and other.rec.compiled.source == layer.rec.compiled.source
        got, _ = other(**x)
        assert torch.equal(got, want)


def test_a_copied_layer_compiles_whole():
    """A deepcopy or an unpickled Layer, whose program's op another Recurrence of the same source registered
    first: the copy kept that op, its own program was never registered, and torch.compile(fullgraph=True)
    refused the registration inside the graph (a probe's finding). A copy registers its own program, as __init__
    does, and compiles whole."""
    import copy
    import pickle

    lt.Layer("examples/gla.lin", heads=2)  # (the first of this source: the op's registrant)
    x = {n: torch.randn(2, 5, 2, 16, generator=torch.Generator().manual_seed(i)) for i, n in enumerate("qkvg")}
    x["g"] = -x["g"].abs()
    original = lt.Layer("examples/gla.lin", heads=2)
    want, _ = original(**x)
    for other in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        torch._dynamo.reset()
        got, _ = torch.compile(other, fullgraph=True, backend="aot_eager")(**x)
        assert torch.equal(got, want)


@pytest.mark.parametrize("name, dims, backend", [("gla", None, "c"), ("performer", {"m": 8}, "c"),
                                                 ("linear_transformer", None, "numpy"), ("softmax", None, "c"),
                                                 ("softmax", None, "numpy")])
def test_decode_step_equals_the_full_forward(name, dims, backend):
    """A prompt, then one token at a time with the state (the decode step; softmax: its KV cache), equals one
    forward pass over all the tokens: outputs and final state."""
    layer = lt.Layer(rec_of(name), heads=2, dims=dims, dtype=torch.float64, backend=backend)
    x = tensors(layer.rec.random_inputs(2, 7, 2, dims=dims or {}, seed=3))
    full, end = layer(**x)
    o, state = layer(**{k: v[:, :3] for k, v in x.items()})
    outputs = [o]
    for t in range(3, 7):
        o, state = layer(**{k: v[:, t:t + 1] for k, v in x.items()}, state=state)
        outputs.append(o)
    assert (torch.cat(outputs, 1) - full).abs().max() <= EXACT
    assert sorted(state) == sorted(end) and all((state[k] - end[k]).abs().max() <= EXACT for k in end)


def test_apply_refuses_an_initial_state_for_a_program_that_reads_the_sequence():
    """Softmax attention's state is its KV cache, the inputs so far: its final state from apply is {}, which
    handed back as initial_state restarted attention from no context, silently (a probe's finding). It is
    refused; the decode step over the inputs so far is the continuation."""
    rec = rec_of("softmax")
    x = tensors(rec.random_inputs(1, 12, 2, seed=0))
    full, final = lt.apply(rec, x, output_final_state=True)
    assert final == {}
    with pytest.raises(linrec.LinrecError, match=r"KV cache.*initial_state cannot carry.*linrec\.torch\.Layer"):
        lt.apply(rec, {k: v[:, 7:] for k, v in x.items()}, initial_state=final)
    last, _ = lt.apply(rec, {k: v[:, :8] for k, v in x.items()}, form="step")
    assert (last - full[:, 7:8]).abs().max() <= EXACT


def test_apply_gives_advice_for_the_options_it_spells_otherwise():
    """flash-linear-attention's `scale=` and `head_first=` given to apply were taken for unknown inputs: the
    error now says where linrec keeps the scale (the program) and which layout it takes."""
    rec = rec_of("gla")
    x = tensors(rec.random_inputs(1, 4, 2, seed=0))
    with pytest.raises(linrec.RuntimeInputError, match=r"apply\(\) has no option scale=: the scale is part of the "
                                                       r"program"):
        lt.apply(rec, x, scale=0.125)
    with pytest.raises(linrec.RuntimeInputError, match=r"apply\(\) has no option head_first=: .*\[B, T, H, \*\]"):
        lt.apply(rec, x, head_first=False)


def test_torch_compile_fullgraph():
    """A model around the op compiles whole (fullgraph=True fails on any graph break) and computes what the
    eager model computes."""
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4 * 2 * 16)
            self.gla = lt.Layer("examples/gla.lin", heads=2)

        def forward(self, x):  # x: [B, T, 8]
            q, k, v, g = self.proj(x).unflatten(-1, (4, 2, 16)).unbind(2)
            o, state = self.gla(q=q, k=k, v=v, g=-torch.nn.functional.softplus(g))
            return o.sum(-1) + state["S"].mean()

    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(2, 5, 8)
    graphs = []

    def recording(graph, example_inputs):  # aot_eager: traces the op's fake implementation, runs eagerly
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=recording)
    assert torch.allclose(compiled(x), model(x), atol=1e-5)
    assert len(graphs) == 1
    ops = [str(node.target) for node in graphs[0].graph.nodes if "linrec" in str(node.target)]
    assert ops == [model.gla.op.name.replace("::", ".") + ".default"]  # the op, one node


def test_torch_export_keeps_no_forward_for_a_backward():
    """torch.export with grad mode on (a module's weights require grad) recorded keep=True in the graph, so every
    run of the exported program kept a forward no backward reads (a probe's finding). It records keep=False; the
    exported module computes the model's outputs, and its gradients (the backward running its own forward)."""
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 4 * 2 * 16)
            self.gla = lt.Layer("examples/gla.lin", heads=2)

        def forward(self, x):
            q, k, v, g = self.proj(x).unflatten(-1, (4, 2, 16)).unbind(2)
            o, _ = self.gla(q=q, k=k, v=v, g=-torch.nn.functional.softplus(g))
            return o

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 5, 8, requires_grad=True)
    upstream = torch.randn(2, 5, 2, 16)
    with torch.enable_grad():  # (this module's tests run under no_grad)
        exported = torch.export.export(model, (x,))
        calls = [node for node in exported.graph.nodes if "linrec" in str(node.target)]
        assert len(calls) == 1 and calls[0].kwargs["keep"] is False
        want_out = model(x)
        want = torch.autograd.grad(want_out, (x, model.proj.weight), upstream)
        module = exported.module()
        got_out = module(x)
        got = torch.autograd.grad(got_out, (x, module.proj.weight), upstream)
    assert torch.allclose(got_out, want_out, atol=1e-5)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-4)


def test_compiling_before_the_op_is_registered():
    """A program's op is registered on its first call, which no graph holds: torch.compile breaks the graph
    there (and computes what eager does), and with fullgraph=True its error says to register first — Dynamo's
    own hint, to remove the torch.compiler.disable, points the wrong way."""
    x = tensors(rec_of("gla").random_inputs(1, 4, 2, dims={"dk": 4, "dv": 4}, seed=1))

    def loss(rec):
        return lambda q: lt.apply(rec, dict(x, q=q), backend="numpy")[0].sum()

    torch._dynamo.reset()
    fresh = linrec.load("examples/gla.lin")  # (not registered yet: ops are found by Recurrence)
    assert torch.allclose(torch.compile(loss(fresh), backend="eager")(x["q"]), loss(fresh)(x["q"]))
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"call linrec\.torch\.op_for\(rec\)"):
        torch.compile(loss(linrec.load("examples/gla.lin")), fullgraph=True, backend="eager")(x["q"])


def test_errors_name_the_argument_and_the_fix():
    rec = rec_of("gla")
    x = tensors(rec.random_inputs(1, 4, 2, dtype=np.float32))

    def error(**change):
        given = dict(x)
        options = {k: change.pop(k) for k in ("initial_state", "params", "dims") if k in change}
        given.update(change)
        with pytest.raises(linrec.LinrecError) as err:
            lt.apply(rec, given, backend="numpy", **options)
        return str(err.value)

    assert "input 'q' is on device 'meta'" in error(q=x["q"].to("meta")) and ".cpu()" in error(q=x["q"].to("meta"))
    assert "input 'k' has dtype torch.int64; pass float32 or float64" in error(k=x["k"].long())
    assert "input 'v' is a ndarray, not a torch.Tensor" in error(v=x["v"].numpy())
    assert "input 'q' should have shape [B, T, H, dk] but has shape [1, 4, 2]" in error(q=x["q"][..., 0])
    assert "input 'v' has [B, T, H] = [1, 3, 2] but 'q' has [1, 4, 2]" in error(v=x["v"][:, :3])
    assert "input 'k' [B, T, H, dk] has dk = 8, but dk = 16 elsewhere" in error(k=x["k"][..., :8])
    assert "input 'k' is torch.float64 but 'q' is torch.float32" in error(k=x["k"].double())
    assert "unknown input(s) 'z'" in error(z=x["q"])
    assert "initial state 'S' should have shape [B, H, dk, dv]" in error(initial_state={"S": torch.zeros(2, 16, 16)})
    assert "unknown initial state(s) 'T'" in error(initial_state={"T": torch.zeros(1)})
    assert "dims has dk = 8, but dk = 16 elsewhere" in error(dims={"dk": 8})
    assert "initial_state is a Tensor; pass a dict by name, e.g. initial_state={'S': ...}" in \
        error(initial_state=torch.zeros(1, 2, 16, 16))
    with pytest.raises(linrec.LinrecError, match="unknown form 'fast'"):
        lt.apply(rec, x, form="fast")
    with pytest.raises(linrec.LinrecError, match="unknown backend None; choose one of numpy, c"):
        lt.apply(rec, x, backend=None)
    with pytest.raises(linrec.RuntimeInputError, match=r"input\(s\) 'q' given twice"):
        lt.apply(rec, x, q=2 * x["q"])
    with pytest.raises(linrec.RuntimeInputError, match="cu_seqlens must be an integer tensor"):
        lt.apply(rec, x, cu_seqlens=torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(linrec.RuntimeInputError, match="with cu_seqlens the inputs are one packed row"):
        lt.apply(rec, {k: torch.cat([v, v]) for k, v in x.items()}, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(linrec.RuntimeInputError, match=r"initial state 'S' should have shape \[N, H, dk, dv\]"):
        lt.apply(rec, x, initial_state={"S": torch.zeros(1, 2, 16, 16)}, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(linrec.RuntimeInputError, match="cu_seqlens must end at the packed length"):
        lt.apply(rec, x, cu_seqlens=torch.tensor([0, 2, 3]), backend="numpy")
    with pytest.raises(linrec.RuntimeInputError, match="form='step' runs one token"):
        lt.apply(rec, x, cu_seqlens=torch.tensor([0, 2, 4]), form="step")
    empty = {k: v[:, :0] for k, v in x.items()}  # (as run() says it, not "[B, T, H] = [1, 0, 2]")
    with pytest.raises(linrec.RuntimeInputError, match="every sequence in cu_seqlens is empty"):
        lt.apply(rec, empty, cu_seqlens=torch.tensor([0, 0, 0]))
    with pytest.raises(linrec.RuntimeInputError, match=r"input 'g' must lie in \(-inf, 0\]"):
        lt.apply(rec, dict(x, g=x["g"].abs() + 1), backend="numpy")  # the kernel's own checks still apply


def test_a_kv_cache_that_does_not_fit_the_tokens_is_an_error():
    layer = lt.Layer(rec_of("softmax"), heads=2, backend="numpy")
    x = tensors(layer.rec.random_inputs(1, 4, 2, dtype=np.float32))
    _, cache = layer(**x)
    with pytest.raises(linrec.RuntimeInputError, match=r"the KV cache's 'k' is torch.float32 \[1, 4, 2, 16\] and "
                                                       r"the new tokens' torch.float32 \[1, 1, 3, 16\]"):
        layer(q=x["q"][:, :1], k=torch.zeros(1, 1, 3, 16), v=x["v"][:, :1], state=cache)
    with pytest.raises(linrec.RuntimeInputError, match=r"holds its inputs by name \(k, q, v\); it has k, q"):
        layer(**{k: v[:, :1] for k, v in x.items()}, state={"q": cache["q"], "k": cache["k"]})


def test_first_use_from_several_threads_at_once():
    """Threads making their first call of one program's op at once (each its own Recurrence of the same
    source) all get its outputs: two that registered the op at once had torch destroy the first's library
    ("Library object has been destroyed"), for 0 to 3 of 4 threads. A program of its own, so that no test
    before has registered it; a barrier lines the threads up."""
    with open("examples/linear_transformer.lin", encoding="utf-8") as file:
        source = file.read() + "# first use from threads\n"
    recs = [linrec.compile(source) for _ in range(4)]
    x = recs[0].random_inputs(1, 8, 2, seed=0)
    (want,) = recs[0].run(x).outputs.values()
    tensors = {k: torch.from_numpy(v) for k, v in x.items()}
    barrier, results, errors = threading.Barrier(len(recs)), {}, []

    def first_call(i):
        barrier.wait()
        try:
            results[i] = lt.apply(recs[i], tensors)[0]  # (one output: the tensor)
        except Exception as error:  # reported below, with the thread's number
            errors.append((i, repr(error)))

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(len(recs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == len(recs)
    for o in results.values():
        assert np.abs(o.numpy() - want).max() <= EXACT * np.abs(want).max()


def test_layer_refuses_what_it_would_have_run_wrong():
    """Three calls a Layer ran without a word, each now a clear error: an input given both positionally and by
    keyword (the keyword won, and the positional after it moved up a place); inputs with another H than the
    Layer's heads (a program without per-head params ran on them); inputs of another size than the one its
    params' initial values were computed at (preconditioned DeltaNet's c = −log(dk) at the file's dk = 16, on
    inputs of dk = 4: 0.05 off apply's output)."""
    gla = lt.Layer("examples/gla.lin", heads=2, dims={"dk": 3, "dv": 4})
    x = {k: torch.from_numpy(v).float() for k, v in gla.rec.random_inputs(1, 4, 2, dims=gla.dims).items()}
    with pytest.raises(linrec.LinrecError, match="'q' given twice, positionally"):
        gla(x["q"], q=x["q"], k=x["k"], v=x["v"], g=x["g"])
    wider = {k: torch.from_numpy(v).float() for k, v in gla.rec.random_inputs(1, 4, 5, dims=gla.dims).items()}
    with pytest.raises(linrec.LinrecError, match="has heads=2, but its inputs have H = 5"):
        gla(**wider)
    path = "examples/preconditioned_deltanet.lin"
    x = {k: torch.from_numpy(v) for k, v in linrec.load(path).random_inputs(1, 6, 2, dims={"dk": 4, "dv": 4},
                                                                            seed=0).items()}
    with pytest.raises(linrec.LinrecError, match=r"initial values of 'c' at dk = 16 .* dims=\{'dk': 4\}"):
        lt.Layer(path, heads=2, dtype=torch.float64)(**x)
    layer = lt.Layer(path, heads=2, dims={"dk": 4}, dtype=torch.float64)
    assert torch.allclose(layer(**x)[0], lt.apply(layer.rec, x)[0], rtol=0, atol=1e-12)
    with pytest.raises(linrec.LinrecError, match="chunk size must be a positive integer"):
        lt.Layer(path, heads=2, chunk_size=0)  # (when made, not at the first forward)


def test_layer_says_what_is_wrong_with_its_state_params_and_dtype():
    """A softmax Layer's state (its KV cache) that is no dict was torch's "Boolean value of Tensor … ambiguous",
    a join's TypeError, or silently no cache; zero new tokens after a cache gave back the cached tokens' outputs
    as the new ones; a param named like a ParameterDict attribute, or an integer dtype, was torch's error from
    inside Layer(...). Each is linrec's error now."""
    attention = lt.Layer("examples/softmax.lin", heads=2, dims={"dk": 3, "dv": 3})
    x = {k: torch.from_numpy(v).float() for k, v in attention.rec.random_inputs(2, 4, 2, dims=attention.dims).items()}
    _, cache = attention(**x)
    for wrong in (torch.ones(1), torch.ones(2, 3), [cache["q"]]):
        with pytest.raises(linrec.LinrecError, match="state is a .*; the state of 'softmax' is its KV cache"):
            attention(**x, state=wrong)
    with pytest.raises(linrec.LinrecError, match=r"no new tokens \(T = 0\)"):
        attention(**{k: v[:, :0] for k, v in x.items()}, state=cache)
    named = linrec.compile("recurrence p(dk = 2, dv = 2)\ninput q[dk], k[dk], v[dv]\nparam type per head = 0.5\n"
                           "state S[dk, dv]\nS = type·S + k⊗v\noutput o = q·S\n")
    with pytest.raises(linrec.LinrecError, match="parameter 'type' .* rename it in the program"):
        lt.Layer(named, heads=2)
    with pytest.raises(linrec.LinrecError, match="dtype must be a floating-point torch.dtype"):
        lt.Layer("examples/gla.lin", heads=2, dtype=torch.int32)


def test_layer_errors_name_what_the_caller_wrote():
    """Found by probing: a Layer's state= that is no dict was reported as `initial_state is a Tensor`, an
    argument the caller never wrote; a Layer made at the file's default sizes, given inputs of another dk,
    blamed a parameter 'W' the caller never passed (Performer's W [m, dk], held at dk = 16) without saying to
    make the Layer with dims=; a nested tensor got torch's "Internal error: NestedTensorImpl doesn't support
    sizes"."""
    gla = lt.Layer("examples/gla.lin", heads=2, dims={"dk": 3, "dv": 4})
    x = {k: torch.from_numpy(v).float() for k, v in gla.rec.random_inputs(2, 5, 2, dims=gla.dims).items()}
    with pytest.raises(linrec.LinrecError, match=r"^error: state is a Tensor; pass the states by name, .* "
                                                 r"state=\{'S': \.\.\.\}"):
        gla(**x, state=torch.zeros(2, 2, 3, 4))
    performer = lt.Layer("examples/performer.lin", heads=2)
    y = {k: torch.from_numpy(v) for k, v in performer.rec.random_inputs(1, 4, 2, dims={"dk": 8, "dv": 16},
                                                                        dtype=np.float32).items()}
    with pytest.raises(linrec.LinrecError, match=r"holds 'W' at dk = 16 \(the file's default size, as no dims= "
                                                 r"gave it\), but input 'q' has dk = 8: make the Layer with "
                                                 r"dims=\{'dk': 8\}"):
        performer(**y)
    with warnings.catch_warnings():  # ("the PyTorch API of nested tensors is in prototype stage")
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([x["q"][0], x["q"][1]])  # (layout strided; jagged's is refused as such)
    with pytest.raises(linrec.LinrecError, match="input 'q' is a nested tensor; pass a dense one"):
        lt.apply(gla.rec, dict(x, q=nested), dims=gla.dims)
