"""The command line: check, emit, run (npz round trip), verify; bad input exits 1 with one message."""
from __future__ import annotations

import errno
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec import verify, verify_grad
from linrec.cli import main

EXAMPLES = sorted(Path(__file__).resolve().parent.parent.joinpath("examples").glob("*.lin"))
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_reports_classes_and_forms(path, capsys):
    assert main(["check", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rec = linrec.load(path)
    assert [s["name"] for s in info["states"]] == [s.name for s in rec.program.states]
    text = json.dumps(info)
    for t in rec.decomposition.transitions:
        assert t.kind in text
    for form in ("recurrent", "parallel", "chunkwise"):
        assert form in text


VECTOR_DELTA = """recurrence vz(dk = 8, dv = 8)
input k[dk]
input beta in (0, 1)
state z[dk]
z = (I − beta·k⊗k)·z + k
output o = z
"""


def test_check_says_why_a_backend_does_not_build_a_form_that_exists(tmp_path, capsys):
    """A vector state with a delta-rule correction: its derived forms and backwards exist on NumPy, not on C,
    and check gives C's own reason (it said only 'backends: numpy')."""
    path = tmp_path / "vz.lin"
    path.write_text(VECTOR_DELTA)
    rec = linrec.load(path)
    assert main(["check", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    forms = {f["form"]: f for f in info["forms"]}
    assert forms["parallel"]["backends"] == ["numpy"]
    assert forms["parallel"]["refused"] == {"c": str(linrec.registry.backend("c").why_not(rec.compiled, "parallel"))}
    assert "rank-one correction" in forms["parallel"]["refused"]["c"]
    assert forms["recurrent"]["refused"] == {}
    grads = {g["form"]: g for g in info["gradients"]}
    assert set(grads["chunkwise"]["refused"]) == {"c"} and "C backward" in grads["chunkwise"]["refused"]["c"]
    assert main(["check", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.count("not on c: ") == 5  # parallel, chunkwise; the three backwards


def test_an_unknown_option_names_its_command(capsys):
    for argv, prog in ((["verify", str(EXAMPLES[0]), "--tokens", "1"], "linrec verify"), (["--bogus"], "linrec")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 1
        assert err.startswith(f"{prog}: error: unrecognized arguments: ") and f"(see '{prog} --help')" in err


def test_emit_prints_python_source(capsys):
    assert main(["emit", str(EXAMPLES[0]), "--form", "chunkwise"]) == 0
    source = capsys.readouterr().out
    compile(source, "emitted.py", "exec")  # valid Python
    assert "def forward(" in source and "chunkwise_scan" in source


def test_emit_grad_says_which_form_it_is(capsys):
    """The backward module's first line names the gradient form asked for (it said "recurrent" for every one)."""
    gla, softmax = (str(next(p for p in EXAMPLES if p.stem == name)) for name in ("gla", "softmax"))
    for file, backend, form in ((gla, "numpy", "parallel"), (gla, "c", "chunkwise"), (softmax, "c", "recurrent"),
                                (softmax, "c", "parallel")):
        assert main(["emit", file, "--grad", "--form", form, "--backend", backend]) == 0
        assert f" — {form} backward (the adjoint" in capsys.readouterr().out.splitlines()[0]


def test_emit_prints_the_c_kernels_at_the_sizes_asked_for(capsys):
    """--dim with --backend c prints the kernel compiled at those sizes — at a model's head size a delta rule's
    pass goes in strips of two registers' columns, at the file's default size (16) in one — as Recurrence.emit(…,
    dims=) gives it; before, --dim went with --standalone only (files), and the printed kernel was the file's."""
    path = next(p for p in EXAMPLES if p.stem == "gated_deltanet")
    rec = linrec.load(path)
    assert main(["emit", str(path), "--backend", "c", "--dim", "dk=128", "--dim", "dv=128"]) == 0
    source = capsys.readouterr().out
    assert source == rec.emit("recurrent", "c", dims={"dk": 128, "dv": 128})
    assert "Sizes (compile-time constants): dk = 128, dv = 128." in source
    assert "js < 128; js += 32" in source and "js < 16; js += 16" in rec.emit("recurrent", "c")
    assert main(["emit", str(path), "--backend", "c", "--form", "chunkwise", "--dim", "dk=32"]) == 0
    assert capsys.readouterr().out == rec.emit("chunkwise", "c", dims={"dk": 32, "dv": 16})


@pytest.mark.parametrize("argv, message", [
    (["--dim", "dk=64"], "--dim sizes the C kernels: add --backend c"),
    (["--backend", "c", "--grad", "--dim", "dk=64"], "takes its sizes when it runs: leave out --dim"),
    (["--backend", "c", "--dim", "dq=64"], "--dim dq=64: 'gla' has no dimension 'dq'"),
    (["--backend", "c", "--heads", "4"], "--out and --heads go with --standalone"),
])
def test_emit_says_where_dim_does_not_apply(capsys, argv, message):
    assert main(["emit", str(next(p for p in EXAMPLES if p.stem == "gla")), *argv]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_the_api_emits_c_at_sizes_and_refuses_them_where_they_are_not_compiled():
    rec = linrec.load(next(p for p in EXAMPLES if p.stem == "gla"))
    assert "dk = 64, dv = 16." in rec.emit("recurrent", "c", dims={"dk": 64})
    assert rec.emit("recurrent", "c", dims={}) == rec.emit("recurrent", "c")
    with pytest.raises(linrec.LinrecError, match="numpy backend's source takes its sizes when it runs"):
        rec.emit("recurrent", "numpy", dims={"dk": 64})
    for dims, message in (({"dk": 0}, "whole number ≥ 1"), ({"dk": 8.0}, "whole number ≥ 1"),
                          ({"dq": 8}, "no dimension 'dq'"), ([("dk", 8)], "dims must be a dict")):
        with pytest.raises(linrec.LinrecError, match=message):
            rec.emit("recurrent", "c", dims=dims)


def test_run_refuses_a_directory_as_its_npz_before_running(tmp_path, capsys):
    """--out DIR wrote DIR.npz beside the directory, after the run: now an error before any work."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    for option in ("--out", "--save-inputs"):
        assert main(["run", gla, "--tokens", "4", "--quiet", option, str(tmp_path)]) == 1
        assert f"cannot write {option} {tmp_path}: it is a directory" in capsys.readouterr().err
    assert list(tmp_path.parent.glob(f"{tmp_path.name}.npz")) == []


def test_verify_refuses_what_it_would_ignore_or_check_nothing(capsys):
    gla, linformer = (str(next(p for p in EXAMPLES if p.stem == name)) for name in ("gla", "linformer"))
    for argv, message in ((["--seeds", "2"], "--seeds goes with --against"),
                          (["--grad", "--state-dtype", "bfloat16"], "leave out --state-dtype"),
                          (["--grad", "--form", "step"], "has no step gradient form to verify"),
                          (["--grad", "--against", gla], "--grad and --against are two checks"),
                          (["--state-dtype", "bfloat16", "--dtype", "float64"], "there is no such row"),
                          (["--state-dtype", "bfloat16", "--form", "parallel"], "there is no such row")):
        assert main(["verify", gla, "--quick", *argv]) == 1
        assert message in capsys.readouterr().err
    assert main(["verify", linformer, "--quick", "--backend", "numpy", "--dtype", "float64"]) == 1
    assert "nothing to check" in capsys.readouterr().err
    # found by probing: --against ignored these without a word (--seed read as other inputs); a repeated
    # choice checked every row again
    for option in (["--seed", "5"], ["--form", "parallel"], ["--dtype", "float32"]):
        assert main(["verify", gla, "--against", gla, "--seeds", "1", *option]) == 1
        assert f"which {option[0]} would not change: leave it out" in capsys.readouterr().err
    once = ["--form", "chunkwise", "--dtype", "float64", "--backend", "numpy", "--json"]
    counts = []
    for argv in (once, once[:2] + once):
        assert main(["verify", gla, "--quick", *argv]) == 0
        counts.append(len(json.loads(capsys.readouterr().out)["rows"]))
    assert counts[0] == counts[1] > 0
    # --grad --form: the rows of that gradient form only (the reference computed all the same)
    assert main(["verify", gla, "--grad", "--quick", "--form", "parallel", "--backend", "numpy", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and {r["form"] for r in rows} == {"parallel"}


def test_verify_dim_runs_every_case_at_the_given_sizes(capsys, monkeypatch):
    """verify --dim: the head sizes a model uses in every case (the C kernels tile, block and split by them),
    for the forms and the gradient forms alike; the size-1 axis case keeps its axis of one."""
    gla, linformer = (str(next(p for p in EXAMPLES if p.stem == name)) for name in ("gla", "linformer"))
    program = linrec.load(gla).program
    for battery in (verify.battery, verify_grad.battery):
        cases = battery(program, quick=True, sizes={"dv": 12})
        assert all(c.dims["dv"] == 12 for c in cases) and any(c.dims["dk"] != 12 for c in cases)
    size_one = next(c for c in verify.battery(program, sizes={"dk": 40}) if c.name == "size-1 axis")
    assert size_one.dims["dk"] == 1
    seen = []
    for module in (verify, verify_grad):
        real = module.battery
        monkeypatch.setattr(module, "battery", lambda *a, real=real, **k: seen.append(a[2:]) or real(*a, **k))
    for extra in ([], ["--grad"]):
        argv = ["verify", gla, "--quick", "--backend", "numpy", "--form", "chunkwise", "--dim", "dk=7",
                "--dim", "dv=3", *extra]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "in every case dk = 7, dv = 3" in out.splitlines()[0] and "0 failed" in out
    assert seen == [({"dk": 7, "dv": 3},)] * 2
    for argv, message in ((["--dim", "dq=3"], "'gla' has no dimension 'dq'; its dimensions are dk, dv"),
                          (["--against", gla, "--dim", "dk=4"], "which --dim would not change")):
        assert main(["verify", gla, *argv]) == 1
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (a usage error, as every command's --dim)
        main(["verify", gla, "--dim", "dk=0"])
    assert "argument --dim: expected a positive integer, got '0'" in capsys.readouterr().err
    assert main(["verify", linformer, "--dim", "T=64"]) == 1
    assert "verify runs each case at its own sequence length" in capsys.readouterr().err


def test_run_npz_round_trip(tmp_path, capsys):
    path = Path(__file__).resolve().parent.parent / "examples" / "gla.lin"
    rec = linrec.load(path)
    inputs = rec.random_inputs(1, 9, 2, dims={"dk": 3, "dv": 5}, dtype=np.float32, seed=2)
    s0 = np.random.default_rng(0).standard_normal((1, 2, 3, 5)).astype(np.float32)
    np.savez(tmp_path / "in.npz", S=s0, **inputs)
    assert main(["run", str(path), "--inputs", str(tmp_path / "in.npz"), "--out", str(tmp_path / "out.npz"),
                 "--form", "recurrent", "-q"]) == 0
    out = np.load(tmp_path / "out.npz")
    expected = rec.run(inputs, form="recurrent", initial_state={"S": s0})
    assert out["o"].dtype == np.float32 and out["S"].shape == (1, 2, 3, 5)
    np.testing.assert_allclose(out["o"], expected.outputs["o"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["S"], expected.final_state["S"], rtol=0, atol=1e-6)


def test_run_without_inputs_prints_a_summary(capsys):
    assert main(["run", str(EXAMPLES[0])]) == 0
    assert "output" in capsys.readouterr().out


def test_verify_json_passes(capsys):
    path = Path(__file__).resolve().parent.parent / "examples" / "gated_deltanet.lin"
    code = main(["verify", str(path), "--quick", "--json", "--backend", "numpy", "--form", "chunkwise"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"]
    assert {r["case"] for r in report["rows"]} >= {"T=1", "strong decay", "long T"}
    assert all(r["max_rel"] <= r["tolerance"] for r in report["rows"])


def test_bad_program_exits_1_with_location(tmp_path, capsys):
    bad = tmp_path / "bad.lin"
    bad.write_text("recurrence bad(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                   "S = S·S + k⊗v\noutput o = q·S\n")
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:4:5: error:" in err and "Traceback" not in err


def test_missing_input_array_exits_1(tmp_path, capsys):
    np.savez(tmp_path / "in.npz", q=np.zeros((1, 2, 1, 16)))
    assert main(["run", str(EXAMPLES[0]), "--inputs", str(tmp_path / "in.npz")]) == 1
    assert "missing input" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["recurrent", "auto"])
def test_an_npz_member_that_is_not_an_array_exits_1(tmp_path, capsys, form):
    """An .npz whose member is not .npy data (np.load gives its raw bytes): one error naming the file and the
    member, on every path that reads --inputs (--form auto reads it for the sizes first), not an internal error."""
    import zipfile
    weird = tmp_path / "weird.npz"
    with zipfile.ZipFile(weird, "w") as z:
        z.writestr("q.npy", b"not a npy")
    assert main(["run", str(EXAMPLES[0]), "--inputs", str(weird), "--form", form]) == 1
    err = capsys.readouterr().err
    assert f"{weird}: member 'q' is not a NumPy array; write it with np.savez" in err
    assert "internal error" not in err


# the state read from the right (S·w): a recurrent form only, on NumPy only
RANK3 = """recurrence rank3(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g <= 0
input A[dk, dk, dv]
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = q·S + sum(q·A·v)·v
"""


def test_verify_notes_why_the_c_backend_skips_a_form(tmp_path, capsys):
    """A program whose recurrent form the C backend cannot build (a per-token value of three axes): verify
    checks the other rows, says why C's recurrent rows are skipped and exits 0; running it on C is one
    error with the same reason, not an internal error."""
    path = tmp_path / "rank3.lin"
    path.write_text(RANK3)
    assert main(["verify", str(path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "note: the c backend does not build the recurrent form: " in out and "0 failed" in out
    assert "input 'A' has shape [dk, dk, dv], and the C kernels take values up to matrices" in out
    assert main(["check", str(path)]) == 0
    assert "recurrent   available (backends: numpy)" in capsys.readouterr().out
    assert main(["run", str(path), "--backend", "c", "--form", "recurrent"]) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "input 'A' has shape [dk, dk, dv]" in err
    assert "internal error" not in err


def float32_skipped_float64_passed(rows):
    """Rows of a case whose float64 reference float32 cannot hold: float32's skipped with the reason (no errors
    measured), float64's compared and passed."""
    assert {r["dtype"] for r in rows} == {"float32", "float64"}
    for r in rows:
        if r["dtype"] == "float32":
            assert r["skipped"] and r["max_rel"] is None and "beyond float32's largest value" in r["note"]
        else:
            assert not r["skipped"] and r["passed"] and r["max_rel"] <= r["tolerance"]


def test_verify_skips_the_serving_rows_a_dtype_cannot_hold(tmp_path, capsys):
    """The serving rows (checkpoints, last K) skip a dtype the float64 reference outgrows, as the battery's rows
    do: with a^(−3) for a > 0 (a growth factor where a < 1) verify failed them with an error of inf in float32
    (a probe's finding), and passes now, saying why in a note."""
    path = tmp_path / "negpow.lin"
    path.write_text("recurrence negpow(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a > 0\nstate S[dk, dv]\n"
                    "S = a^(−3)·S + k⊗v\noutput o = q·S\n")
    assert main(["verify", str(path), "--quick", "--json", "--backend", "numpy", "--form", "recurrent"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"]
    float32_skipped_float64_passed([r for r in report["rows"] if r["case"] in ("checkpoints", "last K")])
    assert any(n.startswith("case 'checkpoints', float32: the float64 reference reaches") for n in report["notes"])


def test_verify_skips_the_rows_a_dtype_cannot_hold(tmp_path, capsys):
    """A growth factor (`input a > 1`): the battery's "strong decay" case scales it ×40, and over 100 tokens the
    float64 reference reaches 1e111. A float32 run must overflow there, so its rows are not compared: `skip`,
    with a note saying why, and verify passes (they were FAIL inf). The float64 rows of the case are compared
    as ever, and pass."""
    path = tmp_path / "grow.lin"
    path.write_text("recurrence grow(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv]\ninput a > 1\nstate S[dk, dv]\n"
                    "S = a·S + k⊗v\noutput o = q·S\n")
    assert main(["verify", str(path), "--quick", "--json", "--backend", "numpy"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"]
    float32_skipped_float64_passed([r for r in report["rows"] if r["case"] == "strong decay"])
    assert any("case 'strong decay', float32: the float64 reference reaches" in n for n in report["notes"])
    assert not any(r["skipped"] for r in report["rows"] if r["case"] in ("T=1", "ragged T"))
    assert main(["verify", str(path), "--quick", "--backend", "numpy", "--form", "recurrent"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"recurrent +numpy +float32 +strong decay .*— +— .*skip", out)
    assert re.search(r"\d+ passed, 0 failed, \d+ skipped \(not comparable: see the notes\)", out)


def test_mistakes_found_by_a_new_user_get_clear_errors(tmp_path, capsys):
    """Found by walking the docs as a user: compile() and load() of something that is no text or path; a
    misspelt option of run() taken for an input; an int32 array in --inputs under --form auto (the error named
    neither the array nor the file); --tokens that disagrees with --cu-seqlens (the error spoke of T_total)."""
    for call, args, said in ((linrec.compile, (123,), "compile() takes the program's text as a str, not int"),
                             (linrec.compile, (b"\xff",), "these bytes are not UTF-8"),
                             (linrec.load, (None,), "load() takes the path of a .lin file"),
                             # (it named the directory ".")
                             (linrec.load, ("",), "load() was given an empty path: give the path of a .lin file")):
        with pytest.raises(linrec.LinrecError, match=re.escape(said)):
            call(*args)
    gla = Path(__file__).resolve().parent.parent / "examples" / "gla.lin"
    rec = linrec.load(gla)
    x = rec.random_inputs(1, 8, 2)
    with pytest.raises(linrec.LinrecError, match=r"unknown input 'chunksize': did you mean the option chunk_size=\?"):
        rec.run(x, chunksize=4)
    with pytest.raises(linrec.LinrecError, match=r"unknown input array\(s\) 'qq'"):  # (no option is close)
        rec.run(x, qq=x["q"])
    ints = tmp_path / "int.npz"
    np.savez(ints, **{k: (v.astype(np.int32) if k == "q" else v) for k, v in x.items()})
    assert main(["run", str(gla), "--inputs", str(ints), "-q"]) == 1
    assert f"{ints}: error: input 'q' has dtype int32; pass float32 or float64" in capsys.readouterr().err
    assert main(["run", str(gla), "--cu-seqlens", "0,5,37,64", "--tokens", "50", "-q"]) == 1
    assert "--tokens 50 disagrees with --cu-seqlens, which ends at 64" in capsys.readouterr().err
    assert main(["run", str(gla), "--cu-seqlens", "0,5,37,64", "--tokens", "64", "-q"]) == 0


def test_options_of_flash_linear_attention_get_advice_not_unknown_input():
    """flash-linear-attention's keywords that linrec spells otherwise or does not need — given to run() or
    prefill() they were "unknown input array(s)" — say what to do instead; a program's own input of such a name
    is still its input."""
    rec = linrec.load(Path(__file__).resolve().parent.parent / "examples" / "gla.lin")
    x = rec.random_inputs(1, 8, 2)
    for option, said in (("output_final_state", "always return the final states (result.final_state"),
                         ("scale", "the scale is part of the program: write it in the readout"),
                         ("head_first", "[B, T, H, *] (flash-linear-attention's head_first=False)"),
                         ("offsets", "packed sequences are cu_seqlens="),
                         ("use_qk_l2norm_in_kernel", "`qn = l2norm(q)`")):
        for call in (rec.run, rec.prefill):
            with pytest.raises(linrec.RuntimeInputError,
                               match=rf"^error: {call.__name__}\(\) has no option {option}=: .*{re.escape(said)}"):
                call(x, **{option: True})
    scaled = linrec.compile("recurrence scaled(dk = 2, dv = 2)\ninput q[dk], k[dk], v[dv], scale > 0\n"
                            "state S[dk, dv]\nS = S + k⊗v\noutput o = scale·q·S\n", "scaled.lin")
    y = scaled.random_inputs(1, 4, 1)
    got = scaled.run({k: v for k, v in y.items() if k != "scale"}, scale=y["scale"]).outputs["o"]
    np.testing.assert_array_equal(got, scaled.run(y).outputs["o"])


def test_verify_keeps_to_the_longest_sequence_a_program_takes(tmp_path, capsys):
    """A Linformer with projections over T = 40 positions: every case of the battery stays within 40
    tokens (was: the 200- and 2048-token cases stopped verify with an error)."""
    path = tmp_path / "short_linformer.lin"
    path.write_text("recurrence short_linformer(dk = 4, dv = 3, kproj = 8, T = 40) noncausal\n"
                    "input q[dk], k[dk], v[dv]\nparam E[kproj, T] = randn(seed=0, std=0.15)\n"
                    "output o = softmax((E·seq(k))·q)·(E·seq(v))\n")
    assert main(["verify", str(path), "--json", "--backend", "numpy"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and {r["case"] for r in report["rows"]} >= {"long T", "several B, H"}


def test_verify_draws_the_params_a_file_leaves_to_the_caller(tmp_path, capsys):
    path = tmp_path / "nodefault.lin"
    path.write_text("recurrence nodefault(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv]\nparam w[dk] per head\n"
                    "param lam per head\nstate S[dk, dv]\nS = exp(−softplus(lam))·S + (w*k)⊗v\noutput o = q·S\n")
    assert main(["verify", str(path), "--quick", "--json", "--backend", "numpy"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and len(report["rows"]) > 10


def test_verify_runs_the_decode_step_of_causal_programs(capsys):
    """Rows `step`: the tokens one at a time through Recurrence.step on each backend, against the same
    float64 reference (Performer: its states carried scaled, handed back at their true scale)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "performer.lin"
    assert main(["verify", str(path), "--quick", "--json", "--form", "step"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["form"], r["backend"]) for r in rows} == {("step", "numpy"), ("step", "c")}
    assert all(r["passed"] for r in rows) and max(r["max_rel"] for r in rows if r["dtype"] == "float64") < 1e-12
    linformer = Path(__file__).resolve().parent.parent / "examples" / "linformer.lin"
    assert main(["verify", str(linformer), "--form", "step"]) == 1
    assert "has no step form: no decode step" in capsys.readouterr().err


HGRN_LIKE = """# an elementwise forget gate on a vector state, read elementwise through an output gate (HGRN-like)
recurrence gated_rnn(d = 8)
input x[d], f[d], g[d]
state s[d]
s = diag(sigmoid(f))·s + (1 − sigmoid(f))*x
output o = s*sigmoid(g)
"""


def test_a_vector_state_read_elementwise_gets_its_forms(tmp_path, capsys):
    """check lists every form on both backends (C's scans read the state in c_values' kernels), verify
    passes every row (float64 within 1e-12), and run --backend c --form parallel writes its outputs."""
    path = tmp_path / "gated_rnn.lin"
    path.write_text(HGRN_LIKE)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    for form in ("recurrent", "parallel", "chunkwise"):
        assert f"{form:<11} available (backends: numpy, c)" in out
    assert main(["verify", str(path), "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert {(r["form"], r["backend"]) for r in rows} == {
        (f, b) for f in ("recurrent", "parallel", "chunkwise", "step") for b in ("numpy", "c")}
    assert all(r["passed"] for r in rows) and max(r["max_rel"] for r in rows if r["dtype"] == "float64") < 1e-12
    assert main(["run", str(path), "--backend", "c", "--form", "parallel", "--out", str(tmp_path / "o.npz")]) == 0
    assert np.load(tmp_path / "o.npz")["o"].shape[-1] == 8


def test_standalone_grad_says_where_the_backward_is(capsys):
    """--standalone writes C forward kernels; the backward is a Python module (on C, calling linrec's C
    backward kernels) — not "NumPy's", as it said before the C backward."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    assert main(["emit", gla, "--standalone", "--grad"]) == 1
    assert capsys.readouterr().err == (
        f"linrec: error: --standalone writes the forward kernels only: leave out --grad (the backward is a Python "
        f"module, which `linrec emit {gla} --grad` prints; with --backend c, where C builds it, one that calls "
        f"linrec's C backward kernels: docs/gradients.md)\n")


class _FullDisk(io.StringIO):
    """stdout on a full disk: every write fails as /dev/full's."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_an_output_that_cannot_be_written_is_not_a_bug(monkeypatch, capsys):
    """A full disk under stdout (`linrec check FILE > /dev/full`) is the machine's condition: exit 1 with the
    reason, not an internal error (exit 2); and nothing more as Python exits (its flush of stdout's rest)."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert main(["check", gla]) == 1
    assert capsys.readouterr().err == "linrec: cannot write the output: No space left on device\n"
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "linrec", "check", gla], stdout=full, stderr=subprocess.PIPE,
                                  text=True, timeout=120)
        assert (done.returncode, done.stderr) == (1, "linrec: cannot write the output: No space left on device\n")
    def unreadable(*args, **kwargs):  # (another OSError, of a file named: still the last line of defence's)
        raise PermissionError(errno.EACCES, "Permission denied", "/root/kernel.so")
    monkeypatch.setattr(linrec.Recurrence, "run", unreadable)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert main(["run", gla, "--tokens", "4"]) == 2
    assert "linrec: internal error: PermissionError" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["cache", "--help"]])
def test_help_and_version_that_cannot_be_written_exit_1(argv, monkeypatch, capsys):
    """A probe's finding: `linrec --help > /dev/full` (or >&-) exited 0 having said nothing — argparse drops a
    failed write of its help and version text."""
    for stdout, reason in ((_FullDisk(), "No space left on device"), (None, "standard output is closed")):
        monkeypatch.setattr(sys, "stdout", stdout)
        assert main(argv) == 1
        assert capsys.readouterr().err == f"linrec: cannot write the output: {reason}\n"


def test_run_refuses_output_files_it_could_not_write_before_any_work(tmp_path, capsys):
    """Probe findings: --save-inputs and --out naming one file wrote the results over the inputs (exit 0); an
    --out in a folder that does not exist failed after the whole run, the --save-inputs file written."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    same = tmp_path / "same.npz"
    for saved in (str(same), str(tmp_path / "same")):
        assert main(["run", gla, "--save-inputs", saved, "--out", str(same)]) == 1
        assert f"name the same file, {same}: give them different names" in capsys.readouterr().err
    saved = tmp_path / "saved.npz"
    assert main(["run", gla, "--save-inputs", str(saved), "--out", str(tmp_path / "nodir" / "o.npz")]) == 1
    assert f"cannot write --out {tmp_path / 'nodir' / 'o.npz'}: the folder {tmp_path / 'nodir'} does not exist" in \
        capsys.readouterr().err
    assert not same.exists() and not saved.exists()
    for bad in ("0", "3.5", "abc"):  # (checked by the library after the form's choice and its note were printed)
        assert main(["run", gla, "--chunk-size", bad]) == 1
        assert capsys.readouterr().err == f"linrec: error: --chunk-size {bad}: the chunk size must be a positive " \
                                          f"integer (tokens per chunk of the chunkwise form, e.g. 64); leave it out " \
                                          f"for the form's default\n"


def test_a_small_pool_takes_the_default_request_counts_that_fit():
    """`bench --shapes serving --pool 32` was refused for N = 64, a default, as if --requests had said it."""
    from types import SimpleNamespace

    from linrec.bench_serving import _requests
    assert _requests(SimpleNamespace(pool=32, requests=None)) == [1, 16]
    assert _requests(SimpleNamespace(pool=None, requests=None)) == [1, 16, 64]
    assert _requests(SimpleNamespace(pool=1, requests=None)) == [1]
    with pytest.raises(linrec.LinrecError, match="--requests 9 is more than the pool's 8 slots"):
        _requests(SimpleNamespace(pool=8, requests=[1, 9]))


def test_a_closed_stdout_is_an_output_that_cannot_be_written(monkeypatch, tmp_path, capsys):
    """Started with stdout closed (`linrec emit FILE >&-`: sys.stdout is None): 'cannot write the output', exit 1,
    not an internal AttributeError; a command that prints nothing (run --quiet --out) still succeeds."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    for argv in (["emit", gla], ["check", gla], ["cache", "info"]):
        monkeypatch.setattr(sys, "stdout", None)
        assert main(argv) == 1
        assert capsys.readouterr().err == "linrec: cannot write the output: standard output is closed\n"
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["run", gla, "--tokens", "2", "--quiet", "--out", str(tmp_path / "o.npz")]) == 0
    assert (tmp_path / "o.npz").exists()
    done = subprocess.run(["sh", "-c", '"$0" -m linrec emit "$1" >&-', sys.executable, gla],
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (1, "linrec: cannot write the output: standard output is closed\n")


def test_out_of_memory_is_an_error_about_sizes(monkeypatch, capsys):
    """Sizes too large for the machine (a mutated file had dk = 100000: the recurrent form's I − β·k⊗k
    wanted 74.5 GiB) are bad input: exit 1 with what to change, not an internal error (exit 2)."""
    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 74.5 GiB")
    monkeypatch.setattr(linrec.Recurrence, "run", too_big)
    assert main(["run", str(next(p for p in EXAMPLES if p.stem == "deltanet")), "--tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "out of memory (Unable to allocate 74.5 GiB)" in err and "--dim NAME=SIZE" in err
    assert "internal error" not in err


@pytest.mark.parametrize("size", [2**31, 10**10, 99999999999999999999])
def test_a_dim_above_the_size_limit_is_refused_by_every_command(size, tmp_path, capsys):
    """--dim dk=10000000000 wrote standalone C with `for (int i = 0; i < 10000000000; ++i)`, and one above int64
    was an internal error in run and bench; each names the option, exit 1, and writes nothing."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    out = tmp_path / "st"
    for command in (["emit", gla, "--backend", "c", "--standalone", "--out", str(out)], ["run", gla],
                    ["bench", gla, "--quick", "--T", "8"]):
        assert main([*command, "--dim", f"dk={size}"]) == 1, command
        err = capsys.readouterr().err
        assert f"--dim dk={size} is too large: sizes go up to 2147483647" in err and "make it smaller" in err, err
    assert not out.exists()
    assert linrec.dim_option.dims_with_overrides(linrec.load(gla).program, [("dv", 2**31 - 1)])["dv"] == 2**31 - 1


BEYOND_INT64 = "99999999999999999999"


@pytest.mark.parametrize("option", [["--tokens", BEYOND_INT64], ["--batch", BEYOND_INT64], ["--heads", BEYOND_INT64],
                                    ["--tokens", str(2**31)], ["--cu-seqlens", f"0,{BEYOND_INT64}"]])
def test_a_count_above_the_size_limit_is_an_error_not_a_bug(option, tmp_path, capsys):
    """Integers beyond int64 were an internal error (NumPy's 'Maximum allowed dimension exceeded', exit 2)."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    assert main(["run", gla, "-q", *option]) == 1
    err = capsys.readouterr().err
    assert f"{option[0]} {option[1].split(',')[-1]} is too large: sizes go up to 2147483647" in err, err
    assert "make it smaller" in err and "internal error" not in err
    retnet = str(next(p for p in EXAMPLES if p.stem == "retnet"))
    assert main(["emit", retnet, "--backend", "c", "--standalone", "--out", str(tmp_path / "d"), "--heads",
                 BEYOND_INT64]) == 1
    assert f"--heads {BEYOND_INT64} is too large" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    assert main(["bench", gla, "--quick", "--T", BEYOND_INT64]) == 1
    assert f"--T {BEYOND_INT64} is too large" in capsys.readouterr().err


def test_verify_seeds_has_an_upper_bound(capsys):
    """--seeds 99999999999999999999 ran on without end; it is refused up front, saying the bound."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    assert main(["verify", gla, "--seeds", BEYOND_INT64]) == 1
    assert f"--seeds {BEYOND_INT64}: at most 1000 seeds" in capsys.readouterr().err


def test_a_header_dimension_above_the_size_limit_is_an_error_at_its_place(tmp_path, capsys):
    path = tmp_path / "big.lin"
    source = next(p for p in EXAMPLES if p.stem == "gla").read_text().replace("dk = 16", "dk = 99999999999999999999")
    path.write_text(source)
    for command in (["check", str(path)], ["emit", str(path), "--backend", "c"]):
        assert main(command) == 1
        out = capsys.readouterr()
        assert f"{path}:2:16: error: dimension 'dk' = 99999999999999999999 is too large" in out.err, out.err
        assert out.out == ""


# ---- a Ctrl-C while the command imports ------------------------------------------------------------------------

# (run first in a fresh interpreter: the import of MODULE raises KeyboardInterrupt, as a Ctrl-C at that moment does)
INTERRUPT_ON_IMPORT = """
import importlib, runpy, sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
"""


def _console_script() -> tuple[str, str]:
    """The `linrec` script's module and function, from pyproject.toml's [project.scripts]."""
    scripts = PYPROJECT.read_text(encoding="utf-8").split("[project.scripts]", 1)[1]
    module, _, function = re.search(r'^linrec\s*=\s*"([^"]+)"', scripts, re.MULTILINE).group(1).partition(":")
    return module, function


@pytest.mark.parametrize("module", ["linrec.cli", "numpy", "lark", "jinja2"])
def test_a_ctrl_c_while_the_command_imports_is_an_interrupt_not_a_traceback(module, tmp_path):
    """The first ~0.7 s of the command import NumPy, lark, jinja2 and the compiler: a Ctrl-C then printed a
    KeyboardInterrupt traceback (the console script imported linrec.cli, and linrec's __init__ the API, before
    any of linrec's code ran). Its entry point, linrec.command, imports them inside its handling: as at every
    other moment, `linrec: interrupted` and status 130."""
    script, function = _console_script()
    code = INTERRUPT_ON_IMPORT.format(module=module) + (
        f"sys.exit(getattr(importlib.import_module({script!r}), {function!r})(['check', '--help']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in run.stderr
    assert (run.returncode, run.stderr) == (130, "linrec: interrupted\n")


def test_a_ctrl_c_while_python_dash_m_linrec_imports_is_an_interrupt_not_a_traceback(tmp_path):
    code = INTERRUPT_ON_IMPORT.format(module="numpy") + "runpy.run_module('linrec', run_name='__main__', alter_sys=True)"
    run = subprocess.run([sys.executable, "-c", code, "check", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert "Traceback" not in run.stderr
    assert (run.returncode, run.stderr) == (130, "linrec: interrupted\n")


def test_the_battery_has_a_size_1_axis_on_numpy():
    """verify's battery sets the first size to 1 (the others odd) for the NumPy forms: a value-side correction
    under a key-axis decay at dk = 1 once came out 1e-2 off in the NumPy parallel and chunkwise forms, and
    no case had a size of 1. C is not asked for it (a size of its own builds every kernel again)."""
    from linrec import verify
    rec = linrec.load(EXAMPLES[0])
    case = next(c for c in verify.battery(rec.program) if c.name == "size-1 axis")
    first = next(d.name for d in rec.program.dims)
    assert case.dims[first] == 1 and all(n > 1 for d, n in case.dims.items() if d != first)
    rows = verify.run(rec, backends=("numpy", "c"), forms=["chunkwise"], dtypes=("float64",), quick=True)
    assert {r.backend for r in rows if r.case == "size-1 axis"} == {"numpy"}
    assert all(r.passed for r in rows)


def test_an_unsplittable_linrec_cflags_is_named(monkeypatch, capsys):
    """Found by probing: an unbalanced quote in LINREC_CFLAGS was 'internal error: ValueError: No closing
    quotation' (exit 2); now an error naming the variable (exit 1)."""
    from linrec.c import build as c_build
    monkeypatch.setenv("LINREC_CFLAGS", '"-O2')
    with pytest.raises(linrec.LinrecError, match="LINREC_CFLAGS='\"-O2' cannot be split into compiler flags"):
        c_build.flags()


# ---- found by probing: options given twice, empty paths, a params file of gigabytes, a write cut short ----------

def test_a_single_valued_option_given_twice_is_an_error(capsys):
    """`run --tokens 8 --tokens 16` ran 16 tokens without a word (argparse keeps the last): every single-valued
    option of every command given again with another value is a usage error naming both; the same value again
    is harmless, and the repeatable options stay repeatable."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    for argv, said in ((["run", gla, "--tokens", "8", "--tokens", "16"],
                        "--tokens 8 and --tokens 16: give --tokens once"),
                       (["run", gla, "-o", "a.npz", "--out", "b.npz"], "-o a.npz and --out b.npz: give --out once"),
                       (["run", gla, "--cu-seqlens", "0,4", "--cu-seqlens", "0,5"],
                        "--cu-seqlens 0,4 and --cu-seqlens 0,5: give --cu-seqlens once"),
                       (["run", gla, "--form", "parallel", "--form", "chunkwise"],
                        "--form parallel and --form chunkwise: give --form once"),
                       (["run", gla, "--dim", "dk=2", "--dim", "dk=3"],
                        "--dim dk=2 and --dim dk=3: give each dimension once"),
                       (["emit", gla, "--backend", "c", "--backend", "numpy"],
                        "--backend c and --backend numpy: give --backend once"),
                       (["verify", gla, "--seed", "1", "--seed", "2"], "--seed 1 and --seed 2: give --seed once"),
                       (["verify", gla, "--against", gla, "--against", "x.lin"],
                        f"--against {gla} and --against x.lin: give --against once"),
                       (["bench", gla, "--budget", "1", "--budget", "2"],
                        "--budget 1 and --budget 2: give --budget once")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 1, argv
        assert err == f"linrec {argv[0]}: error: {said}\n(see 'linrec {argv[0]} --help')\n", err
    assert main(["run", gla, "-q", "--tokens", "4", "--tokens", "4", "--dim", "dk=2", "--dim", "dk=2"]) == 0
    assert main(["verify", gla, "--quick", "--json", "--backend", "numpy", "--backend", "numpy", "--form", "recurrent",
                 "--dtype", "float64", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]


def test_an_empty_path_is_named_as_empty(tmp_path, monkeypatch, capsys):
    """`check ""` said `.: error: cannot read the file: Is a directory`; `run --out ""` wrote nothing, and
    `verify --against ""` ran the other check, without a word: each is a usage error saying the path is empty."""
    monkeypatch.chdir(tmp_path)
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    for argv, option, what in ((["check", ""], "FILE", "a program file (.lin)"),
                               (["check", gla, ""], "FILE", "a program file (.lin)"),
                               (["run", ""], "FILE", "a program file (.lin)"),
                               (["run", gla, "-q", "--out", ""], "--out/-o", "the .npz file to write"),
                               (["run", gla, "-q", "--save-inputs", ""], "--save-inputs", "the .npz file to write"),
                               (["run", gla, "--inputs", ""], "--inputs", "the .npz file to read"),
                               (["verify", gla, "--against", ""], "--against", "a program file (.lin)"),
                               (["emit", gla, "--backend", "c", "--standalone", "--out", ""], "--out/-o",
                                "the directory to write to"),
                               (["bench", gla, "--quick", "--plot", ""], "--plot", "the image file to write")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 1, argv
        assert capsys.readouterr().err == (f"linrec {argv[0]}: error: argument {option}: the path is empty: give "
                                           f"{what}\n(see 'linrec {argv[0]} --help')\n")
    assert list(tmp_path.iterdir()) == []


def test_standalone_refuses_a_params_file_above_1_gib(tmp_path, monkeypatch, capsys):
    """mamba2 at --heads 100000000 wrote a 2.4 GB mamba2_params.bin without a word: refused before the defaults
    are computed, naming the size and the options that set it."""
    computed = []
    default_params = linrec.Recurrence.default_params

    def counted(self, heads, *args, **kwargs):
        computed.append(heads)
        assert heads <= 1000, "the defaults were computed at the refused size"
        return default_params(self, heads, *args, **kwargs)
    monkeypatch.setattr(linrec.Recurrence, "default_params", counted)
    mamba2, mamba1 = (str(next(p for p in EXAMPLES if p.stem == name)) for name in ("mamba2", "mamba1"))
    out = tmp_path / "k"
    for file, options, said in (
            (mamba2, ["--heads", "100000000"], "mamba2_params.bin would be 2.2 GiB (2400000000 bytes: the float64 "
             "defaults of A_log, A, D for 100000000 head(s)), above the 1 GiB that --standalone writes: make --heads "
             "smaller"),
            (mamba1, ["--dim", "dk=10000", "--dim", "dv=10000"], "mamba1_params.bin would be 3.0 GiB (3200160000 "
             "bytes: the float64 defaults of A_log, A, D for 2 head(s)), above the 1 GiB that --standalone writes: "
             "make --heads or --dim dk or --dim dv smaller")):
        assert main(["emit", file, "--backend", "c", "--standalone", "--out", str(out), *options]) == 1
        assert capsys.readouterr().err == f"linrec: error: {said}\n"
    assert computed == [] and not out.exists()
    assert main(["emit", mamba2, "--backend", "c", "--standalone", "--out", str(out), "--heads", "1000"]) == 0
    assert (out / "mamba2_params.bin").stat().st_size == 3 * 1000 * 8 and computed == [1000]


def _cut_short(monkeypatch):
    """np.savez on a disk that fills up halfway: half the archive reaches the file, then ENOSPC."""
    savez = np.savez

    def half_then_full(file, **arrays):
        whole = io.BytesIO()
        savez(whole, **arrays)
        half = whole.getvalue()[: len(whole.getvalue()) // 2]
        if isinstance(file, (str, Path)):
            with open(file, "wb") as f:
                f.write(half)
        else:
            file.write(half)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "savez", half_then_full)


def test_a_write_cut_short_leaves_no_partial_npz(tmp_path, monkeypatch, capsys):
    """A full disk during `run --out` (or --save-inputs) left a truncated .npz at the target: now the arrays go to
    a temporary file beside it, renamed over the target once complete; on a failure it is removed, an existing
    target is left as it was, and the error names the file and the reason."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    fresh, kept = tmp_path / "fresh.npz", tmp_path / "kept.npz"
    kept.write_bytes(b"the arrays of an earlier run")
    kept.chmod(0o600)
    with monkeypatch.context() as patch:
        _cut_short(patch)
        for option, target in (("--out", fresh), ("--out", kept), ("--save-inputs", fresh)):
            assert main(["run", gla, "--tokens", "4", "-q", option, str(target)]) == 1
            assert capsys.readouterr().err == f"linrec: error: cannot write {target}: No space left on device\n"
            assert sorted(tmp_path.iterdir()) == [kept], option
            assert kept.read_bytes() == b"the arrays of an earlier run"
    assert main(["run", gla, "--tokens", "4", "-q", "--out", str(kept), "--save-inputs", str(fresh)]) == 0
    assert sorted(tmp_path.iterdir()) == [fresh, kept]
    assert np.load(kept)["o"].shape == (2, 4, 2, 16) and kept.stat().st_mode & 0o777 == 0o600
    if Path("/dev/full").exists():  # (a target that is no regular file, here through a symlink: written directly)
        full = tmp_path / "full.npz"
        full.symlink_to("/dev/full")
        assert main(["run", gla, "--tokens", "4", "-q", "--out", str(full)]) == 1
        assert capsys.readouterr().err == f"linrec: error: cannot write {full}: No space left on device\n"
        assert sorted(tmp_path.iterdir()) == [fresh, full, kept] and full.is_symlink()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_write_cut_short_leaves_no_partial_standalone_file(tmp_path):
    """`emit --standalone` under a file-size limit (RLIMIT_FSIZE: the write fails with EFBIG, as on a full disk
    with ENOSPC) wrote mamba2.h and a truncated mamba2.c: now no file is replaced unless every one is complete,
    and no temporary file stays behind."""
    mamba2 = str(next(p for p in EXAMPLES if p.stem == "mamba2"))
    out = tmp_path / "k"
    out.mkdir()
    (out / "mamba2.h").write_text("old header")
    (out / "mamba2.c").write_text("old source")
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100000, 100000))\n"
            "from linrec.cli import main\nsys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "emit", mamba2, "--backend", "c", "--standalone", "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert sorted(p.name for p in out.iterdir()) == ["mamba2.c", "mamba2.h"]
    assert (out / "mamba2.h").read_text() == "old header" and (out / "mamba2.c").read_text() == "old source"
    assert (done.returncode, done.stdout, done.stderr) == (
        1, "", f"linrec: error: cannot write {out / 'mamba2.c'}: File too large\n")


def test_run_state_dtype_float32_generates_float32_inputs(tmp_path, capsys):
    """--state-dtype float32 (a listed choice) failed with generated inputs, which were float64 (a float32 state
    is kept in the inputs' dtype): generated inputs are float32 with either state dtype, as with bfloat16."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    out = tmp_path / "out.npz"
    assert main(["run", gla, "--state-dtype", "float32", "--form", "recurrent", "-q", "--out", str(out)]) == 0
    written = np.load(out)
    assert written["o"].dtype == np.float32 and written["S"].dtype == np.float32
    # an explicit --dtype float64 still meets the run's own error, which says what goes together
    assert main(["run", gla, "--state-dtype", "float32", "--dtype", "float64", "-q"]) == 1
    assert "state_dtype='float32' with float64 inputs" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/dev/stdout").exists(), reason="no /dev/stdout")
def test_out_to_standard_output(tmp_path):
    """`--out /dev/stdout` wrote a file /dev/stdout.npz (the .npz suffix added) and exit 0, and resolved through
    /proc/self/fd/1 it would have renamed a temporary file over the file stdout is redirected to. It writes the
    .npz to standard output — a redirected file, or a pipe — the same arrays as `--out FILE`; with the run's
    summary also going there, it says to add --quiet."""
    gla = str(next(p for p in EXAMPLES if p.stem == "gla"))
    base = [sys.executable, "-m", "linrec", "run", gla, "--tokens", "4", "--backend", "numpy", "--form", "recurrent"]
    subprocess.run(base + ["--quiet", "--out", str(tmp_path / "file.npz")], check=True, timeout=120)
    want = np.load(tmp_path / "file.npz")
    existed = Path("/dev/stdout.npz").exists()
    with open(tmp_path / "redirected.npz", "wb") as out:
        subprocess.run(base + ["--quiet", "--out", "/dev/stdout"], stdout=out, check=True, timeout=120)
    piped = subprocess.run(base + ["--quiet", "--out", "/dev/stdout"], capture_output=True, check=True, timeout=120)
    assert Path("/dev/stdout.npz").exists() == existed
    for got in (np.load(tmp_path / "redirected.npz"), np.load(io.BytesIO(piped.stdout))):
        assert sorted(got.keys()) == sorted(want.keys())
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    mixed = subprocess.run(base + ["--out", "/dev/stdout"], capture_output=True, timeout=120)
    assert mixed.returncode == 1 and mixed.stdout == b""
    assert b"--out /dev/stdout writes the .npz to standard output, where the run's summary goes too: add --quiet" \
        in mixed.stderr
    # a `>>` redirection appends (opening /dev/stdout anew truncated the file), standard error is refused (the
    # notes go there), and a pipe into --inputs /dev/stdin is read once for both the reads of the command
    (tmp_path / "log").write_bytes(b"before\n")
    with open(tmp_path / "log", "ab") as out:
        subprocess.run(base + ["--quiet", "--out", "/dev/stdout"], stdout=out, check=True, timeout=120)
    assert (tmp_path / "log").read_bytes()[:9] == b"before\nPK"
    to_stderr = subprocess.run(base + ["--quiet", "--out", "/dev/stderr"], capture_output=True, timeout=120)
    assert to_stderr.returncode == 1 and b"where linrec's notes and warnings go too" in to_stderr.stderr
    generated = subprocess.run(base[:5] + ["--tokens", "4", "--quiet", "--save-inputs", "/dev/stdout"],
                               capture_output=True, check=True, timeout=120).stdout
    rerun = subprocess.run([sys.executable, "-m", "linrec", "run", gla, "--inputs", "/dev/stdin", "--quiet",
                            "--out", str(tmp_path / "rerun.npz")], input=generated, capture_output=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    for name in want:
        np.testing.assert_allclose(np.load(tmp_path / "rerun.npz")[name], want[name], rtol=1e-12)
