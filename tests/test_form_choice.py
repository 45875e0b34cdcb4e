"""form="auto": at the model grid's shapes the C backend's fastest measured form (form_table.json); elsewhere
a fused compiled kernel runs the recurrent form, otherwise the cheaper measured form. No timing here: the
table's choices are checked against the table."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import linrec
from linrec import form_choice

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIMS = {"dk": 8, "dv": 8}


def test_numpy_choice_is_the_cheaper_measured_form():
    rec = linrec.load(EXAMPLES / "gated_deltanet.lin")
    form, why = rec.choose_form("numpy", 500, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    costs = form_choice.per_token_cost(rec, "numpy", 2, 1, DIMS, np.float64)
    assert set(costs) == {"recurrent", "chunkwise"} and all(c > 0 for c in costs.values())
    assert form == min(costs, key=costs.get)
    assert "µs/token" in why
    # measured once per process: the same numbers come back
    assert form_choice.per_token_cost(rec, "numpy", 2, 1, DIMS, np.float64) is costs


def test_auto_runs_the_chosen_form():
    rec = linrec.load(EXAMPLES / "gla.lin")
    inputs = rec.random_inputs(batch=1, tokens=100, heads=2, dims=DIMS)
    form, _ = rec.choose_form("numpy", 100, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    auto = rec.run(inputs, backend="numpy")
    chosen = rec.run(inputs, form=form, backend="numpy")
    np.testing.assert_array_equal(auto.outputs["o"], chosen.outputs["o"])


def test_a_param_without_a_default_is_not_guessed_for_the_calibration():
    """The calibration runs the forms on the file's params: with a param that has none (the caller passes it)
    auto does not measure — it once ran the forms without the caller's params, and the call the caller made
    with every param failed asking for one — and takes the chunkwise form, saying why."""
    rec = linrec.compile("""recurrence projected(dk = 8, dv = 8)
input q[dk], k[dk], v[dv]
param M[dk, dk]
state S[dk, dv]
S = 0.9·S + (M·k)⊗v
output o = q·S
""", "projected.lin")
    form, why = rec.choose_form("numpy", 500, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    assert form == "chunkwise" and "not measured" in why and "no default" in why
    assert form_choice.per_token_cost(rec, "numpy", 2, 1, DIMS, np.float64) is None
    inputs = rec.random_inputs(batch=1, tokens=100, heads=2, dims=DIMS)
    params = {"M": np.random.default_rng(0).standard_normal((8, 8))}
    auto = rec.run(inputs, backend="numpy", params=params)
    chunkwise = rec.run(inputs, form="chunkwise", backend="numpy", params=params)
    np.testing.assert_array_equal(auto.outputs["o"], chunkwise.outputs["o"])


def test_short_sequences_and_compiled_code_take_the_recurrent_form():
    rec = linrec.load(EXAMPLES / "retnet.lin")
    assert rec.choose_form("numpy", form_choice.SHORT)[0] == "recurrent"
    assert rec.choose_form("c", 100000)[0] == "recurrent"
    softmax = linrec.load(EXAMPLES / "softmax.lin")
    assert softmax.choose_form("numpy", 4096)[0] == "chunkwise"  # blocked online softmax


def test_c_without_a_fused_recurrent_kernel_measures_like_numpy():
    """A non-causal program with exponential keys runs every form as a NumPy-prepared scan on C: no fused
    kernel to take on trust, so auto measures (and picks the cheaper measured form); GLA's recurrent form
    is the fused kernel, and so is Performer's (the kernel stabilizes its exponential features itself)."""
    encoder = linrec.compile("""recurrence encoder_exp(dk = 8, dv = 8) noncausal
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + exp(k)⊗v
output o = q·S
""", "encoder_exp.lin")
    form, why = encoder.choose_form("c", 500, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    costs = form_choice.per_token_cost(encoder, "c", 2, 1, DIMS, np.float64)
    assert form == min(costs, key=costs.get) and "µs/token" in why
    for name, dims in (("gla", DIMS), ("performer", {"dk": 8, "dv": 8, "m": 16})):
        form, why = linrec.load(EXAMPLES / f"{name}.lin").choose_form("c", 500, heads=2, batch=1, dims=dims)
        assert form == "recurrent" and "compiled recurrent kernel" in why, name


def _grid_programs() -> dict:
    """The examples by update structure (the table's key)."""
    recs = [linrec.load(path) for path in sorted(EXAMPLES.glob("*.lin"))]
    return {form_choice.structure(r.compiled): r for r in recs if form_choice.grid_sizes(r.compiled, {
        d.name: d.default for d in r.program.dims}) is not None}


def test_auto_takes_the_fastest_form_the_table_measured():
    """At every shape of the shipped table, a float32 C call of a program of that structure takes the row's
    fastest form, and says it was measured; the table covers the grid's (dk, dv) for each structure it has."""
    table = json.loads(form_choice.FORM_TABLE.read_text(encoding="utf-8"))
    assert table["backend"] == "c" and table["dtype"] == "float32" and table["rows"]
    by_structure = _grid_programs()
    checked = 0
    for row in table["rows"]:
        rec = by_structure.get(row["structure"])
        if rec is None:
            continue
        form, why = rec.choose_form("c", row["T"], heads=row["H"], batch=row["B"],
                                    dims={"dk": row["dk"], "dv": row["dv"]}, dtype=np.float32)
        assert form == min(row["ms"], key=row["ms"].get), row
        assert "fastest measured at this shape of the model grid" in why and f"{row['ms'][form]:.1f} ms" in why
        checked += 1
    assert checked == len(table["rows"])
    measured = {(r["structure"], r["dk"], r["dv"]) for r in table["rows"]}
    for key in {r["structure"] for r in table["rows"]}:
        assert {(dk, dv) for s, dk, dv in measured if s == key} == {(64, 64), (128, 128), (256, 256), (128, 64)}


def test_the_table_decides_and_off_the_grid_the_rules_do(tmp_path, monkeypatch):
    """A table where the chunkwise form wins one shape: auto takes it there, for every program of that
    structure; at another T, H, dtype or backend, or for another structure, the rules decide as before."""
    gla = linrec.load(EXAMPLES / "gla.lin")
    key = form_choice.structure(gla.compiled)
    fake = {"backend": "c", "dtype": "float32", "measured_on": "a test", "rows": [
        {"structure": key, "programs": ["gla"], "dk": 128, "dv": 128, "H": 8, "B": 1, "T": 4096,
         "ms": {"recurrent": 20.0, "chunkwise": 10.0}},
        {"structure": key, "programs": ["gla"], "dk": 64, "dv": 64, "H": 8, "B": 1, "T": 4096,
         "ms": {"recurrent": 5.0}}]}  # one form measured: no choice to make
    path = tmp_path / "form_table.json"
    path.write_text(json.dumps(fake), encoding="utf-8")
    monkeypatch.setattr(form_choice, "FORM_TABLE", path)
    dims = {"dk": 128, "dv": 128}
    form, why = gla.choose_form("c", 4096, heads=8, batch=1, dims=dims, dtype=np.float32)
    assert form == "chunkwise" and "chunkwise 10.0 ms, recurrent 20.0 ms" in why
    same = linrec.compile((EXAMPLES / "gla.lin").read_text().replace("gla(", "renamed("), "renamed.lin")
    assert same.choose_form("c", 4096, heads=8, batch=1, dims=dims, dtype=np.float32)[0] == "chunkwise"
    off_grid = [("c", 4000, 8, 1, dims, np.float32), ("c", 4096, 16, 1, dims, np.float32),
                ("c", 4096, 8, 4, dims, np.float32), ("c", 4096, 8, 1, {"dk": 128, "dv": 64}, np.float32),
                ("c", 4096, 8, 1, dims, np.float64), ("c", 4096, 8, 1, {"dk": 64, "dv": 64}, np.float32)]
    for backend, tokens, heads, batch, sizes, dtype in off_grid:
        form, why = gla.choose_form(backend, tokens, heads=heads, batch=batch, dims=sizes, dtype=dtype)
        assert form == "recurrent" and "compiled recurrent kernel" in why, (tokens, heads, batch, sizes, dtype)
    mamba2 = linrec.load(EXAMPLES / "mamba2.lin")  # another structure
    assert "compiled recurrent kernel" in mamba2.choose_form("c", 4096, heads=8, batch=1, dims=dims)[1]
    assert form_choice.measured_choice(gla, "numpy", 4096, 8, 1, dims, np.float32, ["recurrent", "chunkwise"],
                                       path) is None


def test_structure_is_the_update_not_the_name():
    by_structure = _grid_programs()
    gdn, comba = (linrec.load(EXAMPLES / f"{n}.lin") for n in ("gated_deltanet", "comba"))
    assert form_choice.structure(gdn.compiled) == form_choice.structure(comba.compiled)
    names = {r.name for r in by_structure.values()}
    assert {"gla", "mamba2", "retnet"} <= names  # distinct structures: a diagonal, a data-dependent, a fixed decay
    assert form_choice.grid_sizes(gdn.compiled, {"dk": 128, "dv": 64}) == (128, 64)


def test_the_structure_counts_value_side_corrections():
    """More value-side corrections cost more per token: the table's key tells the programs apart (it counts
    the corrections of either side, as it does the key side's). The product of two factors (I − β·vn⊗vn)
    expands to three rank-one terms."""
    source = (EXAMPLES / "gated_oja.lin").read_text()
    one = linrec.compile(source, "gated_oja.lin")
    two = linrec.compile(source.replace("·(I − beta·vn⊗vn)", "·(I − beta·vn⊗vn)·(I − beta·vn⊗vn)"), "two.lin")
    assert "1 correction(s)" in form_choice.structure(one.compiled)
    assert "3 correction(s)" in form_choice.structure(two.compiled)
