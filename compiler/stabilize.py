"""Exponential feature maps, stabilized (forms.md §8): which states are carried as S·exp(−M), M the running
maximum of their write keys' exponents, and how outputs scale with the readouts' scales. Both backends
stabilize the same states (the NumPy scans on the decomposition, C's fused kernel a token at a time)."""
from __future__ import annotations

from . import Compiled, ir
from .analysis import children, variance
from .transitions import split_exp


def stabilized_states(compiled: Compiled) -> dict[str, tuple]:
    """States whose every write key is c·exp(α) with α varying per token (exponential feature maps) and
    that have no correction: they are carried as S·exp(−M) with M the running maximum of α (forms.md §8).
    Returns state → the α of each write; states with equal α share one M. A program with no derived forms
    has none, nor has one derived in stages (compiler.stages; each stage is stabilized as a program of its own): its reads are not all readouts q·S, which the scales are folded into (it runs as written)."""
    out = {}
    if compiled.decomposition.why_not("chunkwise") or compiled.decomposition.stages:  # (stages: each has its own)
        return out
    for t in compiled.decomposition.transitions:
        if t.corrections or t.value_corrections or not t.writes or not t.factorable:
            continue
        alphas = [split_exp(key)[1] for key, _ in t.writes]
        if all(a is not None and variance(a) == "token" for a in alphas):
            out[t.state] = tuple(alphas)
    return out


def log_scale_keys(compiled: Compiled) -> dict[str, str]:
    """State → the name under which a decode loop carries its log-scale ("S.log_scale", shared by the
    states whose keys have the same exponents)."""
    first: dict[tuple, str] = {}
    return {state: f"{first.setdefault(alphas, state)}.log_scale"
            for state, alphas in stabilized_states(compiled).items()}


# builtins f with f(c·x) = c·f(x) for every c > 0, as exp(scale) is: a scale passes through them (Aaren's
# a/sum(c) cancels its scales, where multiplying them back overflowed)
POSITIVELY_HOMOGENEOUS = frozenset({"sum", "mean", "norm", "abs", "relu"})


def scale_degree(e: ir.Expr, scale_of: dict[int, str]) -> dict[str, int] | None:
    """How an output scales when readout i is multiplied by exp(scale_of[i]): exponents per scale, or None
    when the output is not a product of powers (then the scales are multiplied back in)."""
    if isinstance(e, ir.ReadoutRef):
        return {scale_of[e.index]: 1} if e.index in scale_of else {}
    kids = children(e)
    if not kids:
        return {}
    degrees = [scale_degree(k, scale_of) for k in kids]
    if any(dg is None for dg in degrees):
        return None
    if isinstance(e, ir.Neg) or (isinstance(e, ir.Apply) and e.function in POSITIVELY_HOMOGENEOUS):
        return degrees[0]
    if isinstance(e, (ir.Dot, ir.Outer)) or (isinstance(e, ir.Arith) and e.op == "mul"):
        return {k: degrees[0].get(k, 0) + degrees[1].get(k, 0) for k in degrees[0].keys() | degrees[1].keys()}
    if isinstance(e, ir.Arith) and e.op == "div":
        return {k: degrees[0].get(k, 0) - degrees[1].get(k, 0) for k in degrees[0].keys() | degrees[1].keys()}
    nonzero = [{k: v for k, v in dg.items() if v} for dg in degrees]
    if isinstance(e, ir.Arith) and e.op in ("add", "sub") and nonzero[0] == nonzero[1]:
        return nonzero[0]
    return {} if not any(nonzero) else None
