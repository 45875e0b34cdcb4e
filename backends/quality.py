"""`linrec verify FILE --against EXACT.lin`: how well a program approximates another on the same inputs —
for random-feature programs, as the number of features grows, orthogonal against i.i.d. features.

The sweep follows the program's structure: every parameter whose default is `random_features(…)` is
redrawn with m rows (its first axis), orthogonal or not, for several seeds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compiler import ir
from .dsl.errors import LinrecError

from .numpy.runtime import random_features

FEATURES = (16, 64, 256, 1024)


@dataclass
class QualityRow:
    features: int
    orthogonal: bool
    mean_rel_error: float
    std_rel_error: float
    seeds: int


def feature_params(program: ir.Program) -> list[ir.Param]:
    return [p for p in program.params if isinstance(p.default, ir.Random) and p.default.kind == "features"]


INPUT_STD = 0.5  # unconstrained inputs ~ N(0, 0.25): the estimator's variance grows like exp(‖q‖² + ‖k‖²)


def compare(approx, exact, features=FEATURES, seeds: int = 8, tokens: int = 256, heads: int = 2,
            batch: int = 1, on_row=None) -> list[QualityRow]:
    """Mean relative error ‖o − o_exact‖/‖o_exact‖ over seeds, per feature count and kind; unconstrained
    inputs are drawn with standard deviation INPUT_STD."""
    params = feature_params(approx.program)
    if not params:
        raise LinrecError(f"'{approx.name}' has no parameter drawn with random_features(…): nothing to sweep")
    shared = {x.name for x in approx.program.inputs} & {x.name for x in exact.program.inputs}
    if shared != {x.name for x in exact.program.inputs}:
        raise LinrecError(f"'{exact.name}' needs inputs that '{approx.name}' does not have")
    outputs = [o.name for o in exact.program.outputs if o.name in {p.name for p in approx.program.outputs}]
    if not outputs:
        raise LinrecError(f"'{approx.name}' and '{exact.name}' have no output name in common to compare")
    sizes = {d.name: d.default for d in approx.program.dims}
    rows = []
    for m in features:
        for orthogonal in (True, False):
            errors = []
            for seed in range(seeds):
                inputs = approx.random_inputs(batch, tokens, heads, seed=1000 + seed)
                for x in approx.program.inputs:
                    if x.low is None and x.high is None:
                        inputs[x.name] = inputs[x.name] * INPUT_STD
                ref = exact.run({k: inputs[k] for k in shared}, form="parallel" if "parallel" in exact.forms
                                else "recurrent")
                given = {}
                for p in params:
                    dims = [m] + [sizes[d] for d in p.shape[1:]]
                    shape = ((heads,) if p.per_head else ()) + tuple(dims)
                    given[p.name] = random_features(seed, shape, orthogonal)
                res = approx.run(inputs, params=given, form="chunkwise" if "chunkwise" in approx.forms
                                 else "recurrent")
                for name in outputs:
                    errors.append(float(np.linalg.norm(res.outputs[name] - ref.outputs[name])
                                        / np.linalg.norm(ref.outputs[name])))
            row = QualityRow(m, orthogonal, float(np.mean(errors)), float(np.std(errors)), seeds)
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def format_row(row: QualityRow) -> str:
    kind = "orthogonal" if row.orthogonal else "i.i.d."
    return f"{row.features:>8}  {kind:<10}  {row.mean_rel_error:10.4f}  ±{row.std_rel_error:.4f}  ({row.seeds} seeds)"


HEADER = f"{'features':>8}  {'kind':<10}  {'rel error':>10}  spread"
