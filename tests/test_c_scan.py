"""The C parallel and chunkwise scans (backends/c/scan.py) against numpy_scan, and the examples end to end.

For random canonical inputs of every structure — no decay, one log-decay per token, one per row; 0, 1 or 2
corrections; 0, 1 or 2 writes; readouts before and after the update, or none; causal and non-causal; a
vector state (dv = 1), also read as it is (c_values: its readouts with no query); dk ≠ dv, sizes that are
and are not whole SIMD registers — the C results equal numpy_scan's on the same arrays (run in float64:
numpy_scan in float32 is itself off by up to 2e-3 when a state decays to 1e-23), as max|C − NumPy| /
max(max|NumPy|, floor) per readout and final state:
    float64: 1e-10        float32: 5e-4 (floor 1e-6: arrays that decay to almost nothing)
at T ∈ {1, 5, 37, 130}, chunk sizes 1, 7, 16 and 64 (the default; one kernel runs every chunk size),
mild to strong decays (log-decays ×0.1, ×1 and ×10), with the fast scores and forced onto the stable ones.
End to end, every example's generated NumPy parallel and chunkwise modules, with their scans running in C,
equal the NumPy recurrent form in float64.

Every kernel is built once per session (two compiler processes at a time) into a session cache directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.c import build as c_build
from linrec.c import scan as c_scan
from linrec.c import scan_kernels
from linrec.c import elementwise as c_elementwise
from linrec.c import values as c_values
from linrec.numpy import scan as numpy_scan
from linrec.dsl.errors import LinrecError, RuntimeInputError
from compare import rel_err

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.lin")  # the scan programs (not attention) C's scans take
                  if linrec.load(p).decomposition.sequence is None and "chunkwise" in linrec.load(p).forms
                  and c_scan.why_not(linrec.load(p).compiled) is None)
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 5e-4}
FLOOR = {np.dtype(np.float64): 1e-30, np.dtype(np.float32): 1e-6}
DTYPES = (np.float64, np.float32)
TOKENS = (1, 5, 37, 130)
E2E_DIMS = {"dk": 5, "dv": 19, "m": 5}  # m: random features (performer)


@dataclasses.dataclass(frozen=True)
class Case:
    """One structure of canonical inputs (what a state hands to the scan)."""

    decay: str
    corrections: int
    writes: int
    before: tuple[bool, ...]
    causal: bool = True
    dk: int = 5
    dv: int = 19
    values: tuple[bool, ...] = ()  # readouts of a vector state (dv = 1) as it is: before the update or not

    def __str__(self):
        reads = "".join("b" if b else "a" for b in self.before) + "".join("B" if b else "A" for b in self.values)
        reads = reads or "-"
        return (f"{self.decay}-r{self.corrections}-w{self.writes}-{reads}-{'c' if self.causal else 'nc'}-"
                f"{self.dk}x{self.dv}")


CASES = [
    Case("none", 0, 1, (False,)),                    # linear attention
    Case("none", 0, 1, (False,), dv=1),              # its normalizer: a vector state
    Case("token", 0, 1, (False,)),                   # RetNet, Mamba-2
    Case("row", 0, 1, (False,)),                     # GLA
    Case("none", 1, 1, (False,)),                    # DeltaNet
    Case("token", 1, 1, (False,)),                   # Gated DeltaNet
    Case("row", 2, 2, (True, False)),                # everything at once
    Case("token", 1, 0, (True,), dk=7, dv=16),       # corrections only; dv a whole number of registers
    Case("none", 2, 1, (False, True), dk=6, dv=32),
    Case("row", 1, 1, (False,), causal=False, dv=16),
    Case("token", 0, 2, (True, False), causal=False, dk=4),
    Case("row", 0, 1, ()),                           # no readouts: only the final state
    Case("row", 1, 1, (False,), dv=1),               # a decayed vector state with a correction
    Case("row", 0, 1, (), values=(False,), dv=1),    # read as it is: HGRN, RG-LRU
    Case("token", 0, 2, (False,), dv=1, values=(True, False)),  # and through a query, before and after
    Case("none", 0, 1, (), dk=19, dv=1, values=(True,)),         # a running sum, 19 channels
    Case("row", 0, 1, (), causal=False, dv=1, values=(False,)),  # non-causal: the final state at every token
]
GENERAL = CASES[6]
VALUES = CASES[14]  # reads as it is and through a query
CHUNKS = (1, 7, 16)  # besides the default 64, for GENERAL


def structures(case: Case, dtype) -> set:
    """The kernels a case runs on: c_values' for its reads as it is, c_scan's for the rest."""
    ctype = c_scan.CTYPES[np.dtype(dtype)]
    out = set()
    if case.values:
        out.add(c_values.Structure(case.decay, case.writes, case.values, case.causal, case.dk, ctype))
    if case.before or not case.values:
        out.add(c_scan.Structure(case.decay, case.corrections, case.writes, case.before, case.causal, case.dk,
                                 case.dv, ctype, c_build.vector_bytes()))
    return out


def example_structures() -> list:
    out = []
    for path in EXAMPLES:
        compiled = linrec.load(path).compiled
        for dtype in DTYPES:
            out += [s for _, s in c_scan.structures(compiled, dtype, E2E_DIMS)]
    return out


_BUILD = """
import json, sys
from linrec.c import scan as c_scan
from linrec.c import values as c_values
from linrec.c import elementwise as c_elementwise
for kind, fields in json.load(sys.stdin):
    fields["before"] = tuple(fields["before"])
    module = {"values": c_values, "elementwise": c_elementwise}.get(kind, c_scan)
    module.kernel(module.Structure(**fields))
"""
KINDS = ((c_values, "values"), (c_elementwise, "elementwise"), (c_scan, "scan"))  # (module, its name above)


def kind_of(s):
    return next((module, name) for module, name in KINDS if isinstance(s, module.Structure))


def build_kernel(s):
    kind_of(s)[0].kernel(s)


@pytest.fixture(scope="session", autouse=True)
def kernels(cache_dir):
    """Every kernel these tests use, built into the session's cache by two compiler processes at a time."""
    wanted = {s for c in CASES for d in DTYPES for s in structures(c, d)}
    wanted |= set(example_structures())
    wanted = sorted(wanted, key=repr)
    workers = max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
    procs = []
    for i in range(workers):
        part = [(kind_of(s)[1], dataclasses.asdict(s))
                for s in wanted[i::workers]]
        p = subprocess.Popen([sys.executable, "-c", _BUILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        procs.append((p, json.dumps(part)))
    for p, data in procs:
        _, err = p.communicate(data, timeout=600)
        assert p.returncode == 0, err[-3000:]
    for s in wanted:  # load them here (from the disk cache, by alias: no compiling)
        build_kernel(s)
    try:  # the NumPy references are many small products: BLAS threads only add contention
        from threadpoolctl import threadpool_limits
        limiter = threadpool_limits(1)
    except ImportError:
        limiter = None
    yield cache_dir
    if limiter is not None:
        limiter.restore_original_limits()


# ---- random canonical inputs ---------------------------------------------------------------------
def canonical(case: Case, tokens: int, dtype, decay_scale: float = 1.0, seed: int = 0, batch: int = 2,
              heads: int = 3):
    """(s0, log_decay, corrections, writes, readouts) as a generated module hands them to the scan.
    Corrections are delta-rule-like (u = −β·k̂, w = k̂, Σβ < 1), so the state stays bounded."""
    rng = np.random.default_rng(seed)
    lead = (batch, tokens, heads)

    def normal(n, scale=1.0):
        return (scale * rng.standard_normal(lead + (n,))).astype(dtype)

    log_decay = None
    if case.decay != "none":
        width = 1 if case.decay == "token" else case.dk
        log_decay = (-decay_scale * 0.5 * np.abs(rng.standard_normal(lead + (width,)))).astype(dtype)
    corrections = []
    for _ in range(case.corrections):
        k = rng.standard_normal(lead + (case.dk,))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        beta = rng.uniform(0.05, 0.9 / max(1, case.corrections), lead + (1,))
        corrections.append(((-beta * k).astype(dtype), k.astype(dtype)))
    writes = [(normal(case.dk), normal(case.dv)) for _ in range(case.writes)]
    readouts = [(normal(case.dk), before) for before in case.before] + [(None, before) for before in case.values]
    s0 = rng.standard_normal((batch, heads, case.dk, case.dv)).astype(dtype)
    return s0, log_decay, corrections, writes, readouts


def float64(args):
    s0, log_decay, corrections, writes, readouts = args
    up = lambda x: None if x is None else np.asarray(x, dtype=np.float64)  # noqa: E731
    return (up(s0), up(log_decay), [(up(u), up(w)) for u, w in corrections], [(up(k), up(x)) for k, x in writes],
            [(up(q), before) for q, before in readouts])


# The ways the kernel computes decayed scores (see the top of templates/c_scan.c.j2), chosen per segment by
# span_max: default: the fast way when a segment's log-decays span ≤ SPAN_MAX; 1.0: mostly the stable
# sub-blocks with GEMMs on the diagonal blocks too (mild decays); 0.0: the stable way with the diagonal
# blocks element-wise.
SPANS = (None, 1.0, 0.0)


def check(form, args, causal, chunk, dtype, spans=SPANS, label=""):
    expected_out, expected_state = getattr(numpy_scan, f"{form}_scan")(*float64(args), causal=causal,
                                                                        chunk_size=chunk)
    floor = FLOOR[np.dtype(dtype)]
    for span_max in spans:
        out, state = c_scan.scan(form, *args, causal=causal, chunk_size=chunk, span_max=span_max)
        assert len(out) == len(expected_out)
        assert state.dtype == np.dtype(dtype) and state.shape == expected_state.shape
        errs = [rel_err(state, expected_state, floor)]
        for o, e in zip(out, expected_out):
            assert o.dtype == np.dtype(dtype) and o.shape == e.shape
            errs.append(rel_err(o, e, floor))
        assert max(errs) <= TOL[np.dtype(dtype)], f"{label} {form} span_max={span_max}: errors {errs}"


# ---- the scans against numpy_scan --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_structures(case, dtype):
    scales = (0.1, 1.0, 10.0) if case.decay != "none" else (1.0,)
    for tokens in TOKENS:
        for scale in scales:
            args = canonical(case, tokens, dtype, scale, seed=tokens)
            for form in ("chunkwise", "parallel"):
                check(form, args, case.causal, None, dtype, SPANS if case.decay != "none" else (None,),
                      label=f"T={tokens} ×{scale}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunk_sizes(chunk, dtype):
    for case in (GENERAL, VALUES):
        for tokens in TOKENS:
            for scale in (0.1, 1.0, 10.0):
                args = canonical(case, tokens, dtype, scale, seed=7 * tokens)
                check("chunkwise", args, True, chunk, dtype, label=f"{case} T={tokens} ×{scale}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_recurrent_scan(dtype):
    """numpy_scan.recurrent_scan's twin (stabilized programs emit their recurrent form as a scan)."""
    for tokens in (1, 37):
        args = canonical(GENERAL, tokens, dtype, 1.0, seed=11)
        expected_out, expected_state = numpy_scan.recurrent_scan(*float64(args))
        out, state = c_scan.recurrent_scan(*args)
        floor = FLOOR[np.dtype(dtype)]
        assert rel_err(state, expected_state, floor) <= TOL[np.dtype(dtype)]
        assert all(rel_err(o, e, floor) <= TOL[np.dtype(dtype)] for o, e in zip(out, expected_out))


def test_results_do_not_depend_on_chunk_size_or_threads(monkeypatch):
    monkeypatch.setattr(scan_kernels, "SMALL_WORK", 0)  # threads even for a small call
    for case in (GENERAL, VALUES):
        args = canonical(case, 130, np.float64, 1.0, seed=3)
        ref_out, ref_state = c_scan.scan("parallel", *args, num_threads=1)
        for chunk in (1, 7, 16, 64):
            for threads in (1, 2, 5):
                out, state = c_scan.scan("chunkwise", *args, chunk_size=chunk, num_threads=threads)
                assert rel_err(state, ref_state) < 1e-12, f"{case} chunk {chunk}, {threads} threads"
                assert all(rel_err(o, r) < 1e-12 for o, r in zip(out, ref_out)), f"{case} chunk {chunk}"


def test_strided_and_broadcast_inputs():
    """Views are read in place (any strides with a contiguous last axis), others are copied; a per-head
    value broadcast over tokens and a transposed query give the same results as contiguous copies."""
    case = CASES[5]  # one decay per token, a correction, a write
    s0, ld, corr, wr, rd = canonical(case, 37, np.float64, 1.0)
    per_head = np.random.default_rng(1).standard_normal((2, 1, 3, case.dv))
    x_view = np.broadcast_to(per_head, (2, 37, 3, case.dv))                       # stride 0 along T
    q_t = np.asfortranarray(rd[0][0])                                            # last axis strided
    ld_view = np.broadcast_to(np.float64(-0.3), (2, 37, 3, 1))                   # a constant decay
    views = (s0, ld_view, corr, [(wr[0][0], x_view)], [(q_t, False)])
    dense = (s0, np.ascontiguousarray(ld_view), corr, [(wr[0][0], np.ascontiguousarray(x_view))],
             [(np.ascontiguousarray(q_t), False)])
    for form in ("chunkwise", "parallel"):
        out_v, state_v = getattr(c_scan, f"{form}_scan")(*views)
        out_d, state_d = getattr(c_scan, f"{form}_scan")(*dense)
        np.testing.assert_array_equal(state_v, state_d)
        np.testing.assert_array_equal(out_v[0], out_d[0])
        check(form, views, True, None, np.float64)


def test_edge_cases_and_errors():
    case = CASES[3]
    s0, ld, corr, wr, rd = canonical(case, 0, np.float32)
    out, state = c_scan.chunkwise_scan(s0, ld, corr, wr, rd)  # no tokens: the state is unchanged
    assert out[0].shape == (2, 0, 3, case.dv) and np.array_equal(state, s0)
    s0, ld, corr, wr, rd = canonical(case, 5, np.float32)
    with pytest.raises(RuntimeInputError, match="shape"):
        c_scan.chunkwise_scan(s0, ld, corr, [(wr[0][0][..., :-1], wr[0][1])], rd)
    with pytest.raises(RuntimeInputError, match="log-decay"):
        c_scan.chunkwise_scan(s0, ld[..., :2], corr, wr, rd)
    with pytest.raises(RuntimeInputError, match="initial state"):
        c_scan.chunkwise_scan(s0[:1], ld, corr, wr, rd)
    # nothing read, written or corrected (a state that only decays): its final state, without a kernel
    out, state = c_scan.parallel_scan(s0, ld, [], [], [])
    assert out == [] and state.dtype == s0.dtype
    np.testing.assert_allclose(state, np.exp(ld.astype(np.float64).sum(axis=1))[..., None] * s0, rtol=1e-6)
    with pytest.raises(RuntimeInputError, match="chunk size"):
        c_scan.chunkwise_scan(s0, ld, corr, wr, rd, chunk_size=-2)
    # a vector state read as it is, whose update has a correction: its reads would need the pseudo-values
    s0, ld, corr, wr, _ = canonical(CASES[12], 5, np.float32)
    with pytest.raises(LinrecError, match="no rank-one correction"):
        c_scan.chunkwise_scan(s0, ld, corr, wr, [(None, False)])


_NEAR_INT_MAX = """
import sys
import numpy as np
from linrec.c import scan as c_scan
from linrec.c import values as c_values
tokens, dv = 2**31 - 1, 8
ones = lambda n: np.broadcast_to(np.ones(n), (1, tokens, 1, n))  # stride 0 along T: no memory per token
if sys.argv[1] == "scan":
    _, final = c_scan.scan("chunkwise", np.zeros((1, 1, 1, dv)), None, [], [(ones(1), ones(dv))], [],
                           chunk_size=4096, num_threads=1)
else:
    _, final = c_values.scan("chunkwise", np.zeros((1, 1, 1, 1)), None, [(ones(1), ones(1))], [],
                             chunk_size=4096, num_threads=1)
print(sys.argv[1], final.ravel().tolist())
"""


def test_sequences_near_the_int_limit():
    """T = 2³¹ − 1 tokens (views with stride 0 along T: kilobytes, not gigabytes): the last chunk ends past
    INT_MAX, where an int token index wrapped around and the kernels never returned. No decay and ones written
    every token: the final state is T in every entry, exactly (float64). ~10 s each, in two processes at once,
    with a timeout: a regression fails instead of hanging the session."""
    procs = [subprocess.Popen([sys.executable, "-c", _NEAR_INT_MAX, kind], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(ROOT)) for kind in ("scan", "values")]
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            kind, values = out.split(" ", 1)
            assert json.loads(values) == [2**31 - 1] * (8 if kind == "scan" else 1), out
    finally:
        for p in procs:
            p.kill()


def test_thread_count_from_environment(monkeypatch):
    from linrec.c import build as c_build
    monkeypatch.setenv("LINREC_NUM_THREADS", "3")
    assert c_build.num_threads() == 3
    monkeypatch.setenv("LINREC_NUM_THREADS", "zero")
    with pytest.raises(LinrecError, match="LINREC_NUM_THREADS"):
        c_build.num_threads()
    monkeypatch.delenv("LINREC_NUM_THREADS")
    assert c_build.num_threads() >= 1


# ---- the examples end to end ---------------------------------------------------------------------------
def _forward(module, inputs, dims, state0, dtype, chunk=None):
    heads = next(iter(inputs.values())).shape[2]
    params = {k: np.array(v, dtype=dtype) for k, v in module.default_params(heads, dims, {}).items()}
    init = {k: np.array(v, dtype=dtype) for k, v in state0.items()}
    return module.forward({k: v.astype(dtype) for k, v in inputs.items()}, params, init, dims, chunk_size=chunk)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_end_to_end(path):
    """The generated NumPy module of each form, its scans replaced by the C ones (c_scan.load does that:
    it execs the emitted source, then swaps parallel_scan / chunkwise_scan), equals the recurrent form."""
    _end_to_end(linrec.load(path))


# states declared [dv, dk], multiplied and read from the right (the source document's convention): the
# forms carry them transposed, S's initial and final state transposed at the boundary (compiler.transpose)
TRANSPOSED = {
    "delta_t": """recurrence delta_t(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0
kn = l2norm(k)
state S[dv, dk]
S = exp(g)·S·(I − beta·kn⊗kn) + beta·v⊗kn
output o = S·q
""",
    "gla_t": """recurrence gla_t(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dv, dk]
early = S·q
S = S·diag(exp(g)) + v⊗k
output o = S·q + early
""",
}


@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_states_end_to_end(name):
    rec = linrec.compile(TRANSPOSED[name], f"{name}.lin")
    assert rec.decomposition.transposed == {"S"}
    _end_to_end(rec)


def _end_to_end(rec):
    program = rec.program
    own = {d: n for d, n in E2E_DIMS.items() if d in {x.name for x in program.dims}}  # (m: performer's only)
    inputs = rec.random_inputs(batch=2, tokens=130, heads=3, dims=own, seed=5)
    dims = {d.name: d.default for d in program.dims} | E2E_DIMS
    rng = np.random.default_rng(2)
    state0 = {s.name: 0.5 * rng.standard_normal((2, 3) + tuple(dims[d] for d in s.shape)) for s in program.states}
    expected, expected_state = _forward(rec.module("recurrent"), inputs, dims, state0, np.float64)
    for form in ("chunkwise", "parallel"):
        module = c_scan.load(rec.compiled, form)
        assert getattr(module, f"{form}_scan") is getattr(c_scan, f"{form}_scan")
        for dtype in DTYPES:
            tol = 1e-9 if dtype == np.float64 else TOL[np.dtype(dtype)]
            outputs, final = _forward(module, inputs, dims, state0, dtype)
            for name, ref in list(expected.items()) + list(expected_state.items()):
                got = outputs.get(name, final.get(name))
                assert got.dtype == np.dtype(dtype)
                assert rel_err(got, ref) <= tol, f"{form} {np.dtype(dtype).name} '{name}': {rel_err(got, ref):.2e}"


def test_emit_source():
    for path in EXAMPLES:
        compiled = linrec.load(path).compiled
        for form in ("parallel", "chunkwise"):
            text = c_scan.emit(compiled, form)
            kernels = sum(text.count(f"int lr_{kind}chunkwise(") for kind in ("", "values_", "elementwise_"))
            assert kernels == len(c_scan.structures(compiled))
            assert f"state '{compiled.program.states[0].name}'" in text
            # (the file says what it is: the program, its form, its source)
            assert f"the {form} form of '{compiled.name}'" in text.splitlines()[0]
            assert compiled.source.strip().splitlines()[-1].strip() in text
    text = c_scan.emit(linrec.load(ROOT / "examples" / "gla.lin").compiled, "chunkwise", dtype=np.float64,
                       dims={"dk": 64, "dv": 64})
    assert "typedef double T;" in text and "#define DK 64" in text
    assert "CHUNK" not in text and "double span_max, int chunk)" in text  # the chunk is an argument
    with pytest.raises(LinrecError):
        c_scan.emit(linrec.load(ROOT / "examples" / "gla.lin").compiled, "recurrent")
