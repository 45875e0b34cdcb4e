"""The builtin functions a program may call, and how each maps shapes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Builtin:
    name: str
    kind: str          # "elementwise" | "vector" (vector → vector) | "reduce" (vector → scalar)
    arity: int
    options: tuple[tuple[str, float], ...] = ()  # keyword options and their defaults
    doc: str = ""


BUILTINS = {b.name: b for b in [
    Builtin("exp", "elementwise", 1, doc="e^x"),
    Builtin("log", "elementwise", 1, doc="natural logarithm"),
    Builtin("sigmoid", "elementwise", 1, doc="1/(1+e^−x)"),
    Builtin("logsigmoid", "elementwise", 1, doc="log sigmoid(x), computed stably"),
    Builtin("softplus", "elementwise", 1, doc="log(1+e^x), computed stably"),
    Builtin("relu", "elementwise", 1, doc="max(x, 0)"),
    Builtin("elu", "elementwise", 1, doc="x if x > 0 else e^x − 1"),
    Builtin("silu", "elementwise", 1, doc="x·sigmoid(x)"),
    Builtin("tanh", "elementwise", 1),
    Builtin("sqrt", "elementwise", 1),
    Builtin("abs", "elementwise", 1),
    Builtin("l2norm", "vector", 1, (("eps", 1e-6),), doc="x/‖x‖ (eps inside the root)"),
    Builtin("groupnorm", "vector", 1, (("eps", 1e-5),),
            doc="per head: zero mean, unit variance over the vector, no affine"),
    Builtin("rmsnorm", "vector", 1, (("eps", 1e-6),), doc="x/sqrt(mean(x²)+eps)"),
    Builtin("sum", "reduce", 1, doc="sum of the vector's entries"),
    Builtin("mean", "reduce", 1, doc="mean of the vector's entries"),
    Builtin("norm", "reduce", 1, doc="Euclidean norm ‖x‖"),
]}

# Operators spelled as functions.
STRUCTURAL = {"diag": 1, "outer": 2}

# Seeded random defaults, only inside `param NAME = …`.
RANDOM = {"randn": ("normal", (("std", 1.0),)),
          "uniform": ("uniform", (("low", 0.0), ("high", 1.0)))}
