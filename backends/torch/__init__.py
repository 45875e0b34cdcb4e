"""linrec in PyTorch (the optional extra `linrec[torch]`): tensors in, tensors out.

    import linrec, linrec.torch
    rec = linrec.load("examples/gla.lin")
    o, final = linrec.torch.apply(rec, q=q, k=k, v=v, g=g, output_final_state=True)
    layer = linrec.torch.Layer("examples/gla.lin", heads=4)       # an nn.Module with the file's params
    o, state = layer(q=q, k=k, v=v, g=g)

`import linrec` never imports torch: only this package does (docs/torch.md).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401 - (the check that PyTorch is there, with the fix when it is not)
except ImportError as err:  # pragma: no cover - exercised only without torch
    raise ImportError("linrec.torch needs PyTorch: pip install 'linrec[torch]' (or torch==2.13.0)") from err

from .apply import apply
from .layer import Layer
from .op import RecurrenceOp, op_for

__all__ = ["Layer", "RecurrenceOp", "apply", "op_for"]
