"""`linrec bench` (a quick smoke run: valid JSON with the documented keys), `linrec cache info|clear` on a
temporary cache, and `linrec run --form step` (one decode step per token) against the recurrent form."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.cli import main
from linrec.decode import run_by_steps
from linrec.dsl.errors import LinrecError
from linrec.interface import Refusal

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


# ---- bench ---------------------------------------------------------------------------------------------
def test_bench_quick_json_has_the_documented_keys(cache_dir, capsys):
    before = os.environ.get("LINREC_NUM_THREADS")
    code = main(["bench", str(EXAMPLES / "gla.lin"), "--quick", "--json", "--T", "64", "--repeats", "1",
                 "--threads", "1"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert os.environ.get("LINREC_NUM_THREADS") == before  # the thread setting does not leak
    for key in ("sgemm_gflops", "blas", "threads", "rows", "decode_us", "state_bytes", "kv_cache_bytes", "auto",
                "build_s", "cached_load_ms", "flops_per_token_head", "sgemm_pinned_gflops", "fma_peak_gflops",
                "bandwidth_gbs", "machine_limits"):
        assert key in report, key
    assert report["threads"] == 1 and report["sgemm_gflops"] > 0
    # the bounds: the multiply-add peak and the triad's bandwidth, measured with the run's thread count
    assert report["fma_peak_gflops"] > 0 and report["bandwidth_gbs"] > 0
    assert report["machine_limits"]["fma_peak"]["threads"] == report["machine_limits"]["triad"]["threads"] == 1
    # measured at the start and at the end of the run: each bound the higher of the two
    start, end = report["machine_limits"], report["machine_limits_end"]
    assert report["fma_peak_gflops"] == max(start["fma_peak"]["gflops"], end["fma_peak"]["gflops"])
    assert report["bandwidth_gbs"] == max(start["triad"]["gbs"], end["triad"]["gbs"])
    assert report["machine_limits"]["triad"]["array_bytes"] >= 64 << 20
    assert report["openmp_wait_policy"].startswith(("passive", "as the environment", "the OpenMP runtime's"))
    assert report["dims"] == {"dk": 64, "dv": 64} and report["tokens"] == [64]
    assert report["flops_per_token_head"] == 4 * 64 * 64  # rank-one update + readout (the decay is lazy)
    rows = report["rows"]
    assert {(r["form"], r["backend"]) for r in rows} >= {("recurrent", "numpy"), ("chunkwise", "numpy"),
                                                         ("recurrent", "c")}
    for r in rows:
        assert r["T"] == 64
        for key in ("ms", "tokens_per_s", "gflops", "fraction_of_sgemm", "bound_ms", "fraction_of_bound"):
            assert r[key] > 0, (r, key)
        # the bound is the useful flops at the peak; the fraction, bound time over measured time
        useful = 1 * 64 * 8 * report["flops_per_token_head"]
        assert r["bound_ms"] == pytest.approx(useful / (report["fma_peak_gflops"] * 1e6), rel=1e-12)
        assert r["fraction_of_bound"] == pytest.approx(r["bound_ms"] / r["ms"], rel=1e-12)
    assert set(report["decode_us"]) == {"numpy", "c"} and all(v > 0 for v in report["decode_us"].values())
    for d in report["decode"].values():  # a step reads and writes every state byte once
        assert d["state_bytes_moved"] == 2 * 8 * 64 * 64 * 4
        assert d["bound_us"] == pytest.approx(d["state_bytes_moved"] / (report["bandwidth_gbs"] * 1e3), rel=1e-12)
        assert d["fraction_of_bound"] == pytest.approx(d["bound_us"] / d["us"], rel=1e-12)
    assert report["state_bytes"] == 8 * 64 * 64 * 4
    assert report["kv_cache_bytes"] == {"64": 2 * 64 * 8 * 64 * 4}
    assert {a["backend"] for a in report["auto"]} == {"numpy", "c"}
    assert report["build_s"]["c"] > 0 and report["cached_load_ms"]["c"] > 0
    # what the C backend does not implement yet is listed, not silently dropped
    implemented = {r["form"] for r in rows if r["backend"] == "c"}
    missing = {"parallel", "chunkwise"} - implemented
    assert missing <= {s["form"] for s in report["skipped"] if s["backend"] == "c"}


def test_bench_grad_rows(capsys):
    """--grad at a tiny size: a backward row per gradient form on NumPy, each with its forward, the fastest
    forward at the size and their ratio; the C chunkwise backward timed like the others; a form
    above its T limit skipped for forward and backward alike. (No speed is asserted.)"""
    code = main(["bench", str(EXAMPLES / "gla.lin"), "--grad", "--json", "--dim", "dk=8", "--dim", "dv=8",
                 "--T", "32", "--T", "4097", "--form", "recurrent", "--form", "chunkwise", "--repeats", "1",
                 "--threads", "1"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["grad"] and report["sizes"] == [{"dk": 8, "dv": 8}] and report["tokens"] == [32, 4097]
    forward = {(r["form"], r["backend"], r["T"]): r["ms"] for r in report["forward"]}
    assert set(forward) == {("recurrent", "numpy", 32), ("chunkwise", "numpy", 32), ("recurrent", "c", 32),
                            ("chunkwise", "numpy", 4097), ("recurrent", "c", 4097)} | (
        {("chunkwise", "c", 32), ("chunkwise", "c", 4097)} & set(forward))
    rows = {(r["form"], r["backend"], r["T"]): r for r in report["rows"]}
    assert set(rows) == {("recurrent", "numpy", 32), ("chunkwise", "numpy", 32), ("chunkwise", "numpy", 4097),
                         ("recurrent", "c", 32), ("recurrent", "c", 4097), ("chunkwise", "c", 32),
                         ("chunkwise", "c", 4097)}
    for (form, backend, t), r in rows.items():
        fastest = min(ms for (_, _, at), ms in forward.items() if at == t)
        assert r["ms"] > 0 and r["repeats"] == 1 and (r["dk"], r["dv"]) == (8, 8)
        assert r["forward_ms"] == forward[(form, backend, t)]
        assert r["fastest_forward_ms"] == fastest and r["ratio"] == pytest.approx(r["ms"] / fastest, rel=1e-12)
    reasons = {(s["pass"], s["form"], s["backend"], s["T"]): s["reason"] for s in report["skipped"]}
    assert ("backward", "chunkwise", "c", None) not in reasons  # (the C chunkwise backward: c.grad_chunk)
    assert "not run above T = 4096" in reasons[("backward", "recurrent", "numpy", 4097)]
    assert "not run above T = 4096" in reasons[("forward", "recurrent", "numpy", 4097)]


def test_bench_grad_refuses_shapes(capsys):
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--grad", "--shapes", "model"]) != 0
    assert "--grad has its own sizes" in capsys.readouterr().err


DELTA_VECTOR_READ = """recurrence delta_read(d = 8)
input k[d], v, beta in (0, 1)
kn = l2norm(k)
state z[d]
z = (I − beta·kn⊗kn)·z + beta·kn*v
output y = z
"""


def test_bench_says_once_which_forms_a_backend_does_not_build(cache_dir, tmp_path, capsys):
    """A vector delta rule read as it is: C builds the recurrent kernel only; its parallel and chunkwise
    forms are listed once with the reason (not as a failure at every T), and reading a state as it is costs
    no flop (the correction's product wᵀz and its update 2·d each, the write z += w 1·d)."""
    path = tmp_path / "delta_read.lin"
    path.write_text(DELTA_VECTOR_READ)
    code = main(["bench", str(path), "--quick", "--json", "--T", "32", "--T", "64", "--repeats", "1",
                 "--backend", "c"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert {(r["form"], r["T"]) for r in report["rows"]} == {("recurrent", 32), ("recurrent", 64)}
    skipped = [(s["form"], s["T"]) for s in report["skipped"] if s["backend"] == "c"]
    assert sorted(skipped) == [("chunkwise", None), ("parallel", None)]
    assert all("vector state 'z'" in s["reason"] and "correction" in s["reason"] for s in report["skipped"])
    assert report["flops_per_token_head"] == 5 * 8


def test_bench_text_report_and_selection(cache_dir, capsys):
    code = main(["bench", str(EXAMPLES / "gated_deltanet.lin"), "--T", "32", "--T", "8192", "--repeats", "1",
                 "--budget", "0.5", "--backend", "numpy", "--form", "parallel", "--form", "auto", "--quick"])
    assert code == 0
    text = capsys.readouterr().out
    assert "GFLOP/s" in text and "6·dk·dv" in text  # wᵀS + one rank-one update (correction and write) + readout
    assert "not run above T = 4096" in text          # NumPy parallel skipped at T = 8192, and said so
    assert "form auto" in text and "chunkwise" in text


def test_bench_rejects_unknown_dimension(capsys):
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--dim", "dz=4", "--T", "8"]) == 1
    assert "no dimension 'dz'" in capsys.readouterr().err
    for command in (["bench"], ["run"], ["emit", "--backend", "c", "--standalone", "--out", "unused"]):
        with pytest.raises(SystemExit) as exited:  # (a usage error: argparse's exit, status 1)
            main([*command, str(EXAMPLES / "gla.lin"), "--dim", "dk=4", "--dim", "dk=8"])
        assert exited.value.code == 1
        assert "--dim dk=4 and --dim dk=8: give each dimension once" in capsys.readouterr().err


# ---- bench: memory, plot, labels, auto, warnings (the same-run references stubbed: the run stays small) ----
ODD_DIMS = """recurrence odd(d = 8, e = 8)
input q[d], k[d], v[e]
state S[d, e]
S = 0.9·S + k⊗v
output o = q·S
"""

RENAMED_ATTENTION = """recurrence renamed(a = 5, b = 3)
input x[a], y[a], z[b]
output o = softmax(seq(y)·x)·seq(z)
"""

NO_KEY_VALUE = """recurrence running_sum(n = 4)
input x[n]
state z[n]
z = z + x
output y = z
"""


@pytest.fixture
def no_references(monkeypatch):
    """bench.run without its same-run matmul and machine limits (seconds of work each): reported as not
    measured, the way a failed measurement is."""
    from linrec import bench
    monkeypatch.setattr(bench, "matmul_reference", lambda threads, quick, say: {
        "sgemm_gflops": None, "sgemm": {"error": "not measured in tests"}, "sgemm_pinned_gflops": None,
        "sgemm_pinned": {}, "pinned_env": {}, "blas": None, "blas_summary": "-"})
    monkeypatch.setattr(bench, "machine_reference", lambda threads, quick, say, earlier=None: {} if earlier else {
        "fma_peak_gflops": None, "bandwidth_gbs": None, "machine_limits": {"error": "not measured in tests"}})
    return bench


def _tiny_bench(path, *extra) -> list[str]:
    return ["bench", str(path), "--backend", "numpy", "--T", "16", "--repeats", "1", "--threads", "1", *extra]


def test_bench_kv_cache_from_the_programs_own_key_and_value_sizes(tmp_path):
    """The softmax KV cache held against the state has the program's key and value sizes, whatever the
    dimensions are called: inputs k and v, else the matrix state's [key, value]; a program that reads the
    sequence keeps what it reads through seq and lsh_attention, whatever those inputs are called; unknown:
    said so."""
    from linrec import bench
    (tmp_path / "odd.lin").write_text(ODD_DIMS)
    odd = linrec.load(tmp_path / "odd.lin")
    assert bench.key_value_sizes(odd, {"d": 8, "e": 8}) == (8, 8)
    assert bench.kv_cache_bytes(64, (8, 8)) == 64 * 8 * (8 + 8) * 4  # 32 KiB, not 64 + 64's 256 KiB
    mamba2, reformer = linrec.load(EXAMPLES / "mamba2.lin"), linrec.load(EXAMPLES / "reformer.lin")
    assert bench.key_value_sizes(mamba2, {"dk": 4, "dv": 6}) == (4, 6)    # x[dv], B[dk]: S[dk, dv]
    assert bench.key_value_sizes(reformer, {"dk": 4, "dv": 6}) == (4, 6)  # the query is the key
    (tmp_path / "renamed.lin").write_text(RENAMED_ATTENTION)  # what seq(…) keeps, not inputs called k and v
    assert bench.key_value_sizes(linrec.load(tmp_path / "renamed.lin"), {"a": 5, "b": 3}) == (5, 3)
    (tmp_path / "sum.lin").write_text(NO_KEY_VALUE)
    assert bench.key_value_sizes(linrec.load(tmp_path / "sum.lin"), {"n": 4}) is None
    line = bench._memory_line({"program": "running_sum", "state_bytes": 128, "state_dtype": "float32",
                               "kv_sizes": None, "kv_cache_bytes": {}, "reads_the_sequence": False})
    assert line == ("memory per layer (B=1): state 128 B (128 B, float32); no softmax KV cache to compare: the "
                    "key and value sizes are unknown (no inputs k and v, no matrix state)")


def test_bench_memory_line_names_both_dtypes(no_references, tmp_path, capsys):
    """--state-dtype bfloat16: the state's bytes and dtype, and the float32 KV cache, each labelled."""
    (tmp_path / "odd.lin").write_text(ODD_DIMS)
    assert main(_tiny_bench(tmp_path / "odd.lin", "--form", "recurrent", "--state-dtype", "bfloat16")) == 0
    memory = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per layer")]
    assert memory == ["memory per layer (B=1): state 1.0 KiB (1024 B, bfloat16) vs softmax KV cache "
                      "T·H·(8 + 8)·4 (float32): T=16 8.0 KiB"]  # 8 heads · 8·8 · 2 B; 16 · 8 · 16 · 4 B


def test_bench_a_program_that_reads_the_sequence_keeps_its_kv_cache(no_references, capsys):
    """Reformer has no recurrent state: its memory is its own KV cache (query–key and value), and the C
    kernel's build and load are timed with a form it has (no recurrent one), not called a failure."""
    from linrec import bench
    assert main(_tiny_bench(EXAMPLES / "reformer.lin", "--form", "parallel", "--dim", "dk=4", "--dim", "dv=6",
                            "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reads_the_sequence"] and report["kv_sizes"] == [4, 6]
    assert report["kv_cache_bytes"] == {"16": 16 * 8 * (4 + 6) * 4}
    assert bench._memory_line(report) == (
        "memory per layer (B=1): no recurrent state — 'reformer' reads the sequence, so it keeps the keys and "
        "values of every token, a KV cache T·H·(4 + 6)·4 (float32): T=16 5.0 KiB")
    reformer, gla = linrec.load(EXAMPLES / "reformer.lin"), linrec.load(EXAMPLES / "gla.lin")
    assert bench.load_form(reformer, "c") == "parallel" and bench.load_form(gla, "c") == "recurrent"
    lines = bench._kernel_lines({"build_s": {"c": 1.0}, "cached_load_ms": {"c": 30.0},
                                 "loads": {"c": {"cache_dir": "CACHE", "form": "parallel"}}})
    assert "first call of the parallel form" in lines[0]


def test_bench_checks_the_plot_destination_before_measuring(no_references, tmp_path, capsys, monkeypatch):
    from linrec import bench
    monkeypatch.setattr(bench, "time_rows", lambda *a: pytest.fail("measured before checking --plot"))
    missing = tmp_path / "missing" / "x.png"
    assert main(_tiny_bench(EXAMPLES / "gla.lin", "--plot", str(missing))) == 1
    assert capsys.readouterr().err.strip().endswith(f"error: --plot {missing}: the folder {missing.parent} does "
                                                    f"not exist")
    assert main(_tiny_bench(EXAMPLES / "gla.lin", "--plot", str(tmp_path))) == 1
    assert f"--plot {tmp_path} is a folder" in capsys.readouterr().err


def test_bench_checks_the_plot_format_before_measuring(no_references, tmp_path, capsys, monkeypatch):
    """--plot x.txt: matplotlib cannot write it; said before measuring (exit 1) with the formats it writes, not
    as an internal error after the run. Without matplotlib: said so up front, matplotlib not imported."""
    import importlib.util
    from linrec import bench
    monkeypatch.setattr(bench, "time_rows", lambda *a: pytest.fail("measured before checking --plot"))
    real_formats = bench.plot_formats
    monkeypatch.setattr(bench, "plot_formats", lambda: PLOT_FORMATS)  # (CI installs no matplotlib)
    out = tmp_path / "x.txt"
    assert main(_tiny_bench(EXAMPLES / "gla.lin", "--plot", str(out))) == 1
    err = capsys.readouterr().err
    assert f"error: --plot {out}: matplotlib cannot write '.txt' files; use one of .pdf, .png, .svg" in err
    assert "internal error" not in err
    monkeypatch.setattr(bench, "plot_formats", real_formats)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)  # (an import of it would raise)
    assert main(_tiny_bench(EXAMPLES / "gla.lin", "--plot", str(tmp_path / "x.png"))) == 1
    assert f"--plot {tmp_path / 'x.png'}: matplotlib is not installed" in capsys.readouterr().err


# what matplotlib's FigureCanvasBase.get_supported_filetypes gives, in part (the tests run without matplotlib too)
PLOT_FORMATS = {"pdf": "Portable Document Format", "png": "Portable Network Graphics",
                "svg": "Scalable Vector Graphics"}


def test_bench_a_plot_that_fails_at_the_end_keeps_the_report(no_references, tmp_path, capsys, monkeypatch):
    from linrec import bench

    def full_disk(rep, path):
        raise LinrecError(f"cannot write the plot {path}: No space left on device")
    monkeypatch.setattr(bench, "plot", full_disk)
    monkeypatch.setattr(bench, "plot_formats", lambda: PLOT_FORMATS)  # (CI installs no matplotlib)
    out = tmp_path / "x.png"
    assert main(_tiny_bench(EXAMPLES / "gla.lin", "--form", "recurrent", "--dim", "dk=4", "--dim", "dv=4",
                            "--plot", str(out), "--json")) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the measurements, printed anyway
    assert [(r["form"], r["backend"], r["T"]) for r in report["rows"]] == [("recurrent", "numpy", 16)]
    assert captured.err.strip().endswith(f"linrec: error: cannot write the plot {out}: No space left on device")


def test_bench_grad_form_auto_times_the_backward_auto_runs(capsys, monkeypatch):
    """--grad --form auto: the forward Recurrence.choose_form picks and the backward linrec.torch's form="auto"
    runs (gradient_choice.auto_gradient_form), marked auto; the busy note names no matmul (--grad times none).
    NumPy's forward choice is measured (form_choice), so it is fixed here: a CI run under load once measured the
    chunkwise form faster at this size."""
    from linrec import bench, bench_grad, form_choice, gradient_choice
    monkeypatch.setattr(bench, "others_cores", lambda start, end: 1.5)
    monkeypatch.setattr(form_choice, "choose", lambda *args: ("recurrent", "fixed by the test"))
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--grad", "--form", "auto", "--json", "--dim", "dk=8",
                 "--dim", "dv=8", "--T", "32", "--backend", "numpy", "--repeats", "1", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["form"], r["backend"], r["auto"]) for r in report["rows"]] == [("recurrent", "numpy", True)]
    assert [(r["form"], r["auto"]) for r in report["forward"]] == [("recurrent", True)]
    assert report["notes"][-1].endswith("so these times are pessimistic and noisy")
    assert not any("matmul" in n for n in report["notes"])
    # on C from 1024 tokens on, the backward measured faster at bench's heads (the measurement fixed here)
    gla, big = linrec.load(EXAMPLES / "gla.lin"), {"dk": 128, "dv": 128}
    for costs in ({"recurrent": 2.0, "chunkwise": 1.0}, {"recurrent": 1.0, "chunkwise": 2.0}):
        monkeypatch.setattr(gradient_choice, "backward_costs", lambda *args, costs=costs: costs)
        assert bench_grad.auto_forms(gla, "c", big, 4096)[1] == min(costs, key=costs.get)


class _BuildsNothing:
    """A backend that builds no form of the program and no backward (as C builds none of some programs')."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, attribute):
        return getattr(self.inner, attribute)

    def why_not(self, compiled, form):
        return Refusal("nothing built here", "the NumPy backend runs it")

    def gradient_why_not(self, compiled, form):
        return Refusal("nothing built here")


@pytest.mark.parametrize("extra", [[], ["--form", "auto"], ["--grad"], ["--grad", "--form", "auto"]],
                         ids=["forms", "auto", "grad", "grad-auto"])
def test_bench_lists_a_backend_that_builds_no_form_as_not_measured(extra, no_references, monkeypatch, capsys):
    """A backend that builds no form of the program is listed under "not measured" with the reason, and the
    other backends run (exit 0), with --form auto as with the forms named: `auto` asked Recurrence.choose_form
    of every backend, whose error ended the run (exit 1) — without --form auto too, but for --grad."""
    from linrec import form_choice, registry
    monkeypatch.setitem(registry.BACKENDS, "c", _BuildsNothing(registry.BACKENDS["c"]))
    monkeypatch.setattr(form_choice, "per_token_cost", lambda *args: {"recurrent": 1.0, "chunkwise": 2.0})
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--json", "--quick", "--dim", "dk=8", "--dim", "dv=8",
                 "--T", "32", "--repeats", "1", "--threads", "1", *extra]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] and {r["backend"] for r in report["rows"]} == {"numpy"}
    on_c = [s for s in report["skipped"] if s["backend"] == "c"]
    assert on_c and all("nothing built here" in s["reason"] for s in on_c)
    if "auto" in extra:
        [auto] = [s for s in on_c if s["form"] == "auto" and s.get("pass", "forward") == "forward"]
        assert auto["T"] is None and auto["reason"].startswith("the c backend builds no form of 'gla': nothing built")
    if "--grad" in extra:
        assert any(r["auto"] for r in report["rows"]) == ("auto" in extra)  # (NumPy's backward auto runs)
    else:  # (what auto picks, on NumPy alone)
        assert [(a["backend"], a["T"]) for a in report["auto"]] == [("numpy", 32)]


def test_bench_warns_about_unused_names(tmp_path, capsys):
    """Like run, verify and emit: the warning with its place, before anything else (here an error)."""
    path = tmp_path / "unused.lin"
    path.write_text("recurrence unused(dk = 16, dv = 16)\ninput q[dk], k[dk], v[dv], extra\nstate S[dk, dv]\n"
                    "S = S + k⊗v\noutput o = q·S\n")
    assert main(["bench", str(path), "--dim", "foo=1"]) == 1
    err = capsys.readouterr().err
    assert "unused.lin:2:28: warning: input 'extra' is declared but never used" in err
    assert "no dimension 'foo'" in err


@pytest.mark.parametrize("mode", [["--grad"], ["--shapes", "serving"], ["--shapes", "model"]])
def test_bench_state_dtype_only_for_the_t_sweep(mode, capsys, monkeypatch):
    from linrec import bench_grad, bench_serving, bench_shapes
    for module in (bench_grad, bench_serving, bench_shapes):  # refused before any measurement
        monkeypatch.setattr(module, "run", lambda opts, progress=None: pytest.fail("ran with --state-dtype"))
    assert main(["bench", str(EXAMPLES / "gla.lin"), *mode, "--state-dtype", "bfloat16"]) == 1
    assert (f"error: --state-dtype bfloat16 sets the T sweep's decode rows; {' '.join(mode)} times float32 "
            f"states only: leave out --state-dtype") in capsys.readouterr().err


# ---- cache ---------------------------------------------------------------------------------------------
def test_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "kernels"
    monkeypatch.setenv("LINREC_CACHE_DIR", str(cache))
    assert main(["cache", "info", "--json"]) == 0
    empty = json.loads(capsys.readouterr().out)
    assert empty["dir"] == str(cache) and empty["entries"] == 0 and empty["bytes"] == 0
    # build one kernel in another process (this one may hold kernels in memory from other caches)
    subprocess.run([sys.executable, "-m", "linrec", "run", str(EXAMPLES / "gla.lin"), "--backend", "c",
                    "--form", "recurrent", "--tokens", "3", "--dim", "dk=3", "--dim", "dv=5", "-q"],
                   check=True, cwd=ROOT, timeout=300)
    assert main(["cache", "info", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["entries"] >= 1 and full["bytes"] > 0
    assert all(k["bytes"] > 0 and k["age_s"] >= 0 and k["status"] == "ok" for k in full["kernels"])
    assert any(k["label"].startswith("gla") for k in full["kernels"])
    # a truncated extension shows up as such
    entry = cache / full["kernels"][0]["key"]
    so = next(p for p in entry.iterdir() if p.name.startswith("_linrec_") and p.suffix == ".so")
    so.write_bytes(so.read_bytes()[:100])
    assert main(["cache", "info"]) == 0
    text = capsys.readouterr().out
    assert str(cache) in text and "truncated" in text
    assert main(["cache", "clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert main(["cache", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 0


# ---- run --form step ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("name", ["gla", "gated_deltanet"])
def test_run_step_equals_recurrent(name, backend, cache_dir, tmp_path, capsys):
    path = str(EXAMPLES / f"{name}.lin")
    rec = linrec.load(path)
    inputs = rec.random_inputs(batch=2, tokens=11, heads=3, dims={"dk": 5, "dv": 7}, seed=3)
    s0 = np.random.default_rng(1).standard_normal((2, 3, 5, 7))
    np.savez(tmp_path / "in.npz", S=s0, **inputs)
    outs = {}
    for form in ("step", "recurrent"):
        out = tmp_path / f"{form}.npz"
        assert main(["run", path, "--backend", backend, "--form", form, "--inputs", str(tmp_path / "in.npz"),
                     "--out", str(out), "-q"]) == 0
        outs[form] = dict(np.load(out))
    assert set(outs["step"]) == set(outs["recurrent"]) >= {"o", "S"}
    for key, expected in outs["recurrent"].items():
        got = outs["step"][key]
        assert got.shape == expected.shape and got.dtype == np.float64
        scale = max(1.0, float(np.abs(expected).max()))
        assert np.abs(got - expected).max() <= 1e-10 * scale, key
    # generated inputs and the printed summary
    assert main(["run", path, "--backend", backend, "--form", "step", "--tokens", "4"]) == 0
    assert "one decode step per token" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_run_step_hands_back_stabilized_states_at_true_scale(backend, cache_dir, tmp_path):
    """Performer's steps carry S·exp(−m) and m ("S.log_scale"); run --form step ends with the states the
    other forms give (S and z at their true scale, no log-scale key)."""
    path = str(EXAMPLES / "performer.lin")
    rec = linrec.load(path)
    np.savez(tmp_path / "in.npz", **rec.random_inputs(batch=2, tokens=9, heads=2, seed=4))
    outs = {}
    for form in ("step", "recurrent"):
        assert main(["run", path, "--backend", backend, "--form", form, "--inputs", str(tmp_path / "in.npz"),
                     "--out", str(tmp_path / f"{form}.npz"), "-q"]) == 0
        outs[form] = dict(np.load(tmp_path / f"{form}.npz"))
    assert set(outs["step"]) == set(outs["recurrent"]) >= {"o", "S", "z"}
    for key, expected in outs["recurrent"].items():
        scale = max(1.0, float(np.abs(expected).max()))
        assert np.abs(outs["step"][key] - expected).max() <= 1e-10 * scale, key


def test_run_by_steps_with_params_and_errors(cache_dir):
    rec = linrec.load(EXAMPLES / "mamba2.lin")
    x = rec.random_inputs(batch=1, tokens=6, heads=2, dims={"dk": 4, "dv": 3}, seed=0)
    ref = rec.run(x, form="recurrent")
    got = run_by_steps(rec, x, backend="numpy")
    np.testing.assert_allclose(got.outputs["y"], ref.outputs["y"], rtol=0, atol=1e-12)
    assert set(got.params) == set(ref.params)
    # a program that reads the sequence: the step carries its KV cache
    soft = linrec.load(EXAMPLES / "softmax.lin")
    xs = soft.random_inputs(batch=2, tokens=7, heads=2, dims={"dk": 4, "dv": 3}, seed=1)
    stepped = run_by_steps(soft, xs)
    np.testing.assert_allclose(stepped.outputs["o"], soft.run(xs, form="recurrent").outputs["o"], rtol=0, atol=1e-12)
    assert stepped.final_state == {}
    noncausal = linrec.compile("recurrence nc(dk = 4, dv = 4) noncausal\ninput k[dk], v[dv]\nstate S[dk, dv]\n"
                               "S = S + k⊗v\noutput o = k·S\n")
    with pytest.raises(LinrecError, match="non-causal"):
        run_by_steps(noncausal, noncausal.random_inputs(1, 3, 1, dims={"dk": 4, "dv": 4}))


# ---- bench --shapes model ----------------------------------------------------------------------------
def test_bench_model_grid_in_parts(cache_dir, capsys):
    """--shapes model kept to one (dk, dv) of tiny sizes, one H, one B, one T: every row of the C forms with
    its bound at the multiply-add peak, the decode step of one request with its bandwidth bound, and each
    row against the best of its form ("vs best", 1 for the best)."""
    code = main(["bench", str(EXAMPLES / "gla.lin"), "--shapes", "model", "--grid-dims", "16x8", "--grid-dims",
                 "8x8", "--heads", "2", "--batch", "2", "--T", "32", "--form", "recurrent", "--quick",
                 "--repeats", "1", "--json", "--threads", "1"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shapes"] == "model" and report["backends"] == ["c"] and report["forms"] == ["recurrent"]
    rows = report["rows"]
    assert sorted((r["dk"], r["dv"], r["H"], r["B"], r["T"]) for r in rows) == [(8, 8, 2, 2, 32), (16, 8, 2, 2, 32)]
    for r in rows:
        useful = r["B"] * r["T"] * r["H"] * 4 * r["dk"] * r["dv"]  # GLA: 4·dk·dv per token and head
        assert r["bound_ms"] == pytest.approx(useful / (report["fma_peak_gflops"] * 1e6), rel=1e-12)
        assert r["fraction_of_bound"] == pytest.approx(r["bound_ms"] / r["ms"], rel=1e-12)
    assert min(r["vs_best"] for r in rows) == 1.0
    steps = report["decode"]
    assert sorted((d["dk"], d["dv"], d["H"], d["B"]) for d in steps) == [(8, 8, 2, 1), (16, 8, 2, 1)]
    for d in steps:
        assert d["state_bytes_moved"] == 2 * d["H"] * d["dk"] * d["dv"] * 4 and d["us"] > 0
        assert d["state_in_last_level_cache"] in (True, False)
        assert d["fraction_of_bound"] == pytest.approx(d["bound_us"] / d["us"], rel=1e-12)


def test_model_grid_and_its_limits(cache_dir, capsys):
    """The whole grid is 48 prefill shapes and 12 decode steps; a shape whose arrays would not fit in half of
    the memory available is not run, with the reason; the grid's options need --shapes model."""
    from linrec import bench, bench_shapes
    shapes, decode = bench_shapes.grid(bench.Options(file="x.lin", tokens=[]))
    assert len(shapes) == 4 * 3 * 2 * 2 and len(decode) == 4 * 3
    rec = linrec.load(EXAMPLES / "gla.lin")
    big = bench_shapes.Shape(dk=256, dv=256, heads=32, batch=4, tokens=16384)
    assert bench_shapes.array_bytes(rec, big) == 4 * 16384 * 32 * (3 * 256 + 256 + 256) * 4  # q k g, v; o
    assert "of memory available" in bench_shapes._too_large(rec, big, free=1 << 30)
    assert bench_shapes._too_large(rec, big, free=1 << 50) is None
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--heads", "8"]) == 1
    assert "add --shapes model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", str(EXAMPLES / "gla.lin"), "--shapes", "model", "--grid-dims", "12"])
    assert exit_.value.code == 1 and "DKxDV such as 128x64" in capsys.readouterr().err


# ---- bench --shapes serving --------------------------------------------------------------------------
def test_bench_serving_rows_at_tiny_sizes(cache_dir, capsys):
    """--shapes serving at tiny sizes: a slot-pool row for each N with its tokens/s and its bound (the N rows'
    state bytes, read and written, at the same-run bandwidth), and a prefill row per form with the packed and
    the padded batch timed over the same sequences (correctness of the report only: no speed asserted)."""
    code = main(["bench", str(EXAMPLES / "gated_deltanet.lin"), "--shapes", "serving", "--grid-dims", "8x4",
                 "--heads", "2", "--requests", "1", "--requests", "3", "--pool", "5", "--T", "24", "--batch", "3",
                 "--form", "recurrent", "--quick", "--repeats", "1", "--json", "--threads", "1"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shapes"] == "serving" and report["backends"] == ["c"] and report["forms"] == ["recurrent"]
    assert report["bandwidth_gbs"] > 0 and report["fma_peak_gflops"] > 0
    steps = report["decode"]
    assert sorted((d["dk"], d["dv"], d["H"], d["N"], d["P"]) for d in steps) == [(8, 4, 2, 1, 5), (8, 4, 2, 3, 5)]
    for d in steps:
        assert d["us"] > 0 and d["step_us"] > 0
        assert d["tokens_per_s"] == pytest.approx(d["N"] / (d["us"] * 1e-6), rel=1e-12)
        assert d["state_bytes_moved"] == 2 * d["N"] * 2 * 8 * 4 * 4   # S [dk, dv] of each active row, twice
        assert d["pool_bytes"] == 5 * 2 * 8 * 4 * 4
        assert d["bound_us"] == pytest.approx(d["state_bytes_moved"] / (report["bandwidth_gbs"] * 1e3), rel=1e-12)
        assert d["fraction_of_bound"] == pytest.approx(d["bound_us"] / d["us"], rel=1e-12)
        llc = max(report["machine_limits"]["caches"].values(), default=0)  # (unknown on some machines: none)
        assert d["state_in_last_level_cache"] is (0 < d["state_bytes_moved"] // 2 <= llc)
    [row] = report["prefill"]
    assert (row["dk"], row["dv"], row["H"], row["N"], row["T_max"], row["form"]) == (8, 4, 2, 3, 24, "recurrent")
    assert len(row["lengths"]) == 3 and max(row["lengths"]) == 24 and min(row["lengths"]) >= 1
    assert row["tokens"] == sum(row["lengths"]) and row["padded_tokens"] == 3 * 24
    assert row["token_ratio"] == pytest.approx(3 * 24 / row["tokens"], rel=1e-12)
    assert row["packed_ms"] > 0 and row["padded_ms"] > 0
    assert row["padded_over_packed"] == pytest.approx(row["padded_ms"] / row["packed_ms"], rel=1e-12)
    assert row["packed_tokens_per_s"] == pytest.approx(row["tokens"] / (row["packed_ms"] / 1e3), rel=1e-12)
    assert row["useful_flops"] == row["tokens"] * 2 * 6 * 8 * 4     # gated DeltaNet: 6·dk·dv a token and head
    assert row["bound_ms"] == pytest.approx(row["useful_flops"] / (report["fma_peak_gflops"] * 1e6), rel=1e-12)


def test_bench_serving_options_and_their_errors(cache_dir, capsys):
    """The lengths are mixed, seeded and reach T_max; the padded batch holds each sequence at the start of
    its row; --requests and --pool need --shapes serving, and N above the pool is an error naming --requests."""
    from linrec import bench_serving
    lengths = bench_serving._lengths(8, 100)
    assert lengths == bench_serving._lengths(8, 100) and lengths[0] == 100 and len(set(lengths)) > 1
    assert all(1 <= n <= 100 for n in lengths)
    rec = linrec.load(EXAMPLES / "gla.lin")
    packed = rec.random_inputs(1, sum(lengths[:3]), 2, dims={"dk": 4, "dv": 4}, dtype=np.float32)
    padded = bench_serving._padded(rec, packed, lengths[:3], 2, {"dk": 4, "dv": 4})
    start = 0
    for i, n in enumerate(lengths[:3]):
        for k in packed:
            assert padded[k].shape[:2] == (3, 100) and np.array_equal(padded[k][i, :n], packed[k][0, start:start + n])
        start += n
    # a program that refuses cu_seqlens, or has neither form timed by default, has no prefill rows, and says why
    from linrec import bench
    linformer = linrec.load(EXAMPLES / "linformer.lin")
    assert bench_serving._forms(linformer, bench.Options(file="linformer.lin"))[2][0].startswith(
        "'linformer' does not take cu_seqlens (its parameter(s) E, F span the sequence axis")
    assert bench_serving._forms(rec, bench.Options(file="gla.lin")) == (["recurrent", "chunkwise"], [], [])
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--requests", "4"]) == 1
    assert "add --shapes serving" in capsys.readouterr().err
    assert main(["bench", str(EXAMPLES / "gla.lin"), "--shapes", "serving", "--requests", "9", "--pool", "8"]) == 1
    assert "--requests 9 is more than the pool's 8 slots" in capsys.readouterr().err


def test_threads_beyond_the_kernels_most_are_taken_as_that_many(monkeypatch):
    """--threads 99999999999999999999 reached machine.fma_peak (OverflowError: an internal error); it is clamped
    to c_build.MAX_THREADS as LINREC_NUM_THREADS and threads(n) are, and the report says the count used."""
    from linrec import bench
    from linrec.c import build as c_build
    rec = linrec.load(EXAMPLES / "gla.lin")
    monkeypatch.setattr(bench, "_auto_choices", lambda *args: [])  # (no form="auto" measurement needed here)
    plan = bench.make_plan(rec, bench.Options(file="gla.lin", tokens=[16], threads=99999999999999999999,
                                              backends=["numpy"], forms=["recurrent"], quick=True))
    assert (plan.threads, plan.threads_from) == (c_build.MAX_THREADS, "--threads")


def test_the_model_grid_scripts_name_a_missing_result_file(tmp_path):
    """benchmarks/model_shapes.py table/plot before any run (the docs' glob results/model_*.json matches
    nothing and reaches the script as itself): a usage error that says which file and what writes it, not a
    FileNotFoundError traceback."""
    script = ROOT / "benchmarks" / "model_shapes.py"
    for command in ("table", "plot"):
        done = subprocess.run([sys.executable, str(script), command, str(tmp_path / "model_*.json")],
                              capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        assert "no such result file" in done.stderr and "model_shapes.py run" in done.stderr
        assert "Traceback" not in done.stderr
