"""Check and prepare the arrays of a call: names, shapes, dtypes, sizes, value ranges. Every problem is a
RuntimeInputError naming the array, what was expected and what came."""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .compiler import ir
from .compiler.builtins import SEQ
from .compiler.resolve import SIZE_LIMIT, too_large
from .dsl.errors import RuntimeInputError

FLOAT_DTYPES = (np.float32, np.float64)


@dataclass(frozen=True)
class CallShape:
    batch: int
    tokens: int
    heads: int
    dims: dict[str, int]
    dtype: np.dtype


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def by_name(value, what: str) -> dict:
    """A dict argument of arrays by name (inputs, grad_outputs …) as a dict, None as an empty one; another
    container is an error that says what to pass."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RuntimeInputError(f"{what} must be a dict of arrays by name, got a {type(value).__name__}")
    return dict(value)


# what each optional dict argument holds arrays of, by name: "initial_state must be a dict of state name → array"
_DICT_KEYS = {"initial_state": "state", "state": "state", "grad_final_state": "state", "params": "parameter",
              "out": "output"}


def require_dicts(**given) -> None:
    """Optional dict arguments (initial_state=, state, params=, out= …): each None or a dict, else an error
    naming the argument and what it holds, rather than an AttributeError deep inside the call."""
    for what, value in given.items():
        if value is not None and not isinstance(value, Mapping):
            raise RuntimeInputError(f"{what} must be a dict of {_DICT_KEYS[what]} name → array, got a "
                                    f"{type(value).__name__}")


def require_token_inputs(value) -> None:
    """step()'s and bind_step()'s token_inputs: a dict of arrays by name, else an error that says so (rather
    than a TypeError from inside the step). A dict passes on one type test: the decode loop's cost."""
    if type(value) is not dict and not isinstance(value, Mapping):
        raise RuntimeInputError(f"token_inputs must be a dict of input name → array [B, H, *] (one token), got a "
                                f"{type(value).__name__}")


def inputs_by_name(inputs, named: dict, program: ir.Program | None = None, method=None) -> dict:
    """run()'s and prefill()'s inputs: the dict and the keywords together, none given in both. With the
    program and the method: a keyword that is none of the program's inputs but close to one of the method's
    options (`chunksize=` for chunk_size) is an error that says so, rather than an unknown input."""
    given = by_name(inputs, "inputs")
    refuse_given_twice(given, named)
    if program is not None and method is not None:
        refuse_misspelt_options(program, named, method)
    return given | named


# flash-linear-attention's options that linrec spells otherwise or does not need, with what to do instead: given
# to run(), prefill() or linrec.torch.apply as a keyword, one of these is not an unknown input array but this advice
# (a program's own input of that name is its input, as always)
OTHER_LIBRARIES_OPTIONS = {
    "output_final_state": "run() and prefill() always return the final states (result.final_state, by name); "
                          "output_final_state is linrec.torch.apply's option",
    "scale": "the scale is part of the program: write it in the readout, as examples/gla.lin does with "
             "`output o = dk^(−1/2)·q·S`",
    "head_first": "linrec's per-token arrays are [B, T, H, *] (flash-linear-attention's head_first=False); pass "
                  "arrays laid out [B, H, T, *] as x.swapaxes(1, 2)",
    "offsets": "the offsets of packed sequences are cu_seqlens=…",
    "use_qk_l2norm_in_kernel": "normalize in the program, as examples/gated_deltanet.lin does with "
                               "`qn = l2norm(q)` and `kn = l2norm(k)`",
}


def refuse_other_libraries_options(program: ir.Program, named: dict, call: str) -> None:
    """A keyword of `call` (run, prefill, apply) that is none of the program's inputs but one of
    OTHER_LIBRARIES_OPTIONS is an error with that advice, rather than an unknown input array."""
    inputs = {x.name for x in program.inputs}
    foreign = [n for n in named if n not in inputs and n in OTHER_LIBRARIES_OPTIONS]
    if foreign:
        raise RuntimeInputError(f"{call}() has no option {foreign[0]}=: {OTHER_LIBRARIES_OPTIONS[foreign[0]]} "
                                f"{_keywords_are_inputs(program, call)}")


def _keywords_are_inputs(program: ir.Program, call: str) -> str:
    """The reminder after an option refused: what a keyword of `call` that is no option is taken for."""
    return (f"(a keyword that is no option of {call}() is an input array, and the inputs of '{program.name}' are "
            f"{', '.join(x.name for x in program.inputs) or 'none'})")


def keyword_options(method) -> list[str]:
    """The names of a function's keyword-only parameters: its options, as its signature says."""
    return [p.name for p in inspect.signature(method).parameters.values() if p.kind is p.KEYWORD_ONLY]


def refuse_misspelt_options(program: ir.Program, named: dict, method) -> None:
    refuse_other_libraries_options(program, named, method.__name__)
    inputs = [x.name for x in program.inputs]
    unknown = [n for n in named if n not in inputs]
    if not unknown:
        return
    options = keyword_options(method)
    for name in unknown:
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.7)
        if close:
            raise RuntimeInputError(f"unknown input '{name}': did you mean the option {close[0]}=? "
                                    f"{_keywords_are_inputs(program, method.__name__)}")


def refuse_given_twice(given: dict, named: dict) -> None:
    """An input both in the `inputs` dict and among the keywords is an error (which one was meant?)."""
    twice = sorted(set(given) & set(named))
    if twice:
        raise RuntimeInputError(f"input(s) {', '.join(map(repr, twice))} given twice, in `inputs` and as a "
                                f"keyword; pass each once")


def refuse_unknown(given, names, kind: str, kinds: str, program: ir.Program, where: str = "") -> None:
    """A key of `given` that is none of `names` is an error: "unknown state(s) 's'; the states of 'gla' are
    S" (kind "state(s)", kinds "states"; `where` follows the unknown names, e.g. " in out")."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise RuntimeInputError(f"unknown {kind} {', '.join(map(repr, unknown))}{where}; the {kinds} of "
                                f"'{program.name}' are {', '.join(names) or 'none'}")


WHEN_LEFT_OUT = {"initial state": "leave it out for zeros", "parameter": "leave it out where it has a default"}


def given_none(name: str, what: str) -> RuntimeInputError:
    """The error for an array given as None (NumPy would make it an array of dtype object, and the error say
    so); `what` as _float_array's: "input", "parameter", "initial state", "state"."""
    fix = f"pass an array, or {WHEN_LEFT_OUT[what]}" if what in WHEN_LEFT_OUT else "pass an array"
    return RuntimeInputError(f"{what} '{name}' is None; {fix}")


def _float_array(name: str, value, what: str) -> np.ndarray:
    if value is None:
        raise given_none(name, what)
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - any failure to view the value as an array is the caller's error
        raise RuntimeInputError(f"{what} '{name}' is not an array") from None
    if arr.dtype.type not in FLOAT_DTYPES:
        bits = bits_hint(arr) if "state" in what else ""
        raise RuntimeInputError(f"{what} '{name}' has dtype {arr.dtype}; pass float32 or float64{bits}")
    return native(arr)


def native(arr: np.ndarray) -> np.ndarray:
    """`arr` in the machine's byte order: a big-endian float64 ('>f8') on a little-endian machine is float64 as
    much as a strided array is, a layout the kernels do not read; converted (a copy), as those are copied."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def bits_hint(arr) -> str:
    """What a float state's error adds when the array given holds bfloat16 bits (uint16)."""
    return " (a uint16 state holding bfloat16 bits needs state_dtype='bfloat16')" \
        if getattr(arr, "dtype", None) == np.uint16 else ""


def not_in_place(name: str, arr, dtype, expected: tuple) -> RuntimeInputError:
    """The error for a state a decode step cannot update in place (inplace=True, bind_step): on every backend
    the same words, naming what the array must be (and, where it is that, what the given one is not)."""
    bits = np.dtype(dtype) == BFLOAT16_BITS
    return RuntimeInputError(f"state '{name}' must be a writeable C-contiguous "
                             f"{'uint16 (bfloat16 bits)' if bits else np.dtype(dtype)} array of shape "
                             f"{list(expected)} to be updated in place (inplace=True, or a bound step)"
                             f"{'' if bits else bits_hint(arr)}"
                             f"{how_it_differs(arr, f'state[{name!r}]', expected, dtype)}")


def how_it_differs(arr, label: str, shape: tuple, dtype) -> str:
    """What an error about an array to be written in place (a state, an out= buffer) adds: the first way the
    given one is not a writeable C-contiguous ndarray of this shape and dtype."""
    if not isinstance(arr, np.ndarray):
        return f"; {label} is a {type(arr).__name__}, not an ndarray"
    order = byte_order_hint(arr, label)
    if order and arr.dtype.newbyteorder("=") == np.dtype(dtype):  # (the right dtype but for its byte order)
        return order
    if arr.dtype != np.dtype(dtype):
        return f"; {label} is {arr.dtype}"
    if arr.shape != tuple(shape):
        return f"; {label} has shape {list(arr.shape)}"
    if not arr.flags.c_contiguous:
        return f"; {label} is not C-contiguous (a view with strides, or Fortran order)"
    return array_kind_hint(arr, label)


def byte_order_hint(arr, label: str) -> str:
    """What an error about an array the step reads or writes in place adds when the array is a float in the
    other byte order (>f8 on a little-endian machine): the conversion to make, once, and keep ("" otherwise)."""
    if not isinstance(arr, np.ndarray) or arr.dtype.isnative or arr.dtype.type not in FLOAT_DTYPES:
        return ""
    order = "big" if arr.dtype.byteorder == ">" else "little"
    return (f"; {label} is {order}-endian ({arr.dtype.str}): pass {label}.astype('={arr.dtype.str[1:]}') (the "
            f"machine's byte order) and go on with that array")


def array_kind_hint(arr, label: str) -> str:
    """What an error about an array to be written in place adds when the array is of the right dtype and
    shape but read-only, or an ndarray subclass (np.memmap …), which the kernels do not take as it is, or in
    the other byte order (>f8 on a little-endian machine)."""
    if not isinstance(arr, np.ndarray):
        return ""
    order = byte_order_hint(arr, label)
    if order:
        return order
    if not arr.flags.writeable:
        return f"; {label} is read-only"
    if type(arr) is not np.ndarray:
        return (f"; {label} is a {type(arr).__module__}.{type(arr).__name__}: pass np.asarray({label}), a plain "
                f"ndarray of the same memory")
    return ""


def _bind(dims: dict[str, int], names: tuple[str, ...], actual: tuple[int, ...], where: str, expected: str):
    for d, n in zip(names, actual):
        if n < 1:
            raise RuntimeInputError(f"{where} has shape {expected} with {d} = {n}; every size must be at least 1")
        if d in dims and dims[d] != n:
            raise RuntimeInputError(f"{where} has shape {expected} with {d} = {n}, but {d} = {dims[d]} "
                                    f"elsewhere (from the other arrays or the options)")
        dims[d] = n


def check_inputs(program: ir.Program, inputs: dict, dims: dict[str, int] | None = None,
                 ranges: bool = True) -> tuple[dict, CallShape]:
    """Inputs [B, T, H, *] by DSL name → (arrays, sizes). Unknown names, missing inputs, wrong ranks,
    dtypes or sizes are errors; so are values outside a declared range, unless ranges=False (the caller
    then checks them itself: check_ranges, or a kernel that checks while it reads)."""
    inputs_given = inputs if isinstance(inputs, dict) else {}
    sizes, origins = _agreed_sizes([(f"input '{x.name}'", x.shape, 3, inputs_given.get(x.name))
                                    for x in program.inputs])
    for d, n in (dims or {}).items():  # (sizes asked for by the caller hold against every input)
        sizes[d], origins[d] = n, "the dims option"
    return _checked_inputs(program, inputs, ("B", "T", "H"), sizes, origins, ranges)


def check_token_inputs(program: ir.Program, inputs: dict, states: dict | None = None,
                       cache: dict | None = None) -> tuple[dict, CallShape]:
    """A decode step's token inputs [B, H, *] by DSL name → (the arrays as a sequence of one token,
    [B, 1, H, *]; sizes), checked as check_inputs checks a sequence but in the step's own terms: shapes
    [B, H, *], no T axis. The sizes are those the step's arrays agree on (_step_sizes: the token's, and the
    states' [B, H, *] or the KV cache's [B, t, H, *] it goes on from), so that the array named is the one
    that disagrees; values are not checked (check_ranges, on the token's own arrays)."""
    sizes, origins = _step_sizes(program, inputs, states, cache)
    checked, shape = _checked_inputs(program, inputs, ("B", "H"), sizes, origins, ranges=False)
    return {k: v[:, None] for k, v in checked.items()}, shape


def _step_sizes(program: ir.Program, inputs: dict, states: dict | None,
                cache: dict | None) -> tuple[dict[str, int], dict[str, str]]:
    """The sizes a decode step's arrays agree on, and for each the arrays that have it: per dimension, the
    size most of the token inputs, states and KV-cache arrays have, a tie going to a state or the cache
    (they carry over from prefill or the previous step; the token's arrays are made anew each step)."""
    arrays = [(f"state '{s.name}'", s.shape, 2, (states or {}).get(s.name)) for s in program.states] \
        + [(f"the KV cache's '{x.name}'", x.shape, 3, (cache or {}).get(x.name)) for x in program.inputs] \
        + [(f"input '{x.name}'", x.shape, 2, inputs.get(x.name)) for x in program.inputs]
    return _agreed_sizes(arrays)


def _agreed_sizes(arrays: list[tuple[str, tuple[str, ...], int, object]]) -> tuple[dict[str, int], dict[str, str]]:
    """(label, dimension names, leading axes, array or None) → per dimension the size most arrays have, and
    which arrays have it: the one that disagrees is the one an error names."""
    votes: dict[str, dict[int, list[str]]] = {}
    for label, names, lead, value in arrays:
        shape = _shape_of(value)
        if shape is not None and len(shape) == lead + len(names):
            for d, n in zip(names, shape[lead:]):
                if n >= 1:  # (a size below 1 is the error of the array that has it, said where it is checked)
                    votes.setdefault(d, {}).setdefault(n, []).append(label)
    sizes, origins = {}, {}
    for d, by_size in votes.items():  # (max keeps the first of equals: a carried array's, listed first)
        sizes[d], labels = max(by_size.items(), key=lambda item: len(item[1]))
        origins[d] = labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"
    return sizes, origins


def _shape_of(value) -> tuple[int, ...] | None:
    """The shape of an array given for a step, or None when it is none yet (absent, ragged): that array's
    own check says what is wrong with it."""
    if value is None:
        return None
    try:
        return np.shape(value)
    except ValueError:
        return None


# the keyword options of Recurrence's run, prefill, vjp, step and bind_step — their keyword_options, written out
# because this module is below linrec.api (tests/test_packed_grad.py holds the two equal): a key of the inputs
# dict with one of these names is an option put in the wrong place
CALL_OPTIONS = frozenset({"cu_seqlens", "chunk_size", "initial_state", "params", "dims", "form", "backend",
                          "state_every", "keep_last", "state_dtype", "threads", "grad_final_state", "missing",
                          "slots", "inplace", "out"})


def _checked_inputs(program: ir.Program, inputs: dict, axes: tuple[str, ...], bound: dict[str, int],
                    origins: dict[str, str], ranges: bool) -> tuple[dict, CallShape]:
    """check_inputs for arrays whose leading axes are `axes` ([B, T, H] for a sequence, [B, H] for a decode
    step's token). `bound`: sizes known before; `origins`, where those came from, for the error of an input
    that disagrees (a step's), else the sizes come from the inputs in order."""
    declared = {x.name: x for x in program.inputs}
    options = sorted(set(inputs) & CALL_OPTIONS - set(declared))
    if options:  # (found by probing: cu_seqlens put among the inputs was only "unknown input")
        raise RuntimeInputError(f"'{options[0]}' is an option of the call, not an input array: pass it as "
                                f"{options[0]}=…, beside the inputs (the inputs of '{program.name}' are "
                                f"{', '.join(declared) or 'none'})")
    refuse_unknown(inputs, list(declared), "input array(s)", "inputs", program)
    arrays, lead, dtype, n = {}, None, None, len(axes)
    for x in program.inputs:
        expected = "[" + ", ".join(axes + x.shape) + "]"
        if x.name not in inputs:
            raise RuntimeInputError(f"missing input '{x.name}' (expected shape {expected})")
        arr = _float_array(x.name, inputs[x.name], "input")
        if arr.ndim != n + len(x.shape):
            raise RuntimeInputError(f"input '{x.name}' should have shape {expected} but has shape "
                                    f"{_fmt(arr.shape)}")
        if lead is None:
            lead, dtype, first = arr.shape[:n], arr.dtype, x.name
        elif arr.shape[:n] != lead:
            raise RuntimeInputError(f"input '{x.name}' has [{', '.join(axes)}] = {_fmt(arr.shape[:n])} but "
                                    f"'{first}' has {_fmt(lead)}")
        elif arr.dtype != dtype:
            raise RuntimeInputError(f"input '{x.name}' is {arr.dtype} but '{first}' is {dtype}; pass every "
                                    f"input in one dtype")
        if origins:
            _require_sizes(x.name, expected, arr.shape, n, x.shape, bound, origins)
        _bind(bound, x.shape, arr.shape[n:], f"input '{x.name}' (expected {expected})", _fmt(arr.shape))
        if ranges:
            _check_range(x, arr)
        arrays[x.name] = arr
    if lead is None:
        raise RuntimeInputError(f"the program has no inputs to take {', '.join(axes[:-1])} and {axes[-1]} "
                                f"from")
    if min(lead) <= 0:
        raise RuntimeInputError(f"[{', '.join(axes)}] = {_fmt(lead)}: every size must be at least 1")
    counts = dict(zip(axes, lead))
    return arrays, CallShape(counts["B"], counts.get("T", 1), counts["H"], bound, dtype)


def _require_sizes(name: str, expected: str, shape: tuple, lead: int, names: tuple[str, ...], sizes: dict,
                   origins: dict) -> None:
    """An input against the sizes its call's arrays agree on: the error gives the shape it should have, the
    shape it has and which arrays have the sizes it lacks."""
    wrong = [d for d, n in zip(names, shape[lead:]) if d in origins and sizes[d] != n]
    if wrong:
        should = shape[:lead] + tuple(sizes.get(d, n) for d, n in zip(names, shape[lead:]))
        why = "; ".join(f"{d} = {sizes[d]} in {origins[d]}" for d in wrong)
        raise RuntimeInputError(f"input '{name}' should have shape {expected} = {_fmt(should)} but has shape "
                                f"{_fmt(shape)} ({why})")


def check_ranges(program: ir.Program, arrays: dict):
    """Values outside a declared range (`input g[dk] <= 0`), or NaN where a range is declared, are errors
    that name the input, the range and the first offending index."""
    for x in program.inputs:
        if x.name in arrays:
            _check_range(x, arrays[x.name])


def _check_range(x: ir.Input, arr: np.ndarray):
    if x.low is None and x.high is None or arr.size == 0:
        return
    # the common case in one or two reductions (NaN propagates through max and min and fails the test)
    below = x.low is not None and not (arr.min() > x.low if x.low_open else arr.min() >= x.low)
    above = x.high is not None and not (arr.max() < x.high if x.high_open else arr.max() <= x.high)
    if not (below or above):
        return
    bad = np.zeros(arr.shape, dtype=bool)
    if x.low is not None:
        bad |= (arr <= x.low) if x.low_open else (arr < x.low)
    if x.high is not None:
        bad |= (arr >= x.high) if x.high_open else (arr > x.high)
    bad |= np.isnan(arr)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        lo = "(" if x.low_open else "["
        hi = ")" if x.high_open else "]"
        interval = f"{lo}{'-inf' if x.low is None else f'{x.low:g}'}, {'inf' if x.high is None else f'{x.high:g}'}{hi}"
        raise RuntimeInputError(f"input '{x.name}' must lie in {interval} as declared; found {float(arr[where]):g} at "
                                f"index {list(where)}")


def nonfinite_tokens(a) -> np.ndarray:
    """[B, T, H]: where a per-token array [B, T, H, *] holds NaN or ±∞ (docs/guarantees.md#non-finite-values).
    a·0 is NaN for those and 0 for every other number, so a sum of products with zeros tests each token's
    values in one pass, at a third of the cost of isfinite(a).all(-1). (einsum's own loop: a BLAS product
    would wake BLAS's threads beside the kernels' own, for a pass bound by memory.)"""
    a = np.asarray(a)
    rows = a.reshape(a.shape[:3] + (-1,))
    with np.errstate(invalid="ignore"):
        return np.isnan(np.einsum("...i,i->...", rows, np.zeros(rows.shape[-1], rows.dtype)))


def resolve_dims(program: ir.Program, shape: CallShape, params: dict, initial_state: dict | None = None,
                 sizes: dict[str, int] | None = None) -> dict[str, int]:
    """Sizes not fixed by the inputs come from `sizes`, caller-supplied params or initial states, then from
    the file's defaults."""
    dims = dict(shape.dims)
    for name, size in checked_sizes(program, sizes).items():
        if name in dims and dims[name] != size:
            raise RuntimeInputError(f"dimension {name} = {size} was asked for, but the inputs have {name} = "
                                    f"{dims[name]}")
        dims[name] = size
    for s in program.states:
        value = (initial_state or {}).get(s.name)
        if value is not None and np.ndim(value) == 2 + len(s.shape):
            for d, n in zip(s.shape, np.shape(value)[2:]):
                _at_least_one(f"initial state '{s.name}'", d, n)
                dims.setdefault(d, n)
    for prm in program.params:
        if prm.name in params:
            arr = np.asarray(params[prm.name])
            offset = 1 if prm.per_head else 0
            if arr.ndim == offset + len(prm.shape):
                for d, n in zip(prm.shape, arr.shape[offset:]):
                    _at_least_one(f"parameter '{prm.name}'", d, n)
                    dims.setdefault(d, n)
    for d in program.dims:
        dims.setdefault(d.name, d.default)
    return dims


def _at_least_one(where: str, dim: str, n: int) -> None:
    if n < 1:
        raise RuntimeInputError(f"{where} has {dim} = {n}; every size must be at least 1")


def checked_sizes(program: ir.Program, sizes: dict | None) -> dict[str, int]:
    """Sizes asked for by name (`dims=`): each a dimension of the program and a whole number ≥ 1."""
    known = {d.name for d in program.dims}
    out = {}
    for name, size in dict(sizes or {}).items():
        if name not in known:
            raise RuntimeInputError(f"'{program.name}' has no dimension '{name}'; its dimensions are "
                                    f"{', '.join(sorted(known)) or 'none'}")
        out[name] = checked_size(f"dimension {name}", size)
    return out


def checked_size(what: str, size) -> int:
    """A size asked for by number (a dimension, or random_inputs' batch, tokens and heads) as a Python int: a
    whole number ≥ 1 — a Python or NumPy int, not a bool or a float — and at most SIZE_LIMIT."""
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        raise RuntimeInputError(f"{what} must be a whole number ≥ 1 (an int), got {size!r}")
    if size > SIZE_LIMIT:
        raise RuntimeInputError(too_large(f"{what} = {size}"))
    return int(size)


def check_given_params(program: ir.Program, given: dict, shape: CallShape, dims: dict) -> dict[str, np.ndarray]:
    """The params the caller passed, each a float array of its shape (per-head ones [H, *]), by name: checked
    before any default is computed from them (Mamba-2's A = −exp(A_log) would otherwise meet a string or a
    wrong shape inside NumPy)."""
    refuse_unknown_params(program, given)
    return {prm.name: _param_of_shape(prm, _float_array(prm.name, given[prm.name], "parameter"), shape, dims)
            for prm in program.params if prm.name in given}


def refuse_unknown_params(program: ir.Program, given) -> None:
    refuse_unknown(given, [p.name for p in program.params], "parameter(s)", "parameters", program)


def _param_label(prm) -> str:
    return ("[H" + "".join(", " + d for d in prm.shape) + "]") if prm.per_head else \
        ("[" + ", ".join(prm.shape) + "]" if prm.shape else "a scalar")


def _param_of_shape(prm, arr: np.ndarray, shape: CallShape, dims: dict) -> np.ndarray:
    expected = ((shape.heads,) if prm.per_head else ()) + tuple(dims[d] for d in prm.shape)
    if arr.shape != expected:
        raise RuntimeInputError(f"parameter '{prm.name}' should have shape {_param_label(prm)} = {_fmt(expected)} "
                                f"but has shape {_fmt(arr.shape)}")
    return arr


def check_params(program: ir.Program, given: dict, defaults: dict, shape: CallShape, dims: dict) -> dict:
    """Caller-supplied params override the file's defaults; per-head params are [H, *]."""
    passed = check_given_params(program, given, shape, dims)
    out = {}
    for prm in program.params:
        if prm.name in passed:
            arr = passed[prm.name]
        elif defaults.get(prm.name) is not None:
            arr = _param_of_shape(prm, defaults[prm.name], shape, dims)
        else:
            raise RuntimeInputError(f"parameter '{prm.name}' has no default; pass it (shape {_param_label(prm)})")
        out[prm.name] = np.array(arr, dtype=shape.dtype, order="C")  # keeps 0-d params 0-d
    return out


def refuse_unknown_states(program: ir.Program, given, also: frozenset[str] | set[str] = frozenset()):
    """A state name that is none of the program's (nor in `also`: the log-scales carried beside its
    stabilized states) is an error: a misspelt name would otherwise leave the state it meant at zero."""
    refuse_unknown(set(given) - set(also), sorted(s.name for s in program.states), "state(s)", "states", program)


def check_initial_state(program: ir.Program, given: dict | None, shape: CallShape, dims: dict,
                        scales: frozenset[str] = frozenset(), what: str = "initial state") -> dict:
    """Initial states [B, H, *] (zeros when absent), copied in the inputs' dtype. `scales` names the
    log-scales [B, H] a decode loop may carry beside stabilized states (float64 here; C's kernels take and
    return them in their own dtype). `what` names them in an error: "initial state" for run and prefill,
    "state" for a decode step (as C's step says)."""
    given = dict(given or {})
    out = {}
    for key in scales & set(given):
        value = np.asarray(given.pop(key), dtype=np.float64)
        if value.shape != (shape.batch, shape.heads):
            raise RuntimeInputError(f"'{key}' should have shape [B, H] = {_fmt((shape.batch, shape.heads))} but "
                                    f"has shape {_fmt(value.shape)}")
        out[key] = value
    refuse_unknown_states(program, given)
    for s in program.states:
        expected = (shape.batch, shape.heads) + tuple(dims[d] for d in s.shape)
        if s.name in given:
            arr = _float_array(s.name, given[s.name], what)
            if arr.shape != expected:
                label = "[B, H" + "".join(", " + d for d in s.shape) + "]"
                raise RuntimeInputError(f"{what} '{s.name}' should have shape {label} = {_fmt(expected)} "
                                        f"but has shape {_fmt(arr.shape)}")
            out[s.name] = np.array(arr, dtype=shape.dtype, copy=True)
        else:
            out[s.name] = np.zeros(expected, dtype=shape.dtype)
    return out


def require_counts(shape: CallShape, largest: int, backend: str) -> None:
    """A call's batch, token and head counts within what the backend's form takes (C's kernels count in ints),
    checked before any array is prepared."""
    for name, n in (("batch", shape.batch), ("tokens", shape.tokens), ("heads", shape.heads)):
        if n > largest:
            raise RuntimeInputError(f"{name} = {n}: the {backend} backend's kernels take at most {largest}; split "
                                    f"the call, or use the NumPy backend (backend='numpy')")


def fits_out(given, shape: tuple, dtype) -> bool:
    """Whether `given` may take a result of this shape and dtype in its own memory, as a kernel or a ufunc's
    `out=` writes it: a writeable C-contiguous ndarray of exactly them."""
    return isinstance(given, np.ndarray) and given.shape == tuple(shape) and given.dtype == dtype \
        and given.flags.c_contiguous and given.flags.writeable


def out_array(given, label: str, shape: tuple, dtype) -> np.ndarray:
    """`given` (an array the caller passed for a result, named `label` in the message, e.g. "out['o']") when it
    fits_out, else a clear error."""
    if not fits_out(given, shape, dtype):
        raise out_error(label, given, shape, dtype)
    return given


def out_error(label: str, given, shape: tuple, dtype) -> RuntimeInputError:
    """The error for an array passed for a result that cannot take it in its own memory."""
    return RuntimeInputError(f"{label} must be a writeable C-contiguous {np.dtype(dtype)} array of shape "
                             f"{list(shape)}{how_it_differs(given, label, shape, dtype)}")


def refuse_shared_outputs(out: dict | None, inputs: dict | None, states: dict | None,
                          states_label: str = "state '{}'", states_written: bool = False) -> None:
    """The output arrays a step writes (`out`'s, by name) each in memory of its own: one that shares memory
    with a token input, a state (`states_label` names them: "state 'S'", "pool['S']") or another output is an
    error naming both, raised before anything is written — the step would write its result over what it
    reads or updates. With `states_written` (the step updates the states in place: inplace=True, a bound
    step, a slot pool) each state in memory of its own too: two that overlap would each be written over
    the other, and none shares memory with a token input, which the step would read as it writes it. One
    _overlap per pair (a bounds check: cheap enough for every checked step); arrays that are not ndarrays are
    converted copies, which share nothing."""
    held = [(states_label.format(name), arr) for name, arr in (states or {}).items() if isinstance(arr, np.ndarray)]
    read = [(name, arr) for name, arr in (inputs or {}).items() if isinstance(arr, np.ndarray)]
    if states_written:
        for i, (label, arr) in enumerate(held):
            for other, value in held[:i]:
                if _overlap(arr, value):
                    raise RuntimeInputError(f"{label} shares memory with {other}: the step updates both in place "
                                            f"and would write one over the other; pass each state in an array "
                                            f"of its own")
            for name, value in read:  # (the C step reads a token's rows as it writes states)
                if _overlap(arr, value):
                    raise RuntimeInputError(f"input '{name}' shares memory with {label}, which the step updates "
                                            f"in place: it would read the token from a state it is writing; pass "
                                            f"a copy ({name}.copy())")
    if not out:
        return
    given = [(f"out['{name}']", arr) for name, arr in out.items() if isinstance(arr, np.ndarray)]
    if not given:
        return
    others = [(f"input '{name}'", arr) for name, arr in read] + held
    for i, (label, arr) in enumerate(given):
        for other, value in others + given[:i]:
            if _overlap(arr, value):
                raise RuntimeInputError(f"{label} shares memory with {other}: the step would write the output "
                                        f"over an array it reads or writes; pass a separate array for {label}")


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays share memory: np.may_share_memory's bounds check, which is exact for two contiguous
    arrays; where the bounds overlap and one is strided (a pool's states interleaved in one buffer, slot by
    slot), np.shares_memory with bounded work, an overlap where that is too hard to tell."""
    if not np.may_share_memory(a, b):
        return False
    if (a.flags.c_contiguous or a.flags.f_contiguous) and (b.flags.c_contiguous or b.flags.f_contiguous):
        return True
    try:
        return bool(np.shares_memory(a, b, max_work=1000))
    except _TOO_HARD:
        return True


_TOO_HARD = getattr(getattr(np, "exceptions", np), "TooHardError")


def check_states_in_place(program: ir.Program, state: dict, shape: CallShape, dims: dict,
                          bits: bool = False) -> None:
    """The states a decode step updates in place (inplace=True, bind_step): each given one a writeable
    C-contiguous array of the inputs' dtype (`bits`: of bfloat16 bits, uint16) and its [B, H, *] shape, on
    every backend (the compiled step writes to the very memory; converting would leave the caller's array
    behind)."""
    dtype = BFLOAT16_BITS if bits else shape.dtype
    for s in program.states:
        arr = state.get(s.name)
        if arr is None:
            continue
        expected = (shape.batch, shape.heads) + tuple(dims[d] for d in s.shape)
        if not (type(arr) is np.ndarray and fits_out(arr, expected, dtype)):
            raise not_in_place(s.name, arr, dtype, expected)


def refuse_unknown_outputs(program: ir.Program, out) -> None:
    """A name in `out` that is none of the program's outputs is an error: its buffer would never be written."""
    refuse_unknown(out or {}, [o.name for o in program.outputs], "output(s)", "outputs", program, " in out")


def token_outputs(program: ir.Program, out: dict | None, shape: CallShape, dims: dict) -> dict:
    """The output arrays of one decode step [B, H, *]: the caller's (`out`: writeable C-contiguous arrays of
    the inputs' dtype and the right shape, as the compiled step writes them) or new ones."""
    refuse_unknown_outputs(program, out)
    outputs = {}
    for o in program.outputs:
        wanted = (shape.batch, shape.heads) + tuple(dims[d] for d in o.value.shape)
        given = (out or {}).get(o.name)
        outputs[o.name] = np.empty(wanted, shape.dtype) if given is None else \
            out_array(given, f"out['{o.name}']", wanted, shape.dtype)
    return outputs


def random_inputs(program: ir.Program, batch: int, tokens: int, heads: int, dims: dict[str, int],
                  dtype=np.float64, seed: int = 0, decay_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Seeded inputs that fit each input's declared role: intervals are sampled inside, one-sided bounds
    (log-decays ≤ 0, step sizes > 0) get magnitudes scaled by `decay_scale`, the rest is standard normal."""
    # (the sizes, dimensions and dtype by run's rules: arrays that run would refuse are not made)
    batch, tokens, heads = (checked_size(what, n) for what, n in (("batch", batch), ("tokens", tokens),
                                                                   ("heads", heads)))
    dims = {d.name: d.default for d in program.dims} | checked_sizes(program, dims)
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise RuntimeInputError(f"dtype {dtype!r} is not a NumPy dtype; pass float32 or float64") from None
    if dtype.type not in FLOAT_DTYPES:
        raise RuntimeInputError(f"dtype {dtype}: the inputs run takes are float32 or float64; pass one of them")
    rng = np.random.default_rng(seed)
    out = {}
    for x in program.inputs:
        size = (batch, tokens, heads) + tuple(dims[d] for d in x.shape)
        if x.low is not None and x.high is not None:
            lo, hi = x.low, x.high
            span = hi - lo
            value = rng.uniform(lo + 0.02 * span, hi - 0.02 * span, size)
        elif x.high is not None:
            value = x.high - decay_scale * 0.5 * np.abs(rng.standard_normal(size)) - (1e-3 if x.high_open else 0)
        elif x.low is not None:
            value = x.low + decay_scale * 0.5 * np.abs(rng.standard_normal(size)) + (1e-3 if x.low_open else 0)
        else:
            value = rng.standard_normal(size)
        out[x.name] = value.astype(dtype)
    return out


def check_sequence_length(program: ir.Program, shape: CallShape, dims: dict[str, int]) -> None:
    """Parameters over the sequence axis hold a maximum length T: a longer sequence has no projection."""
    if any(d.name == SEQ for d in program.dims) and shape.tokens > dims[SEQ]:
        spanning = ", ".join(p.name for p in program.params if SEQ in p.shape)
        raise RuntimeInputError(f"the sequence has T = {shape.tokens} tokens but {spanning} cover(s) at most "
                                f"{SEQ} = {dims[SEQ]} positions; pass longer parameters (and set the size) "
                                f"or a shorter sequence")


def unknown_form(form, choices) -> str:
    """The message for a form that is none of `choices` (an option's value: a RuntimeInputError where raised)."""
    return f"unknown form '{form}'; choose one of {', '.join(choices)}"


CHUNK_SIZE_RULE = "the chunk size must be a positive integer (tokens per chunk of the chunkwise form, e.g. 64)"


def check_chunk_size(chunk_size) -> int | None:
    """A call's chunk size (None: the form's own default) as a Python int: a positive integer, a Python or NumPy
    one — not a bool, a float or a string, which would only look like one — else a RuntimeInputError naming the
    value. Every form and backend then clamps it to T: a chunk longer than the sequence is the sequence as one
    chunk, exactly, and a clamped chunk fits the C kernels' token counts however large it was asked."""
    if chunk_size is None:
        return None
    integer = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
    if not integer or chunk_size < 1:
        kind = "" if integer else f" (a {type(chunk_size).__name__})"
        raise RuntimeInputError(f"{CHUNK_SIZE_RULE}, got {chunk_size!r}{kind}; leave it out for the form's default")
    return int(chunk_size)



# ---- the bfloat16 state (state_dtype="bfloat16"): stored between calls as bfloat16, computed in float32 ----
# NumPy has no bfloat16 dtype: a bfloat16 array is a uint16 array holding the bits (the upper half of a float32's).
BFLOAT16 = "bfloat16"
BFLOAT16_BITS = np.dtype(np.uint16)


def to_bfloat16(x) -> np.ndarray:
    """float32 values → bfloat16 bits (uint16), rounded to nearest, ties to even; NaN stays NaN (quieted:
    its top mantissa bit set), ±inf stays ±inf, and float32 subnormals (|x| < 2⁻¹²⁶) become ±0 — what AVX-512
    BF16's vcvtneps2bf16 does, so that the C kernels (with or without it) and this give the same bits.
    float64 values are rounded to float32 first."""
    if isinstance(x, Mapping):  # (what prefill and step return: states by name)
        raise RuntimeInputError("linrec.to_bfloat16 converts one array, got a dict; convert each state: "
                                "{name: linrec.to_bfloat16(a) for name, a in states.items()}")
    try:
        arr = np.asarray(x)
    except Exception:  # noqa: BLE001 - any failure to view the value as an array is the caller's error
        raise RuntimeInputError(f"linrec.to_bfloat16 converts an array of real numbers, got a {type(x).__name__}") \
            from None
    if arr.dtype.kind not in "fiu":  # (None, strings and objects would become NaN or fail in NumPy; complex
        # values would lose their imaginary part)
        raise RuntimeInputError(f"linrec.to_bfloat16 converts an array of real numbers (float32, float64 or "
                                f"integers), got dtype {arr.dtype}")
    u = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    subnormal = (u & 0x7F800000) == 0
    bits = np.where(nan, (u >> 16) | 0x40, np.where(subnormal, (u >> 16) & 0x8000, rounded))
    return bits.astype(np.uint16)


def from_bfloat16(bits) -> np.ndarray:
    """bfloat16 bits (a uint16 array) → float32 values, exactly (every bfloat16 is a float32)."""
    b = np.asarray(bits)
    if b.dtype != BFLOAT16_BITS:
        raise RuntimeInputError(f"bfloat16 values are held as uint16 arrays of their bits, got dtype {b.dtype}; "
                                f"make them with linrec.to_bfloat16(float32_array)")
    return (b.astype(np.uint32) << 16).view(np.float32)


def check_state_dtype(state_dtype, dtype) -> str | None:
    """state_dtype: how states are stored between calls — None (the inputs' dtype), "float32"/"float64" (the
    same as the inputs'), or "bfloat16" (float32 inputs; the states as uint16 arrays of bfloat16 bits).
    Returns "bfloat16" or None (states in the inputs' dtype)."""
    if state_dtype is None:
        return None
    name = state_dtype if isinstance(state_dtype, str) else _dtype_name(state_dtype)
    if name == BFLOAT16:
        if np.dtype(dtype) != np.float32:
            raise RuntimeInputError(f"state_dtype='bfloat16' needs float32 inputs (the kernels accumulate the state "
                                    f"in float32), got {np.dtype(dtype)}; pass float32 inputs, or leave state_dtype "
                                    f"out to keep the state in {np.dtype(dtype)}")
        return BFLOAT16
    if name in ("float32", "float64"):
        if np.dtype(name) != np.dtype(dtype):
            raise RuntimeInputError(f"state_dtype={name!r} with {np.dtype(dtype)} inputs: a float state is kept in the "
                                    f"inputs' dtype; pass {name} inputs, or state_dtype='bfloat16' (float32 inputs), "
                                    f"or leave state_dtype out")
        return None
    raise RuntimeInputError(f"unknown state_dtype {state_dtype!r}; choose 'float32' (the default with float32 "
                            f"inputs) or 'bfloat16' (states stored as uint16 arrays of bfloat16 bits)")


def _dtype_name(value) -> str | None:
    try:
        return np.dtype(value).name
    except TypeError:
        return None


def bfloat16_bits(name: str, value, what: str = "state") -> np.ndarray:
    """A bfloat16 state as given, any shape: a uint16 array of its bits, else an error saying how to convert."""
    arr = np.asarray(value)
    if arr.dtype != BFLOAT16_BITS:
        raise RuntimeInputError(f"{what} '{name}' has dtype {arr.dtype}, but with state_dtype='bfloat16' states are "
                                f"uint16 arrays of bfloat16 bits; convert it with linrec.to_bfloat16(…)")
    return arr


def state_bits(name: str, value, expected: tuple, what: str = "state") -> np.ndarray:
    """A bfloat16 state as given: a uint16 array of its bits, shaped `expected`."""
    arr = bfloat16_bits(name, value, what)
    if arr.shape != expected:
        raise RuntimeInputError(f"{what} '{name}' should have shape {_fmt(expected)} but has shape {_fmt(arr.shape)}")
    return arr
