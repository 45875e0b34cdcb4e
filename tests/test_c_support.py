"""linrec.c.support's verdicts against the printers: the C backend says which recurrent kernel takes a program
from the program's structure (backends/c/support.py), and the kernels' generators print it. The two must
agree: a verdict "takes it" whose printer then finds an expression it has no C for would be a bug (an
internal error, UnprintableError), and a refusal of something the printer spells would turn users away
from C for nothing.

Over every example, every program written in the tests (string constants of tests/*.py that compile) and
the programs below that aim at each refusal: per kernel — the fused one (fused.py) and the statement
kernel (statements.py) — at the file's sizes (float64) and at odd sizes (float32),

- the generator takes the program exactly when the predicate does, and refuses it with the predicate's
  reason (its constructor asks the predicate: one source of truth);
- for a program within the kernel's limits (support.*_limits: what the kernel is not built for), the
  printer itself, with the constructor's check set aside, prints every expression exactly when the
  spelling rules (support.*_unspellable) find nothing in the way — the rules follow the printers' dispatch.

The reasons name the place and what is in the way (test_reasons_name_the_place); users see them with the
advice (test_users_see_the_reason_and_the_advice).
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from linrec.c import statements as c_statements
from linrec.c import fused as c_fused
from linrec.c import support
from linrec.c.build import CTYPES, vector_bytes
from linrec.c.statements import StatementKernel
from linrec.c.fused import FusedKernel, Target
from linrec.c.printer import UnprintableError
from linrec.compiler import compile_source
from linrec.dsl.errors import LinrecError

ROOT = Path(__file__).resolve().parent.parent

HEAD = """recurrence {name}(dk = 4, dv = 3){causal}
input q[dk], k[dk], v[dv], w[dv], g[dk] <= 0, a <= 0, beta in (0, 1)
"""
# programs aimed at each refusal (and a few near misses each kernel takes): name → the lines after HEAD
AIMED = {
    # softmax of a vector, at every place each kernel prints (every builtin has a C spelling: both take these)
    "softmax_output": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = softmax(q·S)\n",
    "softmax_query": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = softmax(q)·S\n",
    "softmax_decay": "state S[dk, dv]\nS = diag(softmax(g))·S + k⊗v\noutput o = q·S\n",
    "softmax_key": "state S[dk, dv]\nS = exp(a)·S + softmax(k)⊗v\noutput o = q·S\n",
    "softmax_value": "state S[dk, dv]\nS = exp(a)·S + k⊗softmax(v)\noutput o = q·S\n",
    "softmax_correction": "state S[dk, dv]\nS = (I − beta·softmax(k)⊗k)·S + k⊗v\noutput o = q·S\n",
    "softmax_correction_w": "state S[dk, dv]\nS = S − beta·k⊗(softmax(k)·S) + k⊗v\noutput o = q·S\n",
    "softmax_vector_state": "state z[dk]\nz = exp(a)*z + softmax(k)\noutput o = z\n",
    "softmax_bound_value": "state S[dk, dv]\np = softmax(q·S)\nS = exp(a)·S + k⊗v\noutput o = p + w\n",
    "softmax_noncausal": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = softmax(q·S)\n",
    "softmax_scalar": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = sum(softmax(k))·(q·S)\n",
    "softmax_matrix_update": "state S[dk, dv]\nS = diag(exp(g))·S·diag(softmax(w)) − S·(w⊗w) + k⊗v\noutput o = q·S\n",
    # a state read other than through a readout q·S (the statement kernel takes it)
    "state_as_value": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = q·S\noutput p = S·w\n",
    "state_in_query": "state S[dk, dv], U[dk, dk]\nU = exp(a)·U + k⊗k\nS = exp(a)·S + k⊗v\noutput o = (q·U)·S\n",
    # what the fused kernel is not built for (the statement kernel takes it)
    "transposed": "state S[dv, dk]\nS = S·(I − beta·k⊗k) + beta·v⊗k\noutput o = S·q\n",
    "value_decay": "input e[dv] <= 0\nstate S[dk, dv]\nS = S·diag(exp(e)) + k⊗v\noutput o = q·S\n",
    "dense": "param W[dk, dk] = randn(std=0.2, seed=1)\nstate S[dk, dv]\nS = W·S + k⊗v\noutput o = q·S\n",
    "matrix_input": "input A[dk, dk] in (-0.1, 0.1)\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = q·S\n"
                    "output r = A·q\n",
    # a matrix per token, or a product with a matrix that is no parameter (the statement kernel takes it)
    "matrix_per_token": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = q·S\noutput r = (k⊗k)·q\n",
    "matrix_product": "param M[dk, dk] = randn(std=0.2, seed=1)\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\n"
                      "output o = q·S\noutput r = (M·M)·q\n",
    "matrix_function": "param M[dk, dk] = randn(std=0.2, seed=1)\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\n"
                       "output o = (tanh(M)·q)·S\n",
    "identity_minus_outer": "state S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = ((I − k⊗k)·q)·S\n",
    # values of three axes: neither kernel
    "rank3_input": "input A[dk, dk, dv]\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\noutput o = q·S + sum(q·A·v)·v\n",
    "rank3_param": "param P[dk, dk, dv] = randn(std=0.1, seed=2)\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\n"
                   "output o = q·S + sum(q·P·v)·v\n",
    # exponential feature maps: stabilized in the fused kernel only
    "stabilized_value_decay": "input e[dv] <= 0\nstate S[dk, dv]\nS = S·diag(exp(e)) + exp(k)⊗v\n"
                              "output o = exp(q)·S\n",
    "stabilized_softmax": "state S[dk, dv]\nS = S + exp(k)⊗v\noutput o = softmax(exp(q)·S)\n",
    "stabilized_query_softmax": "state S[dk, dv]\nS = S + exp(k)⊗v\noutput o = exp(softmax(q))·S\n",
    "stabilized_fused": "state S[dk, dv], z[dk]\nS = S + exp(k)⊗v\nz = z + exp(k)\n"
                        "output o = (exp(q)·S)/(exp(q)·z)\n",
    # near misses: both kernels take them
    "matrix_parameter": "param M[dk, dk] = randn(std=0.2, seed=1)\nstate S[dk, dv]\nS = exp(a)·S + k⊗v\n"
                        "output o = (M·q)·S + (q·M)·S\n",
    "builtins": "state S[dk, dv]\nS = diag(sigmoid(g))·S + (elu(k) + 1)⊗silu(v)\n"
                "output o = groupnorm(l2norm(q)·S) * exp(mean(q)) + rmsnorm(w)*softplus(norm(k))\n",
    "vector_state_values": "state z[dk], S[dk, dv]\nz = diag(exp(g))·z + beta*k\nS = exp(a)·S + k⊗v\n"
                           "output y = z*sigmoid(q) + sum(z)\noutput o = q·S\n",
}


def aimed_source(name: str) -> str:
    return HEAD.format(name=name, causal=" noncausal" if "noncausal" in name else "") + AIMED[name]


# (fused, statements): None where the kernel takes the program, else what its reason must say
PLACE = "output 'o'"
REASONS = {
    "softmax_output": (None, None),
    "softmax_query": (None, None),
    "softmax_decay": (None, None),
    "softmax_key": (None, None),
    "softmax_value": (None, None),
    "softmax_correction": (None, None),
    "softmax_correction_w": (None, None),
    "softmax_vector_state": (None, None),
    "softmax_bound_value": (None, None),
    "softmax_noncausal": (None, None),
    "softmax_scalar": (None, None),
    "softmax_matrix_update": (("not a decay plus rank-one terms",), None),
    "state_as_value": (("output 'p'", "`S·w`", "reads state 'S' only through readouts"), None),
    "state_in_query": ((PLACE, "`q·U·S`", "reads state 'S' only through readouts"), None),
    "transposed": (("state 'S' is multiplied and read from the right",), None),
    "value_decay": (("state 'S' decays its value axis",), None),
    "dense": (("the update of state 'S' is not a decay plus rank-one terms", "dense matrix `W`"), None),
    "matrix_input": (("input 'A' has shape [dk, dk]",), None),
    "matrix_per_token": (("output 'r'", "`k⊗k·q`", "only when the matrix is a parameter"), None),
    "matrix_product": (("output 'r'", "`M·M·q`", "only when the matrix is a parameter"), None),
    "matrix_function": (("a readout of state 'S'", "`tanh(M)·q`", "only when the matrix is a parameter"), None),
    "identity_minus_outer": (("a readout of state 'S'", "`(I − k⊗k)·q`"), None),
    "rank3_input": (("input 'A' has shape [dk, dk, dv]",), ("input 'A' has shape [dk, dk, dv]", "up to matrices")),
    "rank3_param": ((PLACE, "`q·P·v`"), ("param 'P' has shape [dk, dk, dv]", "up to matrices")),
    "stabilized_value_decay": (("state 'S' decays its value axis",),
                               ("stabilized only in the fused kernel", "does not take it", "decays its value axis")),
    "stabilized_softmax": (None, ("stabilized only in the fused kernel",)),
    "stabilized_query_softmax": (None, ("stabilized only in the fused kernel",)),
    "stabilized_fused": (None, ("stabilized only in the fused kernel",)),
    "matrix_parameter": (None, None),
    "builtins": (None, None),
    "vector_state_values": (None, None),
}


def _written_in_tests() -> list[str]:
    """Every string constant of tests/*.py that holds a program and compiles."""
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "recurrence " in node.value:
                try:
                    compile_source(node.value)
                except LinrecError:
                    continue  # (a test of an error message)
                found.append(node.value)
    return found


def _corpus() -> dict[str, str]:
    sources = {f"example {p.stem}": p.read_text(encoding="utf-8") for p in sorted((ROOT / "examples").glob("*.lin"))}
    seen = set(sources.values())
    for i, src in enumerate(_written_in_tests()):
        if src not in seen:
            seen.add(src)
            sources[f"tests {i:02d} {compile_source(src).name}"] = src
    sources.update({f"aimed {name}": aimed_source(name) for name in AIMED})
    return sources


CORPUS = _corpus()
# per kernel: its generator, the module whose constructor asks the predicate, the name it asks by, and
# the predicate's parts
KERNELS = {
    "fused": (FusedKernel, c_fused, "fused_refusal", support.fused_limits, support.fused_unspellable),
    "statements": (StatementKernel, c_statements, "statements_refusal", support.statements_limits,
                   support.statements_unspellable),
}


def _builds(compiled) -> list[tuple[dict, Target]]:
    """The sizes and targets each kernel is generated for here: the file's sizes in float64, odd ones
    (no whole register, no power of two) in float32."""
    default = {d.name: d.default for d in compiled.program.dims}
    odd = {d.name: 3 + 2 * i for i, d in enumerate(compiled.program.dims)}
    return [(default, Target(CTYPES[np.dtype(np.float64)], vector_bytes())),
            (odd, Target(CTYPES[np.dtype(np.float32)], vector_bytes()))]


def test_the_corpus_is_what_it_should_be():
    """Examples, tests' programs and the aimed ones are all there, and each kernel refuses some and takes
    some (a corpus every program of which one kernel takes would test nothing)."""
    assert sum(n.startswith("example ") for n in CORPUS) == len(list((ROOT / "examples").glob("*.lin"))) >= 10
    assert sum(n.startswith("tests ") for n in CORPUS) >= 50
    for kernel in KERNELS:
        refusal = getattr(support, f"{kernel}_refusal")
        verdicts = [refusal(compile_source(src)) is None for src in CORPUS.values()]
        assert 10 <= sum(verdicts) <= len(verdicts) - 10, kernel


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", list(CORPUS))
def test_verdicts_agree_with_the_printers(name, kernel, monkeypatch):
    compiled = compile_source(CORPUS[name], f"{name.split()[-1]}.lin")
    generator, module, asks, limits, unspellable = KERNELS[kernel]
    refusal = getattr(support, asks)(compiled)
    for dims, target in _builds(compiled):
        if refusal is None:
            generator(compiled, dims, target).context()
        else:
            with pytest.raises(LinrecError) as err:
                generator(compiled, dims, target)
            assert err.value.message == refusal
    if limits(compiled) is not None:
        return  # (what the kernel is not built for: its printer is not meant to see the program)
    # the printer on its own: it prints the program exactly when the spelling rules find nothing in the way
    monkeypatch.setattr(module, asks, limits)
    expected = unspellable(compiled)
    for dims, target in _builds(compiled):
        if expected is None:
            generator(compiled, dims, target).context()
        else:
            with pytest.raises(UnprintableError):
                generator(compiled, dims, target).context()


@pytest.mark.parametrize("name", list(AIMED))
def test_reasons_name_the_place(name):
    compiled = compile_source(aimed_source(name), f"{name}.lin")
    for kernel, expected in zip(KERNELS, REASONS[name]):
        reason = getattr(support, f"{kernel}_refusal")(compiled)
        if expected is None:
            assert reason is None, (kernel, reason)
            continue
        assert reason is not None, kernel
        for part in expected:
            assert part in reason, (kernel, part, reason)
        assert "NumPy" not in reason and "numpy" not in reason  # (the advice is the backend's to add)


def test_the_fused_verdict_is_kept_per_program_and_dropped_with_it():
    """fused_refusal answers once per program object (callers ask it several times a call) and forgets the
    program when it is gone: another program compiled later, in the same memory or not, gets its own answer."""
    import gc
    takes, refused = compile_source(CORPUS["example gla"]), compile_source(aimed_source("stabilized_value_decay"))
    reason = support.fused_refusal(refused)
    assert support.fused_refusal(takes) is None and reason is not None
    assert support.fused_refusal(refused) is reason  # (the kept answer, not a second walk)
    keys = {id(takes), id(refused)}
    assert keys <= set(support._FUSED_REFUSALS)
    del takes, refused
    gc.collect()
    assert not keys & set(support._FUSED_REFUSALS)
    for name in ("example gla", "example mamba1"):  # (new programs, perhaps at the freed addresses)
        again = compile_source(CORPUS[name])
        assert support.fused_refusal(again) == (support.fused_limits(again) or support.fused_unspellable(again))


def test_users_see_the_reason_and_the_advice(tmp_path, capsys):
    """rec.run and `linrec run` on C: one sentence — the form, the program, the reason, the advice (which
    holds: NumPy runs it); `linrec check` lists the backends that build each form."""
    import linrec
    from linrec.cli import main
    rec = linrec.compile(aimed_source("stabilized_value_decay"), "stabilized_value_decay.lin")
    expected = ("the c backend does not build the recurrent form of 'stabilized_value_decay': its exponential "
                "feature maps are stabilized only in the fused kernel, which does not take it: state 'S' decays its "
                "value axis (`S·diag(…)`), which the fused kernel's lazy decay of the rows does not take; the NumPy "
                "backend (backend='numpy') runs it")
    inputs = rec.random_inputs(batch=1, tokens=3, heads=1)
    with pytest.raises(LinrecError) as err:
        rec.run(inputs, form="recurrent", backend="c")
    assert err.value.message == expected
    assert np.isfinite(rec.run(inputs, form="recurrent", backend="numpy").outputs["o"]).all()
    path = tmp_path / "stabilized_value_decay.lin"
    path.write_text(aimed_source("stabilized_value_decay"))
    assert main(["check", str(path)]) == 0
    assert "recurrent   available (backends: numpy)\n" in capsys.readouterr().out
    assert main(["run", str(path), "--backend", "c", "--form", "recurrent"]) == 1
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()) and err.count("error:") == 1 and "internal error" not in err
    # a program the statement kernel takes: C runs it, and says how
    path.write_text(aimed_source("state_as_value"))
    assert main(["check", str(path)]) == 0
    assert "recurrent   available (backends: numpy, c; C runs its statements one by one)" in capsys.readouterr().out
