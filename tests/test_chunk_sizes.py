"""Chunk sizes, from the API and the command line, on both backends: any positive integer (a Python or NumPy one)
is a chunk size — one longer than the sequence is the whole sequence as one chunk, up to 2⁶⁴ (it was a C int:
2³¹ crashed the C chunkwise form, 2³² and up never returned) — and anything else is a RuntimeInputError (exit
status 1 from the command line). The chunkwise form equals the float64 recurrent form within 1e-9 (relative:
max|x − ref| / max|ref|, outputs and final states) at every size. One C kernel runs every chunk size."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.c import scan_kernels
from linrec.cli import main
from compare import rel_err

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# a vector state read as it is: its reads run in c_values' kernels
VECTOR = """recurrence vector_read(d = 6)
input k[d], g[d] <= 0
state z[d]
z = diag(exp(g))·z + k
output y = z*k
"""
PROGRAMS = {"gla": EXAMPLES / "gla.lin", "gated_deltanet": EXAMPLES / "gated_deltanet.lin",
            "softmax": EXAMPLES / "softmax.lin", "vector_read": VECTOR}
B, T, H = 2, 37, 2
DIMS = {"dk": 5, "dv": 6}  # not whole SIMD registers
CHUNKS = (1, 7, T - 1, T, T + 1, 2**31, 2**32, 2**64, np.uint64(2**64 - 1))
TOL = 1e-9


def load(name: str) -> linrec.Recurrence:
    source = PROGRAMS[name]
    return linrec.compile(source) if isinstance(source, str) else linrec.load(source)


def case(name: str):
    """(program, inputs, initial states, the float64 recurrent form's result) for B, T, H above."""
    rec = load(name)
    dims = {d.name: DIMS.get(d.name, d.default) for d in rec.program.dims}
    inputs = rec.random_inputs(B, T, H, dims=dims, seed=3)
    rng = np.random.default_rng(5)
    state0 = {s.name: rng.standard_normal((B, H) + tuple(dims[d] for d in s.shape)) for s in rec.program.states}
    return rec, inputs, state0, rec.run(inputs, form="recurrent", initial_state=state0)


def assert_matches(outputs: dict, finals: dict, ref: linrec.Result, label: str):
    assert set(outputs) == set(ref.outputs) and set(finals) == set(ref.final_state), label
    for name, value in ref.outputs.items():
        assert rel_err(outputs[name], value) <= TOL, f"{label}: output {name}"
    for name, value in ref.final_state.items():
        assert rel_err(finals[name], value) <= TOL, f"{label}: final state {name}"


def exit_status(argv: list[str]) -> int:
    """main's exit status, whether it returns it or exits (argparse's usage errors)."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_every_chunk_size_through_the_api(name, backend):
    rec, inputs, state0, ref = case(name)
    for chunk in CHUNKS:
        res = rec.run(inputs, form="chunkwise", backend=backend, initial_state=state0, chunk_size=chunk)
        assert_matches(res.outputs, res.final_state, ref, f"{name} ({backend}), chunk size {chunk}")


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "softmax"])
def test_every_chunk_size_through_the_command_line(name, backend, tmp_path, capsys):
    rec, inputs, state0, ref = case(name)
    np.savez(tmp_path / "in.npz", **inputs, **state0)
    for chunk in CHUNKS:
        out = tmp_path / f"out{chunk}.npz"
        assert exit_status(["run", str(PROGRAMS[name]), "--inputs", str(tmp_path / "in.npz"), "--backend", backend,
                            "--form", "chunkwise", "--chunk-size", str(chunk), "--out", str(out), "-q"]) == 0, \
            capsys.readouterr().err
        saved = np.load(out)
        assert_matches({k: saved[k] for k in ref.outputs}, {k: saved[k] for k in ref.final_state}, ref,
                       f"{name} ({backend}), --chunk-size {chunk}")


@pytest.mark.parametrize("name", ["gla", "softmax"])
def test_invalid_chunk_sizes_are_refused(name, tmp_path, capsys):
    rec, inputs, _, _ = case(name)
    for backend in ("numpy", "c"):
        for chunk in (0, -1, 2.5, "8", True, np.int64(0), np.float64(8)):
            with pytest.raises(linrec.RuntimeInputError, match="chunk size must be a positive integer") as err:
                rec.run(inputs, form="chunkwise", backend=backend, chunk_size=chunk)
            assert repr(chunk) in str(err.value), str(err.value)
    np.savez(tmp_path / "in.npz", **inputs)
    for text in ("0", "-1", "2.5", "True", "eight"):
        status = exit_status(["run", str(PROGRAMS[name]), "--inputs", str(tmp_path / "in.npz"), "--form",
                              "chunkwise", "--chunk-size", text, "-q"])
        err = capsys.readouterr().err
        assert status == 1 and "chunk size must be a positive integer" in err and text in err, err
        assert "Traceback" not in err and "internal error" not in err, err


def test_one_c_kernel_runs_every_chunk_size(monkeypatch):
    """The scan kernels' memo holds one kernel per structure: chunk sizes are not one."""
    for name in ("gla", "vector_read"):
        monkeypatch.setattr(scan_kernels, "_kernels", {})
        rec, inputs, state0, ref = case(name)
        for chunk in (None, 1, 7, 2 * T):
            res = rec.run(inputs, form="chunkwise", backend="c", initial_state=state0, chunk_size=chunk)
            assert_matches(res.outputs, res.final_state, ref, f"{name}, chunk size {chunk}")
        assert len(scan_kernels._kernels) == 1, list(scan_kernels._kernels)
