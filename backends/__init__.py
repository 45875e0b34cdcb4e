"""linrec backends: NumPy (and C) code generation, the runtime, the Python API and the command line.

    import backends as linrec
    rec = linrec.load("examples/gla.lin")
    result = rec.run(rec.random_inputs(batch=1, tokens=32, heads=2))
"""
from dsl.errors import LinrecError, RuntimeInputError

from .api import Recurrence, Result, compile, load

__all__ = ["LinrecError", "Recurrence", "Result", "RuntimeInputError", "compile", "load"]
