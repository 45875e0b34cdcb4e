"""One torch.library custom op per program, registered when a program is first used from PyTorch.

A custom op's schema is fixed, and each program has its own inputs, states and params. So each program gets
an op of its own, with a schema generated from its declarations (`RecurrenceOp.schema`):

    linrec::gla_<digest>(Tensor in_q, Tensor in_k, Tensor in_v, Tensor in_g, Tensor? state_S, Tensor? cu_seqlens,
                         *, SymInt[] sizes, str form, str backend, int? chunk_size, bool keep)
                         -> (Tensor, Tensor, Tensor)

Positional tensors: the inputs [B, T, H, *], then the initial states [B, H, *] (None: zeros), then the params
(None: the file's default) — each group in declaration order —, then cu_seqlens (None: the rows of B are the
sequences; else the offsets [N + 1] of packed sequences in one row, whose states are [N, H, *]). Keywords: the program's dimension sizes in
declaration order (the fake implementation needs those no tensor shows), the form, the backend and the chunk
size, and `keep`: whether autograd will ask for the backward (then the forward is kept for it, below).
Returns the outputs [B, T, H, *], then the final states [B, H, *], in declaration order, then `kept`: the
states before each chunk of the backward's forward, one flat tensor (c.grad_forward.Saved.flat; empty where
nothing is kept). The op is named by the program's name and a digest of its source, so every Recurrence
compiled from the same text shares one.

Every tensor reaches the kernel as a NumPy view of its memory (no copy) and every result leaves as a tensor
over the kernel's array (no copy): `apply` hands the op contiguous float32/float64 CPU tensors.

Autograd: the op's backward is a second custom op, `<name>_backward` (backward.py), which runs the derived
vector–Jacobian product (Recurrence.vjp) on the saved arguments and the cotangents of the outputs and final
states; `register_autograd` wires it, so gradients reach every input, initial state and param tensor.

A training step's forward is kept for its backward where the backward's forward is the fused C kernel — the
one the forward runs anyway (form "recurrent", or "auto" choosing it, on C): the op runs it keeping the states
before each chunk, and the backward starts from them instead of running the forward again (saving a forward
per step; the price, those states held until the backward: O(T/C) states, C the backward's chunk).
"""
from __future__ import annotations

import hashlib
import re
import threading

import numpy as np
import torch

from ..api import Recurrence
from ..decode import at_true_scale, reads_the_sequence
from ..dsl.errors import LinrecError
from .. import gradients
from . import backward
from .backward import STEP  # the op's `form` for the decode step: one token through Recurrence.step (see _step)
from .convert import to_array, to_tensor

NAMESPACE = "linrec"


class RecurrenceOp:
    """The custom op of one program, and how its arguments map to the program's names."""

    def __init__(self, rec: Recurrence, op, name: str, schema: str):
        self.rec = rec
        self.op = op  # the torch.library custom op
        self.name = name  # "linrec::<program>_<digest>": torch.ops.linrec.<program>_<digest>
        self.schema = schema
        program = rec.program
        self.inputs = tuple(x.name for x in program.inputs)
        self.states = tuple(s.name for s in program.states)
        self.params = tuple(p.name for p in program.params)
        self.outputs = tuple(o.name for o in program.outputs)
        self.dims = tuple(d.name for d in program.dims)

    def __reduce__(self):
        """Pickled (copy.deepcopy, torch.save of a whole model) as the program's op looked up again: the
        torch op itself is the process's registration."""
        return op_for, (self.rec,)

    def __call__(self, inputs: list, states: list, params: list, cu_seqlens, sizes: list, form: str, backend: str,
                 chunk_size: int | None, keep_allowed: bool = True) -> tuple[list, list]:
        """(outputs, final states), each a list in declaration order."""
        # the forward is kept for the backward only where autograd will ask for one, and only where it can be
        # (_may_keep), for the outputs saved with it stay alive and unchangeable (a decode step's or packed
        # sequences' backward runs its own forward: backward.kernel). Not under torch.export: the exported graph
        # records the argument, and every run of the exported program would keep a forward no backward reads
        # (a backward of an exported graph runs its own forward, as without keeping)
        keep = keep_allowed and _may_keep(form, backend) and torch.is_grad_enabled() and cu_seqlens is None and \
            not torch.compiler.is_exporting() and \
            any(t is not None and t.requires_grad for t in (*inputs, *states, *params))
        results = self.op(*inputs, *states, *params, cu_seqlens, sizes=sizes, form=form, backend=backend,
                          chunk_size=chunk_size, keep=keep)
        count = len(self.outputs)
        return list(results[:count]), list(results[count:count + len(self.states)])


# by Recurrence (identity): what a compiled model looks up, a plain dict that torch.compile traces (it keeps its
# recurrences alive, as the registered ops keep theirs)
_OPS: dict[Recurrence, RecurrenceOp] = {}
_BY_NAME: dict[str, RecurrenceOp] = {}     # by op name: recurrences of the same source share an op
# one registration at a time: two threads registering the same op at once both got past `name not in _BY_NAME`,
# and torch destroyed the first one's library ("Library object has been destroyed")
_REGISTERING = threading.Lock()


def op_for(rec: Recurrence) -> RecurrenceOp:
    """The program's custom op, registered on first use. Register it before torch.compile traces a call (a
    linrec.torch.Layer does when it is made): a registration is no operation a graph can hold, so inside a
    compiled function it is a graph break (torch.compiler.disable), which fullgraph=True refuses."""
    found = _OPS.get(rec)
    return found if found is not None else _register(rec)


# (torch.compile's message for a call in a compiled function says this reason: its own hint, to remove the
# disable, points the wrong way)
@torch.compiler.disable(reason="linrec registers a program's op on its first call, which no graph can hold: "
                               "call linrec.torch.op_for(rec), or make its linrec.torch.Layer, before "
                               "torch.compile traces it (fullgraph=True needs this)")
def _register(rec: Recurrence) -> RecurrenceOp:
    program = rec.program
    if not program.inputs:
        raise LinrecError(f"'{program.name}' has no inputs: a PyTorch op takes its B, T and H from them")
    identifier = re.sub(r"\W", "_", program.name, flags=re.ASCII)
    digest = hashlib.sha256(rec.compiled.source.encode("utf-8")).hexdigest()[:16]
    name = f"{identifier}_{digest}"
    with _REGISTERING:  # (one at a time: see _REGISTERING)
        if name not in _BY_NAME:
            schema = _schema(rec)
            qualified = f"{NAMESPACE}::{name}"
            op = torch.library.custom_op(qualified, _kernel(rec), mutates_args=(), device_types="cpu", schema=schema)
            op.register_fake(_fake(rec))
            backward_op = torch.library.custom_op(f"{qualified}_backward", backward.kernel(rec), mutates_args=(),
                                                  device_types="cpu", schema=backward.schema(rec, _argument))
            backward_op.register_fake(backward.fake(rec))
            backward_op.register_autograd(backward.second_order_refused(rec))
            setup_context, formula = backward.autograd_formula(rec, backward_op)
            op.register_autograd(formula, setup_context=setup_context)
            _BY_NAME[name] = RecurrenceOp(rec, op, qualified, schema)
        _OPS[rec] = _BY_NAME[name]
        return _OPS[rec]


def _argument(prefix: str, name: str, index: int) -> str:
    """A schema argument's name: the DSL name where it is a plain ASCII identifier, else its position."""
    return f"{prefix}_{name}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else f"{prefix}_{index}"


def _schema(rec: Recurrence) -> str:
    program = rec.program
    tensors = [f"Tensor {_argument('in', x.name, i)}" for i, x in enumerate(program.inputs)]
    tensors += [f"Tensor? {_argument('state', s.name, i)}" for i, s in enumerate(program.states)]
    tensors += [f"Tensor? {_argument('param', p.name, i)}" for i, p in enumerate(program.params)]
    tensors.append("Tensor? cu_seqlens")  # (packed sequences' offsets [N + 1], int64; None: rows of [B, T, H, *])
    returns = "(" + ", ".join(["Tensor"] * (len(program.outputs) + len(program.states) + 1)) + ")"  # (+ kept)
    return f"({', '.join(tensors)}, *, SymInt[] sizes, str form, str backend, int? chunk_size, bool keep) -> {returns}"


def _split(program, tensors: tuple) -> tuple[tuple, tuple, tuple, torch.Tensor | None]:
    """(inputs, initial states, params, cu_seqlens)."""
    n_in, n_states = len(program.inputs), len(program.states)
    return tensors[:n_in], tensors[n_in:n_in + n_states], tensors[n_in + n_states:-1], tensors[-1]


def _kernel(rec: Recurrence):
    """The op's CPU implementation: the tensors as NumPy views, Recurrence.run (or .step), the results as
    tensors."""
    program = rec.program

    def kernel(*tensors, sizes, form, backend, chunk_size, keep):
        inputs, states, params, cu_seqlens = _split(program, tensors)
        inputs = {x.name: to_array(t) for x, t in zip(program.inputs, inputs)}
        states = {s.name: to_array(t) for s, t in zip(program.states, states) if t is not None}
        params = {p.name: to_array(t) for p, t in zip(program.params, params) if t is not None}
        dims = {d.name: int(n) for d, n in zip(program.dims, sizes)}
        first = next(iter(inputs.values()))
        kept = _kept_forward(rec, inputs, states, params, dims, form, backend, chunk_size) if keep else None
        if kept is not None:
            outputs, final = kept.outputs, kept.final_state
        elif form == STEP:
            outputs, final = _step(rec, inputs, states, params, dims, backend)
        else:
            result = rec.run(inputs, form=form, backend=backend, params=params or None,
                             initial_state=states or None, chunk_size=chunk_size, dims=dims,
                             cu_seqlens=None if cu_seqlens is None else to_array(cu_seqlens))
            outputs, final = result.outputs, result.final_state
        arguments = [*inputs.values(), *states.values(), *params.values()]
        results = []
        flat = kept.flat if kept is not None else np.empty(0, first.dtype)
        for array in [*(outputs[o.name] for o in program.outputs), *(final[s.name] for s in program.states), flat]:
            results.append(to_tensor(array, arguments))
            arguments.append(results[-1].numpy())  # (nor may results alias each other)
        return tuple(results)

    return kernel


def _may_keep(form: str, backend: str) -> bool:
    """Whether a call's forward can be the one kept for its backward: the fused C kernel of the recurrent form,
    asked for or, with "auto", perhaps chosen (_kept_forward decides with the sizes)."""
    return backend == "c" and form in ("recurrent", "auto")


def _kept_forward(rec: Recurrence, inputs: dict, states: dict, params: dict, dims: dict, form: str, backend: str,
                  chunk_size: int | None):
    """The forward kept for the backward (gradients.saved_forward), where it is the one this call runs anyway:
    the fused C kernel of the recurrent form, and the backward's forward on the same backend. Else None: the op
    runs its form, and the backward its own forward."""
    first = next(iter(inputs.values()))
    batch, tokens, heads = first.shape[:3]
    ran = form if form != "auto" else rec.choose_form(backend, tokens, heads, batch, dims, first.dtype)[0]
    if not _may_keep(form, backend) or ran != "recurrent":
        return None
    gradient_form, where = backward.gradient_plan(rec, form, backend, dims, tokens, heads, batch, first.dtype)
    if where != backend:
        return None
    return gradients.saved_forward(rec, inputs, form=gradient_form, backend=where, initial_state=states or None,
                                   params=params or None, dims=dims, chunk_size=chunk_size)


def _step(rec: Recurrence, inputs: dict, states: dict, params: dict, dims: dict, backend: str):
    """The decode step, as sequences of one token: outputs [B, 1, H, *] and final states [B, H, *] at their
    true scale (as the sequence forms return them). A program that reads the sequence gets the KV cache and the
    new token as one sequence [B, t, H, *] and returns the last token's outputs, [B, 1, H, *]."""
    if reads_the_sequence(rec):
        token = {name: a[:, -1] for name, a in inputs.items()}
        tokens = next(iter(inputs.values())).shape[1]
        cache = {name: a[:, :-1] for name, a in inputs.items()} if tokens > 1 else None
        outputs, _ = rec.step(token, cache, backend=backend, params=params or None)
        return {name: v[:, None] for name, v in outputs.items()}, {}
    first = next(iter(inputs.values()))
    if first.shape[1] != 1:
        raise LinrecError(f"form='{STEP}' runs one token, but the inputs have T = {first.shape[1]}; use a "
                          f"sequence form (form='auto') for more")
    batch, heads = first.shape[0], first.shape[2]
    for s in rec.program.states:  # a state not given starts from zeros of the call's sizes (dims included)
        if s.name not in states:
            states[s.name] = np.zeros((batch, heads, *(dims[d] for d in s.shape)), dtype=first.dtype)
    outputs, final = rec.step({name: a[:, 0] for name, a in inputs.items()}, states, backend=backend,
                              params=params or None)
    return {name: v[:, None] for name, v in outputs.items()}, at_true_scale(rec, final)


def _fake(rec: Recurrence):
    """The op's shapes and dtypes without running it (for torch.compile): outputs [B, T, H, *] (T = 1 for the
    decode step) and final states [B, H, *] ([N, H, *] for N packed sequences), sized by the program's
    declarations, in the inputs' dtype."""
    program = rec.program

    def fake(*tensors, sizes, form, backend, chunk_size, keep):
        first, cu_seqlens = tensors[0], tensors[-1]
        batch, tokens, heads = first.shape[:3]
        if form == STEP:
            tokens = 1
        rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dims = dict(zip((d.name for d in program.dims), sizes))
        results = [first.new_empty((batch, tokens, heads, *(dims[d] for d in o.value.shape)))
                   for o in program.outputs]
        results += [first.new_empty((rows, heads, *(dims[d] for d in s.shape))) for s in program.states]
        # (the kept states' length is the kernel's to decide: its chunk, and whether it keeps any)
        results.append(first.new_empty((torch.library.get_ctx().new_dynamic_size() if keep else 0,)))
        return tuple(results)

    return fake
