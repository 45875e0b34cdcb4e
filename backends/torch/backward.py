"""The backward of a program's custom op: its derived vector–Jacobian product (Recurrence.vjp), itself a custom
op so that torch.compile traces a backward pass around it (autograd's formula must be traceable: it calls the
backward op, whose fake implementation gives the gradients' shapes, and never touches the tensors' memory).

    linrec::gla_<digest>_backward(Tensor in_q, …, Tensor? state_S, Tensor? cu_seqlens, Tensor? dout_o, Tensor? dstate_S,
                                  Tensor[] kept, *, SymInt[] sizes, str form, str backend, int? chunk_size,
                                  bool[] needed) -> (Tensor, …)

Its tensors: the forward op's (inputs, initial states, params, cu_seqlens), then the gradients of the forward's
results (outputs, then final states; None: zero), then `kept`: the forward's results (outputs, final states and
the kept states before each chunk, op.py) where it kept them, else none. It returns one gradient per forward
input, state and param, in the same order: an empty tensor where the forward's argument was None (autograd's
formula turns it back into None; cu_seqlens, integer offsets, has none).

Which backward runs: the gradient form of the forward's form where one is derived, else the recurrent one,
on the forward's backend when it builds that gradient, else on NumPy. form="auto": on C for 1024 tokens or more,
the faster of the recurrent and the chunkwise backward as measured once per process on the call's heads, sizes
and dtype (gradient_choice); else the recurrent one (the fastest NumPy backward at small models' sizes), and
for a program without one (Linformer, Reformer: no recurrent form) the chunkwise one, else the parallel one.
The gradients of every form agree to 1e-9 (docs/gradients.md), so the choice is one of speed only. The decode
step (form="step") is the recurrent form over its one token; for a program that reads the sequence, over the KV
cache and the token with a gradient on the last position only.
"""
from __future__ import annotations

import numpy as np
import torch

from ..api import Recurrence
from ..compiler import FORMS
from ..decode import reads_the_sequence
from ..dsl.errors import LinrecError
from .. import gradients, packed_vjp
from ..c import grad_forward
from ..gradient_choice import measured_form
from ..gradients import AUTO_ORDER, gradient_refusal
from .convert import to_array, to_tensor

STEP = "step"  # the forward op's `form` for the decode step (op.STEP)


def gradient_plan(rec: Recurrence, form: str, backend: str, dims: dict[str, int] | None = None,
                  tokens: int | None = None, heads: int | None = None, batch: int = 1,
                  dtype=np.float32) -> tuple[str, str]:
    """(gradient form, backend) of the backward of a forward call with this form and backend (and, for
    form="auto", these sizes and dtype): each form in turn, on the backend, else on NumPy — form="auto"'s
    measured faster one first where gradient_choice.measured_form gives one (on the backend only)."""
    if form == STEP:
        forms = ("recurrent",)
    elif form in FORMS:
        forms = (form, "recurrent")
    else:
        forms = AUTO_ORDER
        measured = measured_form(rec, backend, dims, tokens, heads, batch, dtype)
        if measured is not None:
            return measured, backend
    reasons = {}  # reason → the gradient forms refused for it (one reason often refuses them all)
    for gradient_form in dict.fromkeys(forms):
        for where in dict.fromkeys((backend, "numpy")):
            why = gradient_refusal(rec, gradient_form, where)
            if why is None:
                return gradient_form, where
        reasons.setdefault(why, []).append(gradient_form)  # (NumPy's reason: the backend that derives the most)
    said = "; ".join(f"{', '.join(refused)}: {why}" for why, refused in reasons.items())
    raise LinrecError(f"'{rec.name}' has no derived backward for form '{form}', so no gradient through linrec.torch "
                      f"({said}); run it under torch.no_grad(), or see `linrec check`")


def schema(rec: Recurrence, argument) -> str:
    """The backward op's schema (argument(prefix, name, index): a schema argument's name, op._argument)."""
    program = rec.program
    tensors = [f"Tensor {argument('in', x.name, i)}" for i, x in enumerate(program.inputs)]
    tensors += [f"Tensor? {argument('state', s.name, i)}" for i, s in enumerate(program.states)]
    tensors += [f"Tensor? {argument('param', p.name, i)}" for i, p in enumerate(program.params)]
    tensors.append("Tensor? cu_seqlens")  # (the forward's: packed sequences' offsets, or None)
    tensors += [f"Tensor? {argument('dout', o.name, i)}" for i, o in enumerate(program.outputs)]
    tensors += [f"Tensor? {argument('dstate', s.name, i)}" for i, s in enumerate(program.states)]
    tensors.append("Tensor[] kept")  # (the forward's results, where it kept its states for this backward)
    count = len(program.inputs) + len(program.states) + len(program.params)
    returns = "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"
    # needed: autograd's needs_input_grad, one per input, state and param (an infinite slope on the way to
    # one that needs none is no error: gradients.vjp's `wanted`)
    return f"({', '.join(tensors)}, *, SymInt[] sizes, str form, str backend, int? chunk_size, bool[] needed) -> {returns}"


def _split(program, tensors: tuple) -> tuple[tuple, tuple, tuple, torch.Tensor | None, tuple, tuple]:
    """(inputs, initial states, params, cu_seqlens, output gradients, final-state gradients)."""
    counts = [len(program.inputs), len(program.states), len(program.params), 1, len(program.outputs),
              len(program.states)]
    groups, start = [], 0
    for n in counts:
        groups.append(tuple(tensors[start:start + n]))
        start += n
    groups[3] = groups[3][0]
    return tuple(groups)


def kernel(rec: Recurrence):
    """The backward op's CPU implementation: the tensors as NumPy views, Recurrence.vjp, the gradients as
    tensors."""
    program = rec.program

    def backward_kernel(*tensors, sizes, form, backend, chunk_size, needed):
        *tensors, kept = tensors
        inputs, states, params, cu_seqlens, grad_outputs, grad_final = _split(program, tensors)
        arrays = {x.name: to_array(t) for x, t in zip(program.inputs, inputs)}
        state0 = {s.name: to_array(t) for s, t in zip(program.states, states) if t is not None}
        values = {p.name: to_array(t) for p, t in zip(program.params, params) if t is not None}
        upstream = {o.name: to_array(g) for o, g in zip(program.outputs, grad_outputs) if g is not None}
        upstream_final = {s.name: to_array(g) for s, g in zip(program.states, grad_final) if g is not None}
        dims = {d.name: int(n) for d, n in zip(program.dims, sizes)}
        first = next(iter(arrays.values()))
        tokens = first.shape[1]
        # (form="auto" picks by the length of the sequences the backward runs: with cu_seqlens, each apart)
        longest = tokens if cu_seqlens is None else int(np.diff(to_array(cu_seqlens)).max(initial=0))
        gradient_form, where = gradient_plan(rec, form, backend, dims, longest, first.shape[2], first.shape[0],
                                             first.dtype)
        if form == STEP and reads_the_sequence(rec):
            # the KV cache and the new token as one sequence: only its last position's outputs were returned
            upstream = {name: _at_last(g, tokens) for name, g in upstream.items()}
        names = [x.name for x in program.inputs] + [s.name for s in program.states] + [p.name for p in program.params]
        call = dict(grad_final_state=upstream_final, initial_state=state0 or None, params=values or None, dims=dims,
                    chunk_size=chunk_size, missing="zero", wanted=frozenset(n for n, want in zip(names, needed) if want))
        if cu_seqlens is None:
            result = gradients.vjp(rec, arrays, upstream, form=gradient_form, backend=where,
                                   saved=_saved(program, kept), **call)
        else:  # (packed sequences: each one's backward on its own slice, joined)
            result = packed_vjp.vjp_packed(rec, arrays, upstream, to_array(cu_seqlens), form=gradient_form,
                                           backend=where, **call)
        given = [*arrays.values(), *state0.values(), *values.values()]
        grads = []
        for name, t in [*((x.name, t) for x, t in zip(program.inputs, inputs)),
                        *((s.name, t) for s, t in zip(program.states, states)),
                        *((p.name, t) for p, t in zip(program.params, params))]:
            if t is None:
                grads.append(torch.empty(0, dtype=inputs[0].dtype))
                continue
            grads.append(to_tensor(np.asarray(result.grads[name], dtype=to_array(t).dtype), given))
            given.append(grads[-1].numpy())
        return grads[0] if len(grads) == 1 else tuple(grads)

    return backward_kernel


def _saved(program, kept: list) -> grad_forward.Saved | None:
    """The forward's kept results as gradients.vjp takes them (c.grad_forward.Saved), or None where it kept no
    states."""
    if not kept or not kept[-1].numel():
        return None
    arrays = [to_array(t) for t in kept]
    count = len(program.outputs)
    return grad_forward.Saved({o.name: a for o, a in zip(program.outputs, arrays)},
                              {s.name: a for s, a in zip(program.states, arrays[count:])}, arrays[-1])


def _at_last(gradient: np.ndarray, tokens: int) -> np.ndarray:
    """A gradient of the last position's outputs [B, 1, H, *], as one of the whole sequence's [B, T, H, *]."""
    whole = np.zeros(gradient.shape[:1] + (tokens,) + gradient.shape[2:], gradient.dtype)
    whole[:, -1:] = gradient
    return whole


def fake(rec: Recurrence):
    """The gradients' shapes and dtype without running the backward (for torch.compile): each that of its
    argument, an empty tensor for an argument that was None."""
    program = rec.program

    def backward_fake(*tensors, sizes, form, backend, chunk_size, needed):
        inputs, states, params, _, _, _ = _split(program, tensors[:-1])
        grads = [t.new_empty(t.shape) if t is not None else inputs[0].new_empty((0,))
                 for t in (*inputs, *states, *params)]
        return grads[0] if len(grads) == 1 else tuple(grads)

    return backward_fake


def second_order_refused(rec: Recurrence):
    """The backward op's own backward: an error that says what is missing (torch would say only that the op
    has no autograd formula). A first-order gradient under create_graph=True still works; only a gradient of
    it reaches this."""
    def refused(ctx, *grads):
        raise LinrecError(f"second-order gradients through '{rec.name}' are not derived: linrec's backward is "
                          f"not differentiable itself (loss.backward(create_graph=True), then a gradient of the "
                          f"gradients)")
    return refused


def autograd_formula(rec: Recurrence, backward_op):
    """(setup_context, backward) for register_autograd: the forward's tensors and keywords saved — and its
    results, where it kept its states for the backward (op.py) — and the cotangents of its outputs and final
    states mapped through the backward op to one gradient per tensor argument (None for an argument that was
    None or needs none)."""
    program = rec.program
    count = len(program.inputs) + len(program.states) + len(program.params)
    returned = len(program.outputs) + len(program.states)  # (the forward's results before its kept states)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        ctx.present = [t is not None for t in inputs]
        ctx.options = dict(keyword_only_inputs)
        keep = ctx.options.pop("keep")
        ctx.mark_non_differentiable(output[-1])  # (the kept states: the backward's, no result of the layer)
        # an output no loss reads gets None, not zeros: the kept states' zeros (32 MB at dk = dv = 128, T = 4096,
        # B·H = 8) cost a quarter of the forward they save; the backward op takes None as zero (missing="zero")
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*(t for t in inputs if t is not None), *(output if keep else ()))

    def backward(ctx, *grads):
        saved = list(ctx.saved_tensors)
        given = sum(ctx.present)  # (the forward's tensors come first; its results, where it kept them, after)
        arguments, kept = iter(saved[:given]), saved[given:]
        tensors = [next(arguments) if present else None for present in ctx.present]
        if not any(ctx.needs_input_grad[:count]):
            return (None,) * (count + 1)  # (one per tensor argument, cu_seqlens the last)
        found = backward_op(*tensors, *grads[:returned], kept, **ctx.options,
                            needed=list(ctx.needs_input_grad[:count]))
        if isinstance(found, torch.Tensor):
            found = (found,)
        return tuple(g if present and needed else None
                     for g, present, needed in zip(found, ctx.present, ctx.needs_input_grad)) + (None,)  # (cu_seqlens)

    return setup_context, backward
