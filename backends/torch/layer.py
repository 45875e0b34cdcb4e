"""linrec.torch.Layer: a program as an nn.Module whose params are nn.Parameters."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..api import Recurrence, load
from ..arrays import check_chunk_size, refuse_unknown_params
from ..compiler import ir
from ..compiler.analysis import refs, walk
from ..decode import reads_the_sequence
from ..dsl.errors import LinrecError, RuntimeInputError
from ..registry import backend as known_backend
from .apply import FORMS_TAKEN, apply
from .convert import checked_tensor
from .op import STEP, op_for


def trainable_params(program: ir.Program, given=()) -> tuple[str, ...]:
    """The params a Layer holds as nn.Parameters: those whose default reads no other param (Mamba-2's A_log and
    D, not A = −exp(A_log), which the program computes from A_log on every call), and any given explicitly —
    but not one that only the defaults of given params read (Mamba-2's A_log when A is given: nothing would
    read it, and its gradient would be 0)."""
    declared = {p.name: p for p in program.params}
    read_by_defaults = {n for p in program.params if p.default is not None for n in refs(p.default, ir.ParamRef)}
    needed = {n for step in program.steps for n in refs(step.value, ir.ParamRef)}
    todo = list(needed)
    while todo:  # the params the needed defaults read, transitively (a given param's default is not run)
        p = declared[todo.pop()]
        if p.name not in given and p.default is not None:
            fresh = set(refs(p.default, ir.ParamRef)) - needed
            needed |= fresh
            todo += fresh
    return tuple(p.name for p in program.params
                 if p.name in given or ((p.default is None or not refs(p.default, ir.ParamRef))
                                        and (p.name in needed or p.name not in read_by_defaults)))


def _sizes_read(program: ir.Program, names) -> dict[str, list[str]]:
    """The dimensions whose sizes the defaults of params `names` read as values (`c = −log(dk)`), each with
    the params that read it."""
    declared = {p.name: p for p in program.params}
    read: dict[str, list[str]] = {}
    for name in names:
        default = declared[name].default
        for dim in dict.fromkeys(n.dim for n in walk(default) if isinstance(n, ir.DimSize)) if default else ():
            read.setdefault(dim, []).append(name)
    return read


def _initial_value(name: str, value) -> np.ndarray:
    """A param's initial value as float64 (a tensor's, a number's, an array's), else an error naming it."""
    try:
        return np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value, np.float64)
    except (TypeError, ValueError):
        raise RuntimeInputError(f"params['{name}'] is a {type(value).__name__} that holds no numbers; pass a "
                                f"tensor or an array") from None


class Layer(nn.Module):
    """A linrec program as a module: `Layer("examples/gla.lin", heads=4, dims={"dk": 64, "dv": 64})`.

    Its params (per-head ones [H, *]) are nn.Parameters in `self.params`, initialised from the file's defaults
    (`rec.default_params`) or from `params=`. forward takes the program's inputs [B, T, H, *] by name (or
    positionally, in declaration order) and returns (o, state): `o` as linrec.torch.apply returns it, `state`
    the final states by name. Passing `state=` continues from it; with one token (T = 1) that is the decode
    step. `cu_seqlens=` packs variable-length sequences into one row, as linrec.torch.apply takes them. A program that reads the sequence (softmax attention) keeps its KV cache as its state: the inputs
    so far, [B, t, H, *] by name. `recompute=True`: its backward runs the forward again rather than keep the
    forward's states until then (apply's option)."""

    def __init__(self, program: str | Path | Recurrence, heads: int, dims: dict[str, int] | None = None, *,
                 params: dict | None = None, form: str = "auto", backend: str = "c",
                 chunk_size: int | None = None, dtype: torch.dtype = torch.float32, recompute: bool = False):
        super().__init__()
        self.rec = program if isinstance(program, Recurrence) else load(program)
        if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1:
            raise RuntimeInputError(f"heads must be a positive integer (the H of [B, T, H, *]), got {heads!r}")
        if form not in FORMS_TAKEN or form == STEP:
            raise LinrecError(f"unknown form {form!r}; choose one of "
                              f"{', '.join(f for f in FORMS_TAKEN if f != STEP)}")
        known_backend(backend)
        check_chunk_size(chunk_size)  # (here, where Layer(...) is written, not at the first forward)
        self.heads = int(heads)
        self.dims = dict(dims or {})
        self.form, self.backend, self.chunk_size = form, backend, chunk_size
        self.recompute = bool(recompute)  # (apply's: the backward runs the forward again, keeping no states)
        given = {name: _initial_value(name, value) for name, value in dict(params or {}).items()}
        self._check_params(given)
        values = self.rec.default_params(self.heads, self.dims, given)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise RuntimeInputError(f"dtype must be a floating-point torch.dtype (its params are trained), got "
                                    f"{dtype!r}")
        self.params = nn.ParameterDict()
        for name in trainable_params(self.rec.program, given):
            if values.get(name) is None:
                raise RuntimeInputError(f"parameter '{name}' of '{self.rec.name}' has no default; pass its "
                                        f"initial value: Layer(..., params={{'{name}': ...}})")
            if hasattr(self.params, name):  # (nn.ParameterDict's KeyError: "attribute 'type' already exists")
                raise LinrecError(f"parameter '{name}' of '{self.rec.name}' has the name of an attribute of "
                                  f"nn.ParameterDict, which cannot hold it: rename it in the program to make a "
                                  f"Layer (linrec.torch.apply takes it as it is)")
            self.params[name] = nn.Parameter(torch.as_tensor(values[name], dtype=dtype))
        # the sizes, not given in `dims`, at which those initial values were computed (the file's defaults): the
        # inputs must have them (checked at forward), else the values are another size's
        made_at = {d.name: d.default for d in self.rec.program.dims} | self.dims
        self._defaults_read = {dim: (made_at[dim], names) for dim, names in
                               _sizes_read(self.rec.program, [n for n in self.params if n not in given]).items()
                               if dim not in self.dims}
        self.op = op_for(self.rec)  # registered now: torch.compile then finds it (a registration is no graph op)

    def _check_params(self, given: dict[str, np.ndarray]) -> None:
        """The initial values given: the program's params by name, each of its shape at these heads and the
        sizes `dims` gives (a size it leaves out is the inputs' to set, at forward) — here, where Layer(...) is
        written, not at the first forward."""
        refuse_unknown_params(self.rec.program, given)
        declared = {p.name: p for p in self.rec.program.params}
        for name, value in given.items():
            p = declared[name]
            axes = (["H"] if p.per_head else []) + list(p.shape)
            wanted = [self.heads if a == "H" else self.dims.get(a) for a in axes]
            if value.ndim != len(axes) or any(n is not None and n != m for n, m in zip(wanted, value.shape)):
                known = "".join(f", {a} = {n}" for a, n in zip(axes[1:] if p.per_head else axes, wanted[p.per_head:])
                                if n is not None)
                raise RuntimeInputError(f"params['{name}'] has shape {list(value.shape)}, but '{name}' is "
                                        f"[{', '.join(axes)}] (heads = {self.heads}{known})")

    def extra_repr(self) -> str:
        return f"'{self.rec.name}' ({self.rec.compiled.filename}), heads={self.heads}, backend={self.backend!r}"

    def __getstate__(self):
        """Copied and pickled without its op: the op is the process's registration, found again for the copy's
        own program (__setstate__)."""
        state = super().__getstate__().copy()
        state.pop("op", None)
        return state

    def __setstate__(self, state):
        """The copy's program registered as __init__ registers it: op_for(self.rec), so that torch.compile finds
        it. Kept as pickled, the op would stand for the program it was first registered with — another
        Recurrence of the same source — and the copy's first call inside a compiled function would register
        it there, which fullgraph=True refuses."""
        super().__setstate__(state)
        self.op = op_for(self.rec)

    def forward(self, *args, state: dict | None = None, cu_seqlens=None, **inputs):
        names = [x.name for x in self.rec.program.inputs]
        if len(args) > len(names):
            raise RuntimeInputError(f"{len(args)} positional inputs, but '{self.rec.name}' has {len(names)}: "
                                    f"{', '.join(names)}")
        twice = [name for name in names[:len(args)] if name in inputs]
        if twice:  # (the keyword silently won, and the positional after it moved up a place)
            raise RuntimeInputError(f"input(s) {', '.join(map(repr, twice))} given twice, positionally (the inputs "
                                    f"in order: {', '.join(names)}) and as a keyword; pass each once")
        given = dict(zip(names, args)) | inputs
        self._check_sizes_read(given)
        heads = next((t.shape[2] for t in given.values() if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
        if heads is not None and heads != self.heads:
            raise RuntimeInputError(f"this Layer of '{self.rec.name}' has heads={self.heads}, but its inputs have "
                                    f"H = {heads} ([B, T, H, *]); make a Layer with heads={heads} for them")
        params = {name: value for name, value in self.params.items()}
        options = dict(backend=self.backend, params=params, dims=self.dims, chunk_size=self.chunk_size,
                       recompute=self.recompute)
        if reads_the_sequence(self.rec):
            if cu_seqlens is not None:  # (its state, the KV cache, is the inputs so far: rows, not packed sequences)
                raise RuntimeInputError(f"this Layer of '{self.rec.name}' keeps its KV cache by rows of [B, T, H, *]; "
                                        f"for packed sequences call linrec.torch.apply(…, cu_seqlens=…)")
            return self._over_cache(given, state, options)
        if state is not None and not isinstance(state, Mapping):  # (apply would name its initial_state=)
            raise RuntimeInputError(f"state is a {type(state).__name__}; pass the states by name, as the Layer's last "
                                    f"call returned them, e.g. state={{'{self.rec.program.states[0].name}': ...}}"
                                    if self.rec.program.states else f"state is a {type(state).__name__}; "
                                    f"'{self.rec.name}' has no state: pass none")
        tokens = next((t.shape[1] for t in given.values() if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        decode = state is not None and tokens == 1 and self.rec.program.causal and cu_seqlens is None
        return apply(self.rec, given, initial_state=state, output_final_state=True,
                     form=STEP if decode else self.form, cu_seqlens=cu_seqlens, **options)

    def _check_sizes_read(self, given: dict) -> None:
        """The inputs have the sizes the params' initial values were computed at (see __init__), and those of
        the params' own axes (a Layer made at the file's default sizes holds its params at them)."""
        held = self._sizes_held()
        for x in self.rec.program.inputs:
            tensor = given.get(x.name)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 + len(x.shape):
                continue  # (apply says what is wrong with it)
            for axis, dim in enumerate(x.shape):
                size = tensor.shape[3 + axis]
                if dim in self._defaults_read and size != self._defaults_read[dim][0]:
                    made, names = self._defaults_read[dim]
                    raise RuntimeInputError(
                        f"this Layer computed the initial values of {', '.join(map(repr, names))} at {dim} = "
                        f"{made} (the file's default size; {'they read' if len(names) > 1 else 'it reads'} it), but "
                        f"input '{x.name}' has {dim} = {size}: make the Layer with dims={{'{dim}': {size}}}")
                if dim in held and size != held[dim][0]:
                    made, names = held[dim]
                    made_by = "dims=" if dim in self.dims else "the file's default size, as no dims= gave it"
                    raise RuntimeInputError(
                        f"this Layer holds {', '.join(map(repr, names))} at {dim} = {made} ({made_by}), but input "
                        f"'{x.name}' has {dim} = {size}: make the Layer with dims={{'{dim}': {size}}}")

    def _sizes_held(self) -> dict[str, tuple[int, list[str]]]:
        """dimension → (its size in the params this Layer holds, their names), from their shapes."""
        declared = {p.name: p for p in self.rec.program.params}
        held: dict[str, tuple[int, list[str]]] = {}
        for name, value in self.params.items():
            p = declared[name]
            for dim, size in zip(p.shape, value.shape[1 if p.per_head else 0:]):
                held.setdefault(dim, (int(size), []))[1].append(name)
        return held

    def _over_cache(self, given: dict, cache: dict | None, options: dict):
        """A program that reads the sequence: its state is the KV cache, the inputs so far. New tokens are
        appended to it; one token runs as the decode step (its query against the cache), more as a sequence
        whose last outputs are theirs."""
        if cache is not None and not isinstance(cache, Mapping):  # (a tensor's truth value, a list's join failed)
            raise RuntimeInputError(f"state is a {type(cache).__name__}; the state of '{self.rec.name}' is its KV "
                                    f"cache, the inputs so far by name ({', '.join(given) or 'its inputs'}), as "
                                    f"the Layer's last call returned it")
        if not cache:
            o, _ = apply(self.rec, given, form=self.form, **options)
            return o, dict(given)
        # (no new tokens: the grown sequence passes apply's T ≥ 1, and the cached tokens' outputs came back)
        if any(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == 0 for t in given.values()):
            raise RuntimeInputError(f"no new tokens (T = 0) to continue the KV cache of '{self.rec.name}' with: pass "
                                    f"at least one")
        if not self.rec.program.causal:
            raise LinrecError(f"'{self.rec.name}' is non-causal: every output reads the whole sequence, so it "
                              f"cannot continue from a cache; pass the whole sequence")
        if set(cache) != set(given):
            raise RuntimeInputError(f"the KV cache of '{self.rec.name}' holds its inputs by name "
                                    f"({', '.join(sorted(given))}); it has {', '.join(sorted(cache)) or 'none'}")
        for name, value in given.items():
            old = checked_tensor(name, cache[name], "KV cache entry")
            if not isinstance(value, torch.Tensor) or old.dim() != value.dim() or old.dtype != value.dtype \
                    or old.shape[0] != value.shape[0] or old.shape[2:] != value.shape[2:]:
                new_shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise RuntimeInputError(f"the KV cache's '{name}' is {old.dtype} {list(old.shape)} and the new "
                                        f"tokens' {getattr(value, 'dtype', '')} {new_shape}: they must agree in "
                                        f"dtype and in every size but T ([B, T, H, *])")
        grown = {name: torch.cat([cache[name], value], dim=1) for name, value in given.items()}
        new = next(iter(given.values())).shape[1]
        o, _ = apply(self.rec, grown, form=STEP if new == 1 else self.form, **options)
        if new > 1:
            o = o[:, -new:] if isinstance(o, torch.Tensor) else {k: v[:, -new:] for k, v in o.items()}
        return o, grown
