"""vjp with cu_seqlens (backends/packed_vjp.py): packed variable-length sequences, [1, T_total, H, *] with one
initial and final state per sequence [N, H, *], empty sequences among them. Every gradient form on both
backends against central differences of the packed forward run() (its own path: serving.run_packed) at
1e-6, against each sequence's vjp alone at 1e-12 (float64), float32 within 5e-4; bad packing is refused with
the argument named."""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from linrec.gradients import derived_forms
from test_grad import worst_error

LENGTHS = [5, 0, 1, 13, 0, 7]  # (an empty sequence first among others, one of a token, two empty)
OFFSETS = np.concatenate([[0], np.cumsum(LENGTHS)])


def _packed(rec, seed=0, dtype=np.float64):
    dims = {d.name: min(d.default, 5) for d in rec.program.dims}
    rng = np.random.default_rng(seed)
    x = rec.random_inputs(1, int(OFFSETS[-1]), 2, dims=dims, seed=seed, dtype=dtype)
    s0 = {s.name: rng.standard_normal((len(LENGTHS), 2) + tuple(dims[d] for d in s.shape)).astype(dtype)
          for s in rec.program.states}
    out = rec.run(x, dims=dims, initial_state=s0, cu_seqlens=OFFSETS)
    up = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in out.outputs.items()}
    gT = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in s0.items()}
    return dims, x, s0, up, gT, out


def _directional(rec, dims, x, s0, up, gT, grads, name, value, seed=3, eps=1e-5):
    """⟨grads[name], d⟩ against the fourth-order central difference of the packed run()'s loss."""
    d = np.random.default_rng(seed).standard_normal(np.shape(value))

    def loss(step):
        args = {"x": dict(x), "s": dict(s0), "p": {}}  # (a param alone: the others' defaults, computed from it)
        where = "x" if name in x else "s" if name in s0 else "p"
        args[where][name] = value + step * eps * d
        r = rec.run(args["x"], dims=dims, initial_state=args["s"], params=args["p"], cu_seqlens=OFFSETS)
        return sum(float(np.sum(g * r.outputs[k])) for k, g in up.items()) + \
            sum(float(np.sum(g * r.final_state[k])) for k, g in gT.items())
    numeric = (8 * (loss(1) - loss(-1)) - (loss(2) - loss(-2))) / (12 * eps)
    analytic = float(np.sum(grads[name] * d))
    return abs(numeric - analytic) / max(abs(numeric), abs(analytic), 1e-12)


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "mamba2"])
def test_every_form_against_central_differences_of_the_packed_forward(name):
    rec = linrec.load(f"examples/{name}.lin")
    dims, x, s0, up, gT, out = _packed(rec)
    for backend in ("numpy", "c"):
        for form in derived_forms(rec):
            got = rec.vjp(x, up, dims=dims, initial_state=s0, grad_final_state=gT, cu_seqlens=OFFSETS, form=form,
                          backend=backend)
            assert worst_error(got.outputs, out.outputs) <= 1e-12
            assert worst_error({k: got.final_state[k] for k in s0}, {k: out.final_state[k] for k in s0}) <= 1e-12
            if (backend, form) == ("numpy", "recurrent"):
                params = dict(got.params)
                for arg, value in [*x.items(), *s0.items(), *((p.name, params[p.name]) for p in rec.program.params)]:
                    assert _directional(rec, dims, x, s0, up, gT, got.grads, arg, value) <= 1e-6, arg
                reference = got.grads
            else:
                assert worst_error(got.grads, reference) <= 1e-9, (backend, form)
    # an empty sequence's initial state passes its final state's gradient through, as it is
    for i in np.flatnonzero(np.diff(OFFSETS) == 0):
        assert all(np.array_equal(reference[k][i], gT[k][i]) for k in s0)


def test_each_sequence_alone_and_float32():
    rec = linrec.load("examples/gla.lin")
    dims, x, s0, up, gT, _ = _packed(rec, seed=1)
    packed = rec.vjp(x, up, dims=dims, initial_state=s0, grad_final_state=gT, cu_seqlens=OFFSETS, backend="c")
    for i, (start, end) in enumerate(zip(OFFSETS[:-1], OFFSETS[1:])):
        if start == end:
            continue
        alone = rec.vjp({k: v[:, start:end] for k, v in x.items()}, {k: v[:, start:end] for k, v in up.items()},
                        dims=dims, initial_state={k: v[i:i + 1] for k, v in s0.items()},
                        grad_final_state={k: v[i:i + 1] for k, v in gT.items()}, backend="c")
        assert worst_error({k: packed.grads[k][:, start:end] for k in x}, {k: alone.grads[k] for k in x}) <= 1e-12
        assert worst_error({k: packed.grads[k][i:i + 1] for k in s0}, {k: alone.grads[k] for k in s0}) <= 1e-12
    f32 = {k: {n: a.astype(np.float32) for n, a in d.items()} for k, d in (("x", x), ("s", s0), ("u", up), ("g", gT))}
    single = rec.vjp(f32["x"], f32["u"], dims=dims, initial_state=f32["s"], grad_final_state=f32["g"],
                     cu_seqlens=OFFSETS, backend="c", form="chunkwise")
    assert all(g.dtype == np.float32 for g in single.grads.values())
    assert worst_error(single.grads, packed.grads) <= 5e-4


def test_bad_packing_is_refused_with_the_argument_named():
    rec = linrec.load("examples/gla.lin")
    dims, x, s0, up, gT, _ = _packed(rec, seed=2)
    n = len(LENGTHS)
    cases = [(dict(up=dict(o=up["o"][:, :-1])), r"grad_outputs\['o'\] should have shape \[B, T, H, dv\] = \[1, 26,"),
             (dict(s0={"S": s0["S"][:-1]}), rf"initial state 'S' holds one state per sequence, \[N, H, \*\] with N = {n}"),
             (dict(gT={"S": gT["S"][:-1]}), rf"grad_final_state\['S'\] should have shape \[N, H, dk, dv\] = \[{n},"),
             (dict(x={k: np.concatenate([v, v]) for k, v in x.items()}), "one packed row"),
             (dict(offsets=OFFSETS[:-1]), "cu_seqlens must end at the packed length")]
    for change, message in cases:
        args = dict(x=x, up=up, s0=s0, gT=gT, offsets=OFFSETS) | change
        with pytest.raises(linrec.RuntimeInputError, match=message):
            rec.vjp(args["x"], args["up"], dims=dims, initial_state=args["s0"], grad_final_state=args["gT"],
                    cu_seqlens=args["offsets"])


def test_what_the_caller_passed_is_what_errors_describe():
    """Found by probing: a shape error described one sequence's slice ([1, 2, 4, 3] for initial states
    [N, H, dk, dv]; T = the first sequence's length for grad_outputs), lists were a TypeError from inside the
    packing, and an error inside one sequence's backward gave its index without saying which sequences."""
    rec = linrec.load("examples/gla.lin")
    dims, x, s0, up, gT, _ = _packed(rec, seed=3)
    n, tokens = len(LENGTHS), int(OFFSETS[-1])
    with pytest.raises(linrec.RuntimeInputError, match=rf"= \[{n}, 2, 5, 5\] but has shape \[{n}, 3, 5, 5\]"):
        rec.vjp(x, up, dims=dims, initial_state={"S": np.zeros((n, 3, 5, 5))}, cu_seqlens=OFFSETS)
    with pytest.raises(linrec.RuntimeInputError, match=rf"grad_outputs\['o'\] should have shape \[B, T, H, dv\] = "
                                                       rf"\[1, {tokens}, 2, 5\]"):
        rec.vjp(x, {"o": np.zeros((1, tokens, 3, 5))}, dims=dims, cu_seqlens=OFFSETS)
    listed = rec.vjp({k: v.tolist() for k, v in x.items()}, {k: v.tolist() for k, v in up.items()}, dims=dims,
                     cu_seqlens=OFFSETS.tolist())
    assert worst_error(listed.grads, rec.vjp(x, up, dims=dims, cu_seqlens=OFFSETS).grads) == 0.0
    sq = linrec.compile("recurrence sq(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                        "S = S + sqrt(abs(k))⊗v\noutput o = q·S\n", "sq.lin")
    y = sq.random_inputs(1, 6, 1, seed=0)
    y["k"][0, 4, 0, 2] = 0.0  # packed token 4: token 1 of sequence 1, row 1 of the sequences of 3 tokens
    with pytest.raises(linrec.RuntimeInputError, match=r"at index \[1, 1, 0, 2\] .* in the packed sequences of 3 "
                                                       r"tokens \(0, 1 of cu_seqlens, run as the rows of one batch"):
        sq.vjp(y, {"o": np.ones((1, 6, 1, 4))}, cu_seqlens=[0, 3, 6])


def test_a_packed_call_is_refused_only_what_the_same_call_unpacked_is():
    """Found by probing: an initial state the caller did not pass was handed to each length's call as zeros it
    had passed, so a gradient only there to be read — Performer's S and z, beyond float32 for these features —
    refused the packed call, which the unpacked one answers (docs/gradients.md); and a bad form or chunk size
    was said to be the packed sequences' error."""
    rec = linrec.load("examples/performer.lin")
    dims = {"dk": 16, "dv": 16, "m": 64}
    x = {k: (v * (7.0 if k in "qk" else 1.0)).astype(np.float32)
         for k, v in rec.random_inputs(1, 24, 2, dims=dims, seed=0).items()}
    up = {"o": np.ones((1, 24, 2, 16), np.float32)}
    whole = rec.vjp(x, up, dims=dims)
    assert not np.isfinite(whole.grads["S"]).all()  # (the case: a gradient beyond float32, not asked for)
    packed = rec.vjp(x, up, dims=dims, cu_seqlens=[0, 24])
    assert worst_error({k: packed.grads[k] for k in x}, {k: whole.grads[k] for k in x}) == 0.0
    with pytest.raises(linrec.RuntimeInputError, match="the gradient of 'S' is not finite"):
        rec.vjp(x, up, dims=dims, cu_seqlens=[0, 24], initial_state={"S": np.zeros((1, 2, 64, 16), np.float32)})
    gla = linrec.load("examples/gla.lin")
    dims, x, _, up, _, _ = _packed(gla, seed=5)
    for option, message in ((dict(form="bogus"), r"unknown form 'bogus'; choose one of [^—]*$"),
                            (dict(chunk_size=0), r"the chunk size must be a positive integer[^—]*$")):
        with pytest.raises(linrec.RuntimeInputError, match=message):
            gla.vjp(x, up, dims=dims, cu_seqlens=OFFSETS, **option)


def test_cu_seqlens_among_the_inputs_is_called_an_option():
    """Found by probing: cu_seqlens put into the inputs dict was only an unknown input."""
    rec = linrec.load("examples/gla.lin")
    dims, x, _, up, _, _ = _packed(rec, seed=4)
    for call in (lambda: rec.run(dict(x, cu_seqlens=OFFSETS), dims=dims),
                 lambda: rec.vjp(dict(x, cu_seqlens=OFFSETS), up, dims=dims)):
        with pytest.raises(linrec.RuntimeInputError, match=r"'cu_seqlens' is an option of the call, not an input "
                                                           r"array: pass it as cu_seqlens=…"):
            call()
    torch = pytest.importorskip("torch")
    import linrec.torch as lt
    with pytest.raises(linrec.RuntimeInputError, match=r"'cu_seqlens' is an option of apply, not an input"):
        lt.apply(rec, {k: torch.from_numpy(v) for k, v in dict(x, cu_seqlens=OFFSETS).items()}, dims=dims)


def test_the_options_told_apart_from_inputs_are_the_methods_own():
    """arrays.CALL_OPTIONS is written out (arrays lies below the API): it is the keyword options of the methods
    that take inputs, no more, no fewer."""
    from linrec import arrays
    from linrec.api import Recurrence
    methods = (Recurrence.run, Recurrence.prefill, Recurrence.vjp, Recurrence.step, Recurrence.bind_step)
    assert arrays.CALL_OPTIONS == {name for method in methods for name in arrays.keyword_options(method)}
