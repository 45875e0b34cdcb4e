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
    Builtin("cos", "elementwise", 1, doc="cosine (radians): rotary features, cosFormer's re-weighting"),
    Builtin("sin", "elementwise", 1, doc="sine (radians)"),
    Builtin("sqrt", "elementwise", 1),
    Builtin("abs", "elementwise", 1),
    Builtin("l2norm", "vector", 1, (("eps", 1e-6),), doc="x/‖x‖ (eps inside the root)"),
    Builtin("groupnorm", "vector", 1, (("eps", 1e-5),),
            doc="per head: zero mean, unit variance over the vector, no affine"),
    Builtin("rmsnorm", "vector", 1, (("eps", 1e-6),), doc="x/sqrt(mean(x²)+eps)"),
    Builtin("softmax", "vector", 1, doc="exp(x − max x)/Σ exp(x − max x); over visible keys for seq(…) scores"),
    Builtin("sum", "reduce", 1, doc="sum of the vector's entries"),
    Builtin("mean", "reduce", 1, doc="mean of the vector's entries"),
    Builtin("norm", "reduce", 1, doc="Euclidean norm ‖x‖"),
]}

# Operators spelled as functions.
STRUCTURAL = {"diag": 1, "outer": 2}

# Seeded random defaults, only inside `param NAME = …`.
RANDOM = {"randn": ("normal", (("std", 1.0),)),
          "uniform": ("uniform", (("low", 0.0), ("high", 1.0))),
          # Performer's FAVOR+ projections: Gaussian rows, orthogonalized in blocks of dk when orthogonal=1,
          # each row rescaled to the length of an independent Gaussian vector
          "random_features": ("features", (("orthogonal", 1.0),))}

# Sequence-level builtins: they see the other tokens of the sequence.
SEQ = "T"  # the name of the sequence axis (declare `T = 4096` in the header to bound it)
SEQUENCE = {
    # seq(x): x at every visible position, shape [T, *x]; window=w keeps the last w positions (0: all)
    "seq": (1, (("window", 0.0),)),
    # Reformer's shared-QK LSH attention of per-token q (keys are q/‖q‖) over values v
    "lsh_attention": (2, (("buckets", 16.0), ("rounds", 2.0), ("chunk", 16.0), ("seed", 0.0))),
}
