"""Tensors ↔ NumPy arrays at the op's edge, without copies where the memory allows, and the checks of a tensor
argument (type, device, layout, dtype) with errors that name the argument and the fix."""
from __future__ import annotations

import numpy as np
import torch

from ..dsl.errors import RuntimeInputError

COMPUTED = (torch.float32, torch.float64)  # the kernels' own dtypes: passed through as they are
# half-precision tensors are computed in float32 (the kernels have no half types): converted on the way in and
# the outputs converted back, one copy each way (docs/torch.md, "Dtypes")
WIDENED = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def checked_tensor(name: str, value, what: str) -> torch.Tensor:
    """The tensor `value` of argument `name` (`what`: "input", "initial state", "parameter"), or an error that
    says what is wrong with it and how to fix it."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeInputError(f"{what} '{name}' is a {type(value).__name__}, not a torch.Tensor; pass a tensor "
                                f"(torch.as_tensor(...) converts an array)")
    if value.device.type != "cpu":
        raise RuntimeInputError(f"{what} '{name}' is on device '{value.device}', but linrec's kernels run on the "
                                f"CPU; move it there with .cpu() (and the result back with .to(device))")
    if value.is_nested:  # (its layout is strided, and its shape is no tuple of sizes)
        raise RuntimeInputError(f"{what} '{name}' is a nested tensor; pass a dense one [B, T, H, *] "
                                f"(torch.nested.to_padded_tensor), or one call per sequence")
    if value.layout != torch.strided:
        raise RuntimeInputError(f"{what} '{name}' has layout {value.layout}; pass a dense tensor (.to_dense())")
    if value.dtype not in COMPUTED and value.dtype not in WIDENED:
        raise RuntimeInputError(f"{what} '{name}' has dtype {value.dtype}; pass float32 or float64 (bfloat16 and "
                                f"float16 are computed in float32)")
    return value


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a NumPy array: a view, no copy (detach() is a view too: the op's kernel sits
    below autograd)."""
    return tensor.detach().numpy()


def to_tensor(array: np.ndarray, arguments: list[np.ndarray]) -> torch.Tensor:
    """A result array as a tensor, sharing its memory. A result must not alias an argument or an earlier result
    (a custom op's outputs are new tensors: a view of an input would break autograd and torch.compile),
    must be writeable (a tensor is) and C-contiguous (the strides the op's fake implementation promises the
    compiler); a result that is not all three is copied, any other is handed over as it is."""
    out = np.ascontiguousarray(array)  # (the array itself when it is C-contiguous already)
    if not out.flags.writeable or any(np.may_share_memory(out, a) for a in arguments):
        out = out.copy()
    return torch.from_numpy(out)
