"""NumPy's floating-point warnings from generated code are told at the program's place (backends/float_warnings.py):
the builtin of the .lin file that the ufunc call comes from, once per place; where none fits, the generated line,
quoted. np.errstate and the warnings filters still decide what happens."""
import warnings

import numpy as np
import pytest

import linrec

SOURCE = """recurrence w(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + k⊗{write}
output o = q·S
"""


def _program(tmp_path, write: str, name: str = "w.lin"):
    path = tmp_path / name
    path.write_text(SOURCE.format(write=write), encoding="utf-8")
    return linrec.load(path), str(path)


def _warned(call) -> list[warnings.WarningMessage]:
    """The RuntimeWarnings of call(), each distinct one once (the recurrent form meets a place every token)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    distinct = {(w.filename, w.lineno, str(w.message)): w for w in caught if issubclass(w.category, RuntimeWarning)}
    return list(distinct.values())


@pytest.mark.parametrize("backend, form", [("numpy", "recurrent"), ("numpy", "chunkwise"), ("c", "chunkwise")])
def test_a_builtin_outside_its_domain_is_named_at_its_place(tmp_path, backend, form):
    """log of a negative value: the warning names FILE:4 and the call log(v) at its column, on the NumPy
    forms and in the C backend's NumPy glue (its per-token values), and the run still returns NaN as NumPy
    does."""
    rec, path = _program(tmp_path, "log(v)")
    x = rec.random_inputs(1, 4, 1, seed=0)
    assert (x["v"] < 0).any()
    out = []
    caught = _warned(lambda: out.append(rec.run(x, backend=backend, form=form)))
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == \
        [(path, 4, "invalid value encountered in log, at column 11: log(v)")]
    assert np.isnan(out[0].outputs["o"]).any()


def test_the_place_is_quoted_from_the_line_the_parser_counts(tmp_path):
    """A comment holding a character str.splitlines() breaks at (U+2028; the parser does not) leaves the
    quoted call the one on the line the warning names — it was the text at that column of the line before."""
    path = tmp_path / "sep.lin"
    path.write_text("# a comment \u2028 with a line separator\n" + SOURCE.format(write="log(v)"), encoding="utf-8")
    rec = linrec.load(path)
    caught = _warned(lambda: rec.run(rec.random_inputs(1, 4, 1, seed=0), backend="numpy", form="recurrent"))
    assert [(w.lineno, str(w.message)) for w in caught] == \
        [(5, "invalid value encountered in log, at column 11: log(v)")]


def test_a_decode_step_and_a_builtins_own_helper(tmp_path):
    """A step warns at the same place; a builtin computed by a helper (rmsnorm, whose square overflows) is
    named as the call of that builtin."""
    rec, path = _program(tmp_path, "log(v)")
    x = rec.random_inputs(1, 1, 2, seed=0)
    caught = _warned(lambda: rec.step({name: a[:, 0] for name, a in x.items()}, None))
    assert [(w.filename, w.lineno) for w in caught] == [(path, 4)] and "at column 11: log(v)" in str(caught[0].message)
    rec, path = _program(tmp_path, "rmsnorm(v*1e200)", "norm.lin")
    caught = _warned(lambda: rec.run(rec.random_inputs(1, 4, 1, seed=0)))
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == \
        [(path, 4, "overflow encountered in multiply, at column 11: rmsnorm(v*1e200)")]


def test_without_a_builtin_the_generated_line_is_named_and_quoted(tmp_path):
    """An overflow in a product fits no builtin: the generated line is named, and the warning machinery can
    quote it (the generated source is in linecache)."""
    import linecache
    rec, _ = _program(tmp_path, "((v*1e200)*(v*1e200))")
    caught = _warned(lambda: rec.run(rec.random_inputs(1, 4, 1, seed=0)))
    assert caught and all(w.filename.startswith("<linrec ") for w in caught)
    assert str(caught[0].message) == "overflow encountered in multiply"
    assert "1e+200" in linecache.getline(caught[0].filename, caught[0].lineno)


def test_once_per_place_and_numpys_modes_respected(tmp_path):
    """Under the default filter a place warns once however many calls reach it; np.errstate(all="raise")
    raises as NumPy would, and warnings.simplefilter("error") raises the located warning."""
    rec, _ = _program(tmp_path, "log(v)")
    x = rec.random_inputs(1, 4, 1, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            rec.run(x)
            rec.run(x, backend="c", form="chunkwise")
    assert len([w for w in caught if "log(v)" in str(w.message)]) == 1
    with np.errstate(all="raise"), pytest.raises(FloatingPointError, match="invalid value encountered in log"):
        rec.run(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="at column 11: log"):
            rec.run(x)
