"""linrec: a compiler for linear-attention recurrences.

    import linrec
    rec = linrec.load("examples/gla.lin")
    result = rec.run(rec.random_inputs(batch=1, tokens=32, heads=2))
"""
from .api import Recurrence, Result, compile, load
from .arrays import from_bfloat16, to_bfloat16
from .dsl.errors import LinrecError, RuntimeInputError
from .version import VERSION as __version__

__all__ = ["LinrecError", "Recurrence", "Result", "RuntimeInputError", "__version__", "compile", "from_bfloat16", "load", "to_bfloat16"]
