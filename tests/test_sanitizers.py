"""The generated C under AddressSanitizer and UndefinedBehaviorSanitizer, and without compiler warnings.

* Sanitized: every example is built with `-O1 -fsanitize=address,undefined` (LINREC_CFLAGS, so into a cache of
  its own) in a child process — the address sanitizer's runtime must be loaded before Python's allocator
  is, hence LD_PRELOAD — and run in every form C builds and its decode step, at sizes that are no whole
  number of registers, against the float64 NumPy forms (1e-9). A sanitizer's report, or any difference,
  fails the test. UndefinedBehaviorSanitizer stops at its first report (-fno-sanitize-recover).
* Warnings: the kernels' own source (without cffi's wrapper) compiles with `-Wall -Wextra -Werror` at the
  flags linrec builds with, optimized at -O1 (see the test): the recurrent kernels, the scans of every state, the
  recurrent and chunkwise backward kernels of each causal state's scan and the attention kernels, in both dtypes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.c import attention as c_attention
from linrec.c import backend as c_backend
from linrec.c import build as c_build
from linrec.c import elementwise as c_elementwise
from linrec.c import grad_chunk_kernels as c_grad_chunk_kernels
from linrec.c import grad_kernels as c_grad_kernels
from linrec.c import scan as c_scan
from linrec.c import staged_recurrent
from linrec.compiler import stage_compiled
from linrec.c import values as c_values
from linrec.numpy import sequence as numpy_sequence

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROGRAMS = sorted(p.stem for p in EXAMPLES.glob("*.lin"))
# -O1, as the sanitizers' own documentation advises: every memory access of the source is still checked, and
# the instrumented kernels compile about 4x faster than at linrec's -O3 (the build was a third of the suite).
SANITIZERS = "-O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "SUMMARY: UndefinedBehaviorSanitizer")

# The child: every C form and the decode step of each program against NumPy, one JSON line per comparison.
_CHILD = r"""
import json, sys
import numpy as np
import linrec
from linrec.decode import run_by_steps
from linrec.registry import builds
for path in sys.argv[1:]:
    rec = linrec.load(path)
    dims = {d.name: 5 + 2 * i for i, d in enumerate(rec.program.dims) if d.name != "T"}
    x = rec.random_inputs(2, 37, 3, dims=dims, seed=1)
    for form in rec.forms:
        if not builds(rec.compiled, "c", form):
            continue
        ref = rec.run(x, form=form, backend="numpy", dims=dims)
        got = rec.run(x, form=form, backend="c", dims=dims)
        err = max(float(np.abs(got.outputs[k] - ref.outputs[k]).max() / max(np.abs(ref.outputs[k]).max(), 1e-30))
                  for k in ref.outputs)
        print(json.dumps({"program": rec.name, "form": form, "error": err}), flush=True)
    if rec.program.causal and "recurrent" in rec.forms and builds(rec.compiled, "c", "recurrent"):
        short = {k: v[:, :6] for k, v in x.items()}
        ref = rec.run(short, form="recurrent", backend="numpy", dims=dims)
        got = run_by_steps(rec, short, backend="c", params=ref.params)
        err = max(float(np.abs(got.outputs[k] - ref.outputs[k]).max() / max(np.abs(ref.outputs[k]).max(), 1e-30))
                  for k in ref.outputs)
        print(json.dumps({"program": rec.name, "form": "step", "error": err}), flush=True)
"""


def _sanitizer_runtime() -> str | None:
    """The address sanitizer's shared runtime of the compiler linrec builds with, if it has one."""
    try:
        res = subprocess.run([c_build.compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError, linrec.LinrecError):
        return None
    path = res.stdout.strip()
    return path if res.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def sanitized_runs(tmp_path_factory):
    """Every example run in sanitized kernels, in two children (the machine's two cores): their results,
    and what they printed to stderr."""
    runtime = _sanitizer_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no address sanitizer runtime (libasan)")
    cache = tmp_path_factory.mktemp("sanitized-kernels")
    env = dict(os.environ, LINREC_CFLAGS=SANITIZERS, LINREC_CACHE_DIR=str(cache), LD_PRELOAD=runtime,
               ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    halves = [[str(EXAMPLES / f"{p}.lin") for p in PROGRAMS[i::2]] for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda files: subprocess.run([sys.executable, "-c", _CHILD, *files], env=env,
                                                          capture_output=True, text=True, timeout=1500), halves))
    return done


def test_every_example_is_clean_under_the_sanitizers(sanitized_runs):
    rows = []
    for res in sanitized_runs:
        reports = [line for line in res.stderr.splitlines() if any(r in line for r in REPORTS)]
        assert not reports, res.stderr[-4000:]
        assert res.returncode == 0, res.stderr[-4000:]
        rows += [json.loads(line) for line in res.stdout.splitlines()]
    assert {r["program"] for r in rows} == set(PROGRAMS)
    assert {(r["program"], r["form"]) for r in rows} >= {("gla", f) for f in ("recurrent", "parallel", "chunkwise",
                                                                             "step")}
    bad = [r for r in rows if not r["error"] <= 1e-9]
    assert not bad, bad


def _kernel_sources() -> list[tuple[str, str]]:
    """(label, C source) of every kernel the examples build: recurrent kernels, scans, attention kernels."""
    out = []
    for stem in PROGRAMS:
        rec = linrec.load(EXAMPLES / f"{stem}.lin")
        compiled = rec.compiled
        for dtype in (np.float32, np.float64):
            if compiled.decomposition.sequence is not None:
                sizes = {d.name: d.default for d in compiled.program.dims}
                for r in compiled.decomposition.sequence.softmax_readouts:
                    keys, _, values = numpy_sequence.kernel_pattern(r)
                    out.append((f"{stem} attention {dtype.__name__}",
                                c_attention.source(dtype, sizes[keys.shape[-1]], sizes[values.shape[-1]])))
                continue
            if c_backend.why_not(compiled, "recurrent") is None and c_backend.recurrent_kernel(compiled) != "scan":
                out.append((f"{stem} recurrent {dtype.__name__}", c_backend.emit_recurrent(compiled, dtype)))
                for stage in staged_recurrent.sequence_stages(compiled) or ():  # (its sequences' kernels)
                    out.append((f"{stem} recurrent {dtype.__name__}, stage {stage.number}",
                                c_backend.emit_recurrent(stage_compiled(compiled, stage), dtype)))
            if c_backend.why_not(compiled, "chunkwise") is None:
                for state, s in c_scan.structures(compiled, dtype):
                    render = c_values.render if isinstance(s, c_values.Structure) else \
                        c_elementwise.render if isinstance(s, c_elementwise.Structure) else c_scan.render
                    out.append((f"{stem} scan of {state} {dtype.__name__}", render(s)))
                    out += _backward_sources(f"{stem} {state} {dtype.__name__}", s)
    return out


def _backward_sources(label: str, s) -> list[tuple[str, str]]:
    """The recurrent and the chunkwise backward kernels of a causal state's scan structure (the same decay,
    corrections, writes, readouts and sizes, as the C backward builds them for it)."""
    if not isinstance(s, c_scan.Structure) or not s.causal:
        return []
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(c_grad_kernels.Structure)
              if f.name not in ("read_scales", "sources", "scaled", "normalized", "norm_eps")}
    out = [(f"{label} recurrent backward", c_grad_kernels.render(c_grad_kernels.Structure(**fields))),
           (f"{label} chunkwise backward", c_grad_chunk_kernels.render(c_grad_chunk_kernels.Structure(**fields)))]
    # (and with the key-side slots factored: all on the first slot's vector, each u and κ scaled; the recurrent
    # kernel takes them so only with corrections)
    slots = 2 * s.corrections + s.writes
    factored = dict(sources=(0,) * slots, scaled=tuple(i >= 2 * s.corrections or i % 2 == 0 for i in range(slots)))
    if slots:
        out.append((f"{label} chunkwise backward, factored",
                    c_grad_chunk_kernels.render(c_grad_chunk_kernels.Structure(**fields, **factored))))
    if s.corrections:
        out.append((f"{label} recurrent backward, factored",
                    c_grad_kernels.render(c_grad_kernels.Structure(**fields, **factored))))
        # (and normalizing the slots' vector and the queries itself, c.normalized_rows: one buffer each)
        plain = c_grad_kernels.Structure(**fields, **factored)
        kinds = ["decay"] * (s.decay != "none") + ["key", "key"] * s.corrections + ["key", "value"] * s.writes + \
            ["query"] * len(s.before) + ["scale"] * sum(plain.scaled)
        normalized = tuple({"key": 0, "query": 1}.get(k, -1) for k in kinds)
        eps = (1e-6, 0.5) if s.before else (1e-6,)
        out.append((f"{label} recurrent backward, factored and normalized", c_grad_kernels.render(
            c_grad_kernels.Structure(**fields, **factored, normalized=normalized, norm_eps=eps))))
    return out


def test_the_kernels_compile_without_warnings(tmp_path):
    sources = list({source: (label, source) for label, source in _kernel_sources()}.values())  # (each text once)
    assert len(sources) > 60

    def compile_one(item):
        label, source = item
        path = tmp_path / (label.replace(" ", "_") + ".c")
        path.write_text(source, encoding="utf-8")
        # (linrec's flags, then -O1: the warnings of the optimizer's analyses — uninitialized values, bounds —
        # run from -O1 on, and the sources compile several times faster than at -O3, a minute of the suite)
        res = subprocess.run([c_build.compiler(), *c_build.flags(), "-O1", "-Wall", "-Wextra", "-Werror", "-c",
                              str(path), "-o", os.devnull], capture_output=True, text=True, timeout=300)
        return label, res.returncode, res.stderr

    with ThreadPoolExecutor(2) as pool:
        failed = [(label, err) for label, rc, err in pool.map(compile_one, sources) if rc != 0]
    assert not failed, "\n\n".join(f"{label}:\n{err[-2000:]}" for label, err in failed[:3])
