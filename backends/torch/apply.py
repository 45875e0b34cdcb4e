"""linrec.torch.apply: a program on CPU tensors, through its custom op.

The arguments are checked here, in plain Python over shapes and dtypes, so that torch.compile traces the
checks (they become guards) and the graph holds the op itself: one node, with the dtype conversions and
contiguous copies (when there are any) as ordinary tensor operations beside it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C._functorch import is_functorch_wrapped_tensor, maybe_current_level

from .. import serving
from ..api import Recurrence
from ..arrays import (check_chunk_size, checked_sizes, keyword_options, refuse_given_twice,
                      refuse_other_libraries_options, unknown_form)
from ..compiler import FORMS
from ..decode import reads_the_sequence
from ..dsl.errors import LinrecError, RuntimeInputError
from ..registry import backend as known_backend
from .backward import gradient_plan
from .convert import WIDENED, checked_tensor
from .op import STEP, op_for

FORMS_TAKEN = ("auto", *FORMS, STEP)


def apply(rec: Recurrence, inputs: dict | None = None, *, initial_state: dict | None = None,
          output_final_state: bool = False, form: str = "auto", backend: str = "c", params: dict | None = None,
          dims: dict[str, int] | None = None, chunk_size: int | None = None, cu_seqlens=None,
          recompute: bool = False, **named_inputs):
    """Run `rec` on CPU tensors: inputs [B, T, H, *] by DSL name (a dict, keywords, or both), float32 or
    float64 (bfloat16 and float16 are computed in float32 and the outputs converted back); initial states
    [B, H, *] by name (zeros when absent); params override the file's defaults (per-head ones [H, *]).

    Returns (o, final_state), flash-linear-attention's pair: `o` is the output tensor [B, T, H, *] when the
    program has one output, else a dict of them by name; `final_state` is None unless output_final_state,
    then a dict of the final states [B, H, *] by name (what `initial_state` takes back). form="step" is the
    decode step: one token (T = 1) from `initial_state`; for a program that reads the sequence (softmax
    attention), whose state is its KV cache, the inputs so far and the new token as one sequence, its last
    position's outputs returned; such a program takes no initial_state (linrec.torch.Layer keeps the cache).
    `cu_seqlens` (an integer tensor [N + 1]): packed
    variable-length sequences, flash-linear-attention's convention — the inputs one row [1, T_total, H, *],
    the initial and final states one per sequence [N, H, *] — with gradients (linrec.packed_vjp).
    `recompute=True`: the backward runs the forward again instead of keeping its states until then (less
    memory, one more forward per training step; docs/torch.md, "The forward kept for the backward")."""
    op = op_for(rec)
    program = rec.program
    if form not in FORMS_TAKEN:
        raise RuntimeInputError(unknown_form(form, FORMS_TAKEN))
    known_backend(backend)  # (before the op's schema meets a value that is no backend's name)
    check_chunk_size(chunk_size)
    offsets = _offsets(cu_seqlens, form)
    if initial_state is not None and reads_the_sequence(rec):
        # (what output_final_state gives such a program, its recurrent states alone — {} for softmax attention —
        # handed back here would restart attention from no context, silently)
        raise RuntimeInputError(f"'{rec.name}' reads the sequence (as softmax attention does): its state is its KV "
                                f"cache, the inputs so far, which initial_state cannot carry; to continue a sequence "
                                f"pass the inputs so far and the new tokens together (form='step' for one new token: "
                                f"its outputs alone), or use linrec.torch.Layer, which keeps the cache")
    given = _by_name(inputs, "inputs", program.inputs)
    refuse_given_twice(given, named_inputs)
    refuse_other_libraries_options(program, named_inputs, "apply")
    given |= named_inputs
    tensors = _named(program.inputs, given, "input", "inputs", required=True)
    states = _named(program.states, _by_name(initial_state, "initial_state", program.states), "initial state",
                    "states")
    values = _named(program.params, _by_name(params, "params", program.params), "parameter", "parameters")

    first = program.inputs[0].name
    dtype = tensors[first].dtype
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise RuntimeInputError(f"input '{name}' is {t.dtype} but '{first}' is {dtype}; pass every input in "
                                    f"one dtype")
    sizes = _sizes(program, tensors, states, values, dims, None if offsets is None else offsets.shape[0] - 1)
    _refuse_other_transforms([tensors, states, values])
    _check_differentiable(rec, form, backend, [tensors, states, values])

    computed = WIDENED.get(dtype, dtype)  # (a copy for half types; .to() and .contiguous() are no-ops else)
    outputs, finals = op([_ready(tensors[x.name], computed) for x in program.inputs],
                         [_ready(states.get(s.name), computed) for s in program.states],
                         [_ready(values.get(p.name), computed) for p in program.params], offsets,
                         [sizes[d.name] for d in program.dims], form, backend, chunk_size,
                         keep_allowed=not recompute)
    if computed != dtype:
        outputs = [o.to(dtype) for o in outputs]
    o = outputs[0] if len(outputs) == 1 else {out.name: t for out, t in zip(program.outputs, outputs)}
    final = {s.name: t for s, t in zip(program.states, finals)} if output_final_state else None
    return o, final


def _offsets(cu_seqlens, form: str) -> torch.Tensor | None:
    """cu_seqlens as the op takes it: a CPU int64 tensor [N + 1] (its values are checked where the op runs, as
    Recurrence.run checks them: serving.check_cu_seqlens), or None."""
    if cu_seqlens is None:
        return None
    if form == STEP:
        raise RuntimeInputError("form='step' runs one token of each row of [B, H, *] states, which cu_seqlens "
                                "does not pack: decode each sequence's token as a row")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise RuntimeInputError(f"cu_seqlens is on device '{cu_seqlens.device}'; move it to the CPU (.cpu())")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise RuntimeInputError(f"cu_seqlens must be an integer tensor [N + 1] of offsets, got {cu_seqlens.dtype}")
        offsets = cu_seqlens
    elif torch.compiler.is_compiling():  # (a list's values are constants to it; NumPy's checks are not traced)
        offsets = torch.as_tensor(cu_seqlens)
        if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise RuntimeInputError(f"cu_seqlens must be an integer tensor [N + 1] of offsets, got {offsets.dtype}")
    else:
        offsets = torch.as_tensor(serving.check_cu_seqlens(cu_seqlens))
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise RuntimeInputError(f"cu_seqlens must be a 1-D tensor [N + 1] of at least 2 offsets, got shape "
                                f"{list(offsets.shape)}")
    return offsets.to(torch.int64).contiguous()


def _ready(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor as the op takes it: in the computed dtype, C-contiguous. Both are the tensor itself when it
    is so already (zero-copy); a non-contiguous tensor is copied, once."""
    return None if tensor is None else tensor.to(dtype).contiguous()


def _by_name(given, argument: str, declared) -> dict:
    """A dict argument (inputs, initial_state, params) as a dict; a bare tensor is an error that shows the
    dict to pass (flash-linear-attention passes its one state as a tensor; linrec names every state)."""
    if given is None:
        return {}
    if not isinstance(given, (Mapping, torch.nn.ParameterDict)):
        names = [d.name for d in declared]
        example = f"{{'{names[0]}': ...}}" if names else "{}"
        raise RuntimeInputError(f"{argument} is a {type(given).__name__}; pass a dict by name, e.g. "
                                f"{argument}={example} (the names: {', '.join(names) or 'none'})")
    return dict(given)


def _named(declared, given: dict, what: str, plural: str, required: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of one kind (inputs, initial states, params) by name, checked: no unknown names, none
    missing when `required`, each a float tensor on the CPU."""
    names = [d.name for d in declared]
    unknown = sorted(set(given) - set(names))
    options = [name for name in unknown if name in keyword_options(apply)] if what == "input" else []
    if options:  # (an option put among the inputs)
        raise RuntimeInputError(f"'{options[0]}' is an option of apply, not an input: pass it as {options[0]}=…, "
                                f"beside the inputs (the inputs of this program are {', '.join(names)})")
    if unknown:
        raise RuntimeInputError(f"unknown {what}(s) {', '.join(map(repr, unknown))}; the {plural} of this program "
                                f"are {', '.join(names) or 'none'}")
    out = {}
    for d in declared:
        if d.name in given and given[d.name] is not None:
            out[d.name] = checked_tensor(d.name, given[d.name], what)
        elif required:
            raise RuntimeInputError(f"missing {what} '{d.name}' (expected shape {_label('[B, T, H', d.shape)})")
    return out


def _label(lead: str, dims) -> str:
    return lead + "".join(", " + d for d in dims) + "]"


def _sizes(program, inputs: dict, states: dict, params: dict, asked: dict | None,
           sequences: int | None = None) -> dict[str, int]:
    """Every dimension's size for this call, from the shapes (plain ints, which torch.compile guards on): the
    inputs' first, then `dims`, the initial states', the params', and the file's defaults. A shape that does
    not fit the declarations or the other arguments is an error naming the argument."""
    sizes: dict[str, int] = {}
    lead = None
    for x in program.inputs:
        shape = tuple(inputs[x.name].shape)
        expected = _label("[B, T, H", x.shape)
        if len(shape) != 3 + len(x.shape):
            raise RuntimeInputError(f"input '{x.name}' should have shape {expected} but has shape {list(shape)}")
        if lead is None:
            lead, first = shape[:3], x.name
        elif shape[:3] != lead:
            raise RuntimeInputError(f"input '{x.name}' has [B, T, H] = {list(shape[:3])} but '{first}' has "
                                    f"{list(lead)}")
        _bind(sizes, x.shape, shape[3:], f"input '{x.name}' {expected}")
    if sequences is not None and lead[1] == 0 and min(lead[0], lead[2]) >= 1:  # (offsets that end at T_total = 0)
        raise RuntimeInputError("every sequence in cu_seqlens is empty (the packed inputs have T_total = 0 tokens): a "
                                "packed call needs at least one token; skip the call until a sequence has a token")
    if min(lead) < 1:
        raise RuntimeInputError(f"[B, T, H] = {list(lead)}: every size must be at least 1")
    for name, n in checked_sizes(program, asked).items():
        _bind(sizes, (name,), (n,), "dims")
    batch, heads = lead[0], lead[2]
    if sequences is not None and batch != 1:
        raise RuntimeInputError(f"with cu_seqlens the inputs are one packed row [1, T_total, H, *], got batch size "
                                f"{batch}; concatenate the sequences along the token axis")
    rows, label = (batch, "[B, H") if sequences is None else (sequences, "[N, H")
    for s in program.states:
        if s.name in states:
            _bind_whole(sizes, f"initial state '{s.name}'", _label(label, s.shape), (rows, heads), s.shape,
                        tuple(states[s.name].shape))
    for p in program.params:
        if p.name in params:
            label = _label("[H", p.shape) if p.per_head else "[" + ", ".join(p.shape) + "]"
            _bind_whole(sizes, f"parameter '{p.name}'", label, (heads,) if p.per_head else (), p.shape,
                        tuple(params[p.name].shape))
    for d in program.dims:
        sizes.setdefault(d.name, d.default)
    return sizes


def _bind_whole(sizes: dict, where: str, label: str, lead: tuple, dims: tuple, shape: tuple) -> None:
    """A state's or param's shape: its leading sizes (B, H or H) as the inputs', its dimensions as bound."""
    if len(shape) != len(lead) + len(dims) or shape[:len(lead)] != lead:
        raise RuntimeInputError(f"{where} should have shape {label} (with {list(lead)} from the inputs) but has "
                                f"shape {list(shape)}")
    _bind(sizes, dims, shape[len(lead):], f"{where} {label}")


def _bind(sizes: dict, dims: tuple, actual: tuple, where: str) -> None:
    for d, n in zip(dims, actual):
        if n < 1:
            raise RuntimeInputError(f"{where} has {d} = {n}; every size must be at least 1")
        if sizes.get(d, n) != n:
            raise RuntimeInputError(f"{where} has {d} = {n}, but {d} = {sizes[d]} elsewhere (from the inputs or "
                                    f"dims)")
        sizes[d] = n


TRANSFORMS_REFUSED = ("torch.func's transforms (grad, vmap, jvp, jacrev, …) do not reach linrec's op: differentiate "
                      "it with torch.autograd (loss.backward(), torch.autograd.grad), and batch over B")


@torch.compiler.disable(reason=TRANSFORMS_REFUSED)
def _refuse_transform() -> None:
    """The refusal where torch.compile traces a transform: a function it does not trace, so that it runs (or,
    with fullgraph=True, its reason is torch.compile's message) rather than torch's own error at the op."""
    raise LinrecError(TRANSFORMS_REFUSED)


def _refuse_other_transforms(groups: list[dict[str, torch.Tensor]]) -> None:
    """torch.func's transforms (grad, vmap, jvp, jacrev …) and forward-mode AD have no rule for the op: the
    first fail inside torch, the second would carry zero tangents through it without a word. Refused here.
    While torch.compile traces, its fake tensors are neither, but a transform has a level. Asking for it is a
    graph break inside a transform (torch.compile runs the call eagerly, and this refuses it there); with
    fullgraph=True, torch.compile's error quotes the line below, hence its comment."""
    if torch.compiler.is_compiling():
        if maybe_current_level() is not None:  # torch.func's transforms do not reach linrec's op: use torch.autograd
            _refuse_transform()
        return
    for tensors in groups:
        for name, t in tensors.items():
            if is_functorch_wrapped_tensor(t):
                raise LinrecError(TRANSFORMS_REFUSED)
            if forward_ad.unpack_dual(t).tangent is not None:
                raise LinrecError(f"'{name}' carries a forward-mode tangent, and linrec derives reverse-mode "
                                  f"gradients only (vector–Jacobian products): use loss.backward() or "
                                  f"torch.autograd.grad")


def _check_differentiable(rec: Recurrence, form: str, backend: str, groups: list[dict[str, torch.Tensor]]) -> None:
    """A call that autograd will differentiate needs a derived backward: a program without one (say a param's
    default that mixes a random draw with another param) is refused now, rather than at loss.backward(). (Not
    while torch.compile traces: the backward op says the same when it runs.)"""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    if any(t.requires_grad for tensors in groups for t in tensors.values()):
        gradient_plan(rec, form, backend)
