"""`linrec bench FILE`: time every form on every backend against the machine's own limits, measured in the run.

For B = 1, H = 8 and dk = dv = 64 (only the dimensions the file declares; `--dim` overrides), float32,
T ∈ {1024, 4096, 16384, 32768} (`--quick`: {256, 1024}, fewer repeats) it reports per form × backend

* the median wall time of `Recurrence.run` over repeats, after one warm-up call (the warm-up builds or
  loads a compiled kernel; the API's input checks and any repacking inside a kernel are counted);
* tokens/s and GFLOP/s of *useful* flops (`flop_count`: the least the recurrent form must do per token and
  head — 2·dk·dv per rank-one update (terms that share their left vector, such as the delta rule's
  correction and write, are one update), 2·dk·dv per correction product wᵀS, 2·dk·dv per readout q·S, and
  nothing for a diagonal or scalar decay, which is applied lazily as a running scale on the keys and
  queries; a vector state counts its size instead of dk·dv). That is the issue's ~4·dk·dv for GLA and
  ~6·dk·dv for the delta rules, the same count for every form, so a form that does more arithmetic
  (parallel, chunkwise) is not credited for it;
* the bound: the time those useful flops take at the cores' float32 multiply-add peak, measured in the same
  run with the same thread count (linrec.machine.fma_peak) at its start and at its end, the higher of the two,
  and the row's fraction of it (bound time / time);
* as an extra column, the fraction of a plain float32 NumPy matmul (2048³, median of repeats) timed in the
  same run in a subprocess with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (and, when the environment sets
  them, also as given: the "pinned" figure), with the BLAS kernel that ran (threadpoolctl, when installed) —
  a figure that moves with the OpenBLAS build NumPy ships, hence not the bound;
* the decode step (one token of one layer, from a prefilled state) in µs per call: bound to its arrays
  (`Recurrence.bind_step`) and through `Recurrence.step(inplace=True, out=…)`, against its own bound: the
  state bytes a step reads and writes (2 · B · H · Σ state sizes · 4) at the memory bandwidth measured in
  the same run (STREAM's triad over arrays larger than the last-level cache, linrec.machine.triad);
* the state bytes of one layer (in the state's dtype) against the float32 KV cache of softmax attention with
  the program's key and value sizes at each T (key_value_sizes; a program that reads the sequence keeps it);
* what `--form auto` picks for each T and backend and why (and whether it was the fastest measured);
* for compiled backends: the first build of the kernel (a fresh process with an empty cache) and a cached
  load (a fresh process with the same LINREC_CACHE_DIR).

The thread count goes to the C backend through LINREC_NUM_THREADS and to NumPy's BLAS through
threadpoolctl (when installed) and OPENBLAS_NUM_THREADS (in the subprocesses).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numpy as np

from . import api, arrays, compiler, form_choice, machine, registry
from .c import build as c_build
from .compiler import ir
from .compiler.analysis import inline_lets, to_text, walk
from .compiler.builtins import SEQUENCE
from .compiler.linearity import split_scalar
from .decode import reads_the_sequence
from .dim_option import dims_with_overrides
from .dsl.errors import LinrecError

DEFAULT_TOKENS = (1024, 4096, 16384, 32768)
QUICK_TOKENS = (256, 1024)
BATCH, HEADS = 1, 8
BENCH_DIMS = {"dk": 64, "dv": 64}     # applied only to dimensions the file declares
# Not run above these T (unless --no-limits): the parallel form does T² work per head on every backend
# (NumPy ~12 s at T = 4096, 8 heads, d = 64; C ~33 s at T = 32768) and the NumPy recurrent form pays
# interpreter overhead per token.
MAX_TOKENS = {("numpy", "recurrent"): 4096, ("numpy", "parallel"): 4096, ("*", "parallel"): 4096}
SGEMM_N = 2048
PINNING_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
REPEATS, QUICK_REPEATS = 7, 3
BUDGET_S, QUICK_BUDGET_S = 10.0, 2.0   # stop repeating a row once its timed calls took this long
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # holds dsl/, compiler/ and backends/


def max_tokens(form: str, backend: str) -> int | None:
    """The largest T a form runs at on a backend unless --no-limits (None: no limit)."""
    return MAX_TOKENS.get((backend, form), MAX_TOKENS.get(("*", form)))


@dataclass
class Options:
    file: str
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    forms: list[str] | None = None          # None: every form the program has; may include "auto"
    backends: list[str] | None = None       # None: every backend
    threads: int | None = None              # None: LINREC_NUM_THREADS, else every core
    repeats: int | None = None
    budget_s: float | None = None
    quick: bool = False
    dims: dict[str, int] = field(default_factory=dict)
    plot: str | None = None
    limits: bool = True                     # False: run every form at every T (see MAX_TOKENS)
    shapes: str | None = None               # "model": the grid of linrec.bench_shapes instead; "serving":
                                            # linrec.bench_serving's slot-pool step and packed prefill
    grid_dims: list[tuple[int, int]] | None = None  # --shapes model/serving: only these (dk, dv) …
    heads: list[int] | None = None          # … these H …
    batches: list[int] | None = None        # … these B (T: `tokens`, when given; serving: sequences packed)
    decode: bool = True                     # --shapes model/serving: also the decode steps
    requests: list[int] | None = None       # --shapes serving: the decode step's N active requests …
    pool: int | None = None                 # … in a pool of this many slots
    state_dtype: str | None = None          # "bfloat16": the decode rows keep the state in bfloat16 (2 bytes)


# ---- what is counted ----------------------------------------------------------------------------------
def flop_count(rec, dims: dict[str, int]) -> tuple[int, str, list[str]]:
    """Useful flops per token and head, derived from the program's transitions and readouts:
    (number, formula like "4·dk·dv", one line per state saying where the terms come from)."""
    program, decomposition = rec.program, rec.decomposition
    total, formula, lines = 0, [], []
    for tr in decomposition.transitions:
        state = program.state(tr.state)
        n = prod(dims[d] for d in state.shape)
        size = "·".join(state.shape) or "1"
        terms: list[tuple[str, int]] = []
        if tr.decay is not None and len(state.shape) == 1:
            terms.append(("decay", 1))  # a matrix state's decay is a running scale: no per-element work
        for _ in tr.corrections:
            terms.append(("correction wᵀS", 2))
        for _ in tr.value_corrections:
            terms.append(("correction S·a", 2))
        # rank-one updates, one per left vector: u⊗p of a correction and key⊗value of a write that share it
        # are one update S += x⊗(Σ y)
        lefts = {split_scalar(u)[1]: "correction" for u, _w in tr.corrections}
        terms += [("rank-one update", 2)] * len(tr.value_corrections)  # (S·a)⊗b: its own left vector
        plain = 0
        for key, value in tr.writes:
            if value is None and len(state.shape) == 1:
                plain += 1  # z += k: one add per element
            else:
                lefts.setdefault(split_scalar(key)[1], "write")
        terms += [("rank-one update", 2)] * len(lefts) + [("write", 1)] * plain
        for r in decomposition.readouts:
            if r.state == tr.state and not r.is_value:  # (a state read as it is costs no flop)
                terms.append(("readout", 2))
        coef = sum(c for _, c in terms)
        total += coef * n
        formula.append(f"{coef}·{size}" if size != "1" else str(coef))
        lines.append(f"{tr.state}[{', '.join(state.shape)}]: " + " + ".join(f"{name} {c}" for name, c in terms)
                     + f" = {coef}·{size}")
    return total, " + ".join(formula) or "0", lines


def state_bytes(rec, dims: dict[str, int], heads: int = HEADS, itemsize: int = 4) -> int:
    """One layer's recurrent state (B = 1): H · Σ state sizes · itemsize."""
    return heads * sum(prod(dims[d] for d in s.shape) for s in rec.program.states) * itemsize


def key_value_sizes(rec, dims: dict[str, int]) -> tuple[int, ...] | None:
    """The per-token sizes of a softmax KV cache in the program's place. A program that reads the sequence keeps
    what it reads through seq(…) and lsh_attention, each distinct vector once (softmax: seq(k), seq(v); Reformer:
    q, its key too, and v): its own cache. A program with states is held against the softmax attention of its
    head sizes: by the field's convention its inputs k and v (Performer's S[m, dv] is fed by φ(k) of k[dk], and
    softmax attention in its place keeps k), else its first matrix state's [key, value] shape (Mamba's S[dk, dv],
    fed by B and x). None when neither applies (the KV cache is then not compared)."""
    program = rec.program
    if reads_the_sequence(rec):
        kept = {to_text(a): a for o in program.outputs for n in walk(inline_lets(o.value, program.lets))
                if isinstance(n, ir.Apply) and n.function in SEQUENCE for a in n.args}
        return tuple(prod(dims[d] for d in a.shape) for a in kept.values()) or None
    vectors = {x.name: dims[x.shape[0]] for x in program.inputs if len(x.shape) == 1}
    if "k" in vectors and "v" in vectors:
        return vectors["k"], vectors["v"]
    matrix = next((s for s in program.states if len(s.shape) == 2), None)
    return None if matrix is None else (dims[matrix.shape[0]], dims[matrix.shape[1]])


def kv_cache_bytes(tokens: int, sizes: tuple[int, ...], heads: int = HEADS, itemsize: int = 4) -> int:
    """Softmax attention's KV cache for one layer (B = 1) keeping vectors of `sizes` per token (key_value_sizes):
    T · H · (key size + value size) · itemsize."""
    return tokens * heads * sum(sizes) * itemsize


# ---- subprocess helpers -------------------------------------------------------------------------------
def _env(threads: int, **changes) -> dict[str, str]:
    env = dict(os.environ)
    env["LINREC_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (os.pathsep + path if path else "")
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _python(script: str, args: list[str], env: dict[str, str], timeout: float = 900) -> dict:
    try:
        res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    if res.returncode != 0:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        return {"error": f"exit status {res.returncode}: {tail}"}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unreadable output: {res.stdout[-200:]!r}"}


_SGEMM_SCRIPT = r"""
import json, sys, time
import numpy as np
n, repeats, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    import threadpoolctl
except ImportError:
    threadpoolctl = None
limit = threadpoolctl.threadpool_limits(limits=threads, user_api="blas") if threadpoolctl else None
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
c = np.empty((n, n), np.float32)
np.matmul(a, b, out=c)
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    np.matmul(a, b, out=c)
    times.append(time.perf_counter() - t0)
info = threadpoolctl.threadpool_info() if threadpoolctl else None
print(json.dumps({"times": times, "blas": info, "numpy": np.__version__}))
"""

_LOAD_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import linrec
t1 = time.perf_counter()
path, backend, dims, heads, form = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rec = linrec.load(path)
t2 = time.perf_counter()
x = rec.random_inputs(batch=1, tokens=1, heads=heads, dims=dims, dtype=np.float32, seed=0)
try:
    from linrec.c import build as c_build
    entries = lambda: c_build.cache_info()["entries"]
except Exception:
    entries = lambda: None
before = entries()
t3 = time.perf_counter()
rec.run(x, form=form, backend=backend)
t4 = time.perf_counter()
after = entries()
rec.run(x, form=form, backend=backend)
t5 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "dsl_compile_s": t2 - t1, "first_call_s": t4 - t3,
                  "second_call_s": t5 - t4, "built": None if before is None else after != before}))
"""


def sgemm_reference(threads: int, repeats: int, pinned: bool = False, n: int = SGEMM_N) -> dict:
    """A float32 n×n @ n×n matmul in a fresh process: median ms, GFLOP/s, the BLAS that ran. pinned=False
    unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (the library picks its kernel for this CPU); pinned=True
    keeps the environment as given."""
    env = _env(threads, **({} if pinned else {k: None for k in PINNING_VARIABLES}))
    out = _python(_SGEMM_SCRIPT, [str(n), str(repeats), str(threads)], env)
    if "error" in out:
        return {"n": n, "error": out["error"], "gflops": None}
    ms = statistics.median(out["times"]) * 1e3
    env_note = {k: (os.environ.get(k) if pinned else None) for k in PINNING_VARIABLES}
    best = min(out["times"]) * 1e3
    return {"n": n, "ms": ms, "gflops": 2 * n ** 3 / (ms * 1e6), "best_gflops": 2 * n ** 3 / (best * 1e6),
            "repeats": len(out["times"]), "threads": threads,
            "blas": out["blas"], "numpy": out["numpy"], "env": env_note}


def blas_summary(info) -> str:
    if not info:
        return "BLAS kernel unknown (install threadpoolctl: pip install 'linrec[bench]')"
    parts = []
    for lib in info:
        if lib.get("user_api") != "blas":
            continue
        name = f"{lib.get('internal_api', '?')} {lib.get('version') or ''}".strip()
        parts.append(f"{name}, {lib.get('architecture') or '?'} kernel, {lib.get('num_threads')} thread(s)")
    return "; ".join(parts) or "no BLAS library reported"


def load_times(path: str, backend: str, dims: dict[str, int], threads: int, form: str = "recurrent") -> dict:
    """A compiled backend's first build of a form's kernel (fresh process, empty temporary cache) and cached
    load (fresh process, the cache this run uses — where the main process has just built or loaded it)."""
    absolute = str(Path(path).resolve())
    args = [absolute, backend, json.dumps(dims), str(HEADS), form]
    empty = tempfile.mkdtemp(prefix="linrec-bench-cache-")
    try:
        built = _python(_LOAD_SCRIPT, args, _env(threads, LINREC_CACHE_DIR=empty))
    finally:
        shutil.rmtree(empty, ignore_errors=True)
    cache = str(c_build.cache_dir())
    cached = _python(_LOAD_SCRIPT, args, _env(threads, LINREC_CACHE_DIR=cache))
    if cached.get("built"):  # this process had the kernel in memory only (another cache dir): now it is on disk
        cached = _python(_LOAD_SCRIPT, args, _env(threads, LINREC_CACHE_DIR=cache))
    return {"build": built, "cached": cached, "cache_dir": cache}


# ---- timing in this process ---------------------------------------------------------------------------
def timed(fn, repeats: int, budget_s: float) -> list[float]:
    """The seconds of each of `repeats` calls of fn, fewer once they took `budget_s` (at least one)."""
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return times


def decode_step_us(rec, backend: str, dims: dict[str, int], quick: bool, batch: int = BATCH,
                   heads: int = HEADS, state_dtype: str | None = None) -> dict:
    """One token of one layer (`batch` requests, `heads` heads) from a prefilled state, in the two decode loops
    the README shows (step_timings). state_dtype="bfloat16": the state kept in bfloat16 between the calls."""
    x = rec.random_inputs(batch=batch, tokens=17, heads=heads, dims=dims, dtype=np.float32, seed=1)
    token = {k: np.ascontiguousarray(v[:, -1]) for k, v in x.items()}
    # the decode loop as users write it: prefill a prompt, then step from the state it returns
    state = rec.prefill({k: v[:, :-1] for k, v in x.items()}, backend=backend, state_dtype=state_dtype).final_state
    return step_timings(rec, token, state, backend, quick, {"inplace": True, "state_dtype": state_dtype},
                        {"state_dtype": state_dtype})


def step_timings(rec, tokens: dict, state: dict, backend: str, quick: bool, step_options: dict,
                 bind_options: dict) -> dict:
    """A decode step's µs per call in the two loops users write: "us", the step bound to its arrays
    (Recurrence.bind_step(…, **bind_options): one call per token, token buffers refilled in place) and
    "step_us", Recurrence.step(…, **step_options, out=…) passed the same arrays each call; each the median
    over batches of calls (per_call_us). "first_call_ms": the first step, which builds (or loads) the kernel."""
    t0 = time.perf_counter()
    out, _ = rec.step(tokens, state, backend=backend, **step_options)
    first_ms = (time.perf_counter() - t0) * 1e3
    bound = rec.bind_step(tokens, state, backend=backend, out=out, **bind_options)

    def step():
        rec.step(tokens, state, backend=backend, out=out, **step_options)

    result = {"first_call_ms": first_ms, "batches": call_batches(quick)}
    result["us"], result["calls_per_batch"] = per_call_us(bound, quick)
    result["step_us"], result["step_calls_per_batch"] = per_call_us(step, quick)
    return result


def no_decode_note(rec) -> str | None:
    """Why a program has no decode step to time (None when it has one): one that reads the sequence carries
    a KV cache, a non-causal one has no step."""
    name = rec.program.name
    if reads_the_sequence(rec):
        return (f"'{name}' reads the sequence directly: its decode step carries a KV cache whose cost grows "
                f"with T — not timed here")
    if not rec.program.causal:
        return f"'{name}' is non-causal: it has no decode step"
    return None


def last_level_cache(limits: dict) -> int | None:
    """The largest cache machine_limits found (bytes), or None."""
    caches = limits.get("caches")
    return max(caches.values(), default=None) if isinstance(caches, dict) else None


def call_batches(quick: bool) -> int:
    """How many batches of calls per_call_us takes the median of."""
    return 5 if quick else 21


def per_call_us(fn, quick: bool) -> tuple[float, int]:
    """µs per call of fn (a decode step: microseconds to milliseconds), and the calls per batch: the median
    over batches of calls, each batch long enough to dwarf the timer, after a warm-up of at least 10 ms of
    calls (helper threads started, states in cache: a decode loop's steady state)."""
    def seconds(n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t

    target = 0.002 if quick else 0.005
    n, spent = 1, 0.0
    while n < 1 << 20:
        took = seconds(n)
        spent += took
        if took >= target and spent >= 0.01:
            break
        n *= 2
    per_call = [seconds(n) / n for _ in range(call_batches(quick))]
    return statistics.median(per_call) * 1e6, n


def input_check_ms(program, inputs: dict) -> dict[str, float]:
    """What Recurrence.run spends validating the inputs before any form runs, in ms (median of 3 calls):
    "arrays" (names, shapes, dtypes: every call) and "ranges" (a NumPy scan for the declared value ranges:
    only for forms whose kernel does not test them as it reads — the C recurrent kernel does)."""
    def median_ms(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3
    return {"arrays": median_ms(lambda: arrays.check_inputs(program, inputs, ranges=False)),
            "ranges": median_ms(lambda: arrays.check_ranges(program, inputs))}


@contextmanager
def thread_settings(threads: int):
    """The thread count for the C kernels (c_build.threads) and NumPy's BLAS (threadpoolctl)."""
    with ExitStack() as stack:
        stack.enter_context(c_build.threads(threads))
        try:
            import threadpoolctl
            stack.enter_context(threadpoolctl.threadpool_limits(limits=threads, user_api="blas"))
            limited = True
        except ImportError:
            limited = False
        yield limited


def default_threads() -> tuple[int, str]:
    """The C kernels' thread count when --threads is not given, and where it comes from."""
    source = "LINREC_NUM_THREADS" if os.environ.get("LINREC_NUM_THREADS", "").strip() else "every core"
    return c_build.num_threads(), source


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_ticks() -> tuple[float, int, int] | None:
    """(wall time, busy ticks of the whole machine, ticks of this process and its finished children) from
    /proc: the difference between two readings tells how much CPU other processes took meanwhile."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = sum(fields[:8]) - fields[3] - fields[4]  # everything but idle and iowait
        with open("/proc/self/stat", encoding="ascii") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = sum(int(v) for v in own[11:15])  # utime, stime, cutime, cstime
        return time.time(), busy, mine
    except (OSError, ValueError, IndexError):
        return None


def others_cores(start, end) -> float | None:
    """Average number of cores other processes kept busy between two cpu_ticks() readings."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / hz / (end[0] - start[0]))


def _blas_in_process():
    try:
        import threadpoolctl
    except ImportError:
        return None
    return threadpoolctl.threadpool_info()


def cpu_name() -> str:
    return c_build.cpu_model() or platform.machine()


# ---- what a run measures ------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one run measures, resolved from its Options and the program."""
    dims: dict[str, int]
    tokens: list[int]                       # sorted, each once
    threads: int
    threads_from: str                       # "--threads", "LINREC_NUM_THREADS" or "every core"
    repeats: int
    budget_s: float
    backends: list[str]
    combos: list[tuple[str, str, int]]      # (form, backend, T) to time, in the order they are timed
    auto: list[dict]                        # what --form auto picks for each backend and T, and why
    skipped: list[dict]                     # what is not timed, and why


def require_param_defaults(program) -> None:
    """The benchmark generates its inputs and takes every param at its default: a param without one is an
    error."""
    missing = [p.name for p in program.params if p.default is None]
    if missing:
        raise LinrecError(f"param(s) {', '.join(missing)} have no default: the benchmark needs a program whose "
                          f"params all have defaults")


def forms_asked(rec, opts: Options) -> tuple[list[str], bool, list[dict]]:
    """The forms to time (those asked for, default every form the program has; an unknown name is an error),
    whether `auto` was asked for, and a skipped entry for each the program has not."""
    wanted = list(dict.fromkeys(opts.forms or list(rec.forms)))
    forms = [f for f in wanted if f != "auto"]
    for f in forms:
        if f not in compiler.FORMS:
            raise LinrecError(f"unknown form '{f}'; choose one of {', '.join(compiler.FORMS)} or auto")
    why_not = {f: rec.decomposition.why_not(f) for f in forms}
    skipped = [{"form": f, "backend": None, "T": None, "reason": f"'{rec.program.name}' has no {f} form: {why_not[f]}"}
               for f in forms if why_not[f]]
    return [f for f in forms if not why_not[f]], "auto" in wanted, skipped


def above_limit(form: str, backend: str, tokens: int, limit: int) -> dict:
    """The skipped entry of a form not run at this T (see MAX_TOKENS), with the reason and how to run it."""
    why = "T² work per head" if form == "parallel" else "interpreter overhead per token"
    return {"form": form, "backend": backend, "T": tokens,
            "reason": f"{'NumPy' if backend == 'numpy' else backend.upper()} {form} form not run above "
                      f"T = {limit} ({why}; --no-limits runs it)"}


def backend_combos(rec, backend: str, forms: list[str], tokens: list[int],
                    limits: bool) -> tuple[list[tuple[str, str, int]], list[dict]]:
    """The (form, backend, T) this backend times of the forms asked for, and what it skips: a form it does
    not build (said once, not as a failure at every T) and, with limits, a T above MAX_TOKENS."""
    combos, skipped = [], []
    for f in forms:
        why = registry.refusal(rec.compiled, backend, f)
        if why:
            skipped.append({"form": f, "backend": backend, "T": None,
                            "reason": f"the {backend} backend does not build it: {why}"})
            continue
        for t in tokens:
            limit = max_tokens(f, backend) if limits else None
            if limit is not None and t > limit:
                skipped.append(above_limit(f, backend, t, limit))
            else:
                combos.append((f, backend, t))
    return combos, skipped


def _auto_choices(rec, backend: str, tokens: list[int], dims: dict[str, int]) -> list[dict]:
    """What `--form auto` (Recurrence.choose_form) picks on this backend at each T, and why."""
    choices = []
    for t in tokens:
        form, why = rec.choose_form(backend, t, heads=HEADS, batch=BATCH, dims=dims, dtype=np.float32)
        choices.append({"backend": backend, "T": t, "form": form, "why": why})
    return choices


def make_plan(rec, opts: Options) -> Plan:
    """The sizes, threads, repeats and backends of the run, the (form, backend, T) it times — ordered by T,
    then form, then backend — what `--form auto` picks (timed too when asked for) and what is skipped."""
    dims = dims_with_overrides(rec.program, opts.dims.items(), preset=BENCH_DIMS)
    require_param_defaults(rec.program)
    # (--threads above c_build.MAX_THREADS is taken as that many, as LINREC_NUM_THREADS and threads(n) are: the
    # kernels, the FMA peak and BLAS then all run on the count the report gives)
    threads, threads_from = (min(opts.threads, c_build.MAX_THREADS), "--threads") if opts.threads is not None \
        else default_threads()
    tokens = sorted(set(opts.tokens))
    backends = list(dict.fromkeys(opts.backends or list(registry.BACKENDS)))
    forms, with_auto, skipped = forms_asked(rec, opts)
    combos, auto = [], []
    for b in backends:
        timed, not_timed = backend_combos(rec, b, forms, tokens, opts.limits)
        combos += timed
        skipped += not_timed
        nothing = form_choice.why_nothing_to_choose(rec, b)
        if nothing:  # (said once, as a form the backend does not build is; the other backends run)
            skipped += [{"form": "auto", "backend": b, "T": None, "reason": nothing}] if with_auto else []
            continue
        choices = _auto_choices(rec, b, tokens, dims)
        auto += choices
        if with_auto:
            combos += [(a["form"], b, a["T"]) for a in choices
                       if registry.builds(rec.compiled, b, a["form"]) and (a["form"], b, a["T"]) not in combos]
    # by T first: time_rows keeps one T's inputs in memory at a time
    combos.sort(key=lambda c: (c[2], list(rec.forms).index(c[0]) if c[0] in rec.forms else 99,
                               backends.index(c[1])))
    repeats = opts.repeats or (QUICK_REPEATS if opts.quick else REPEATS)
    budget_s = opts.budget_s if opts.budget_s is not None else (QUICK_BUDGET_S if opts.quick else BUDGET_S)
    return Plan(dims=dims, tokens=tokens, threads=threads, threads_from=threads_from, repeats=repeats,
                budget_s=budget_s, backends=backends, combos=combos, auto=auto, skipped=skipped)


# ---- the phases of a run ------------------------------------------------------------------------------
def _opening(opts: Options, rec, plan: Plan, flops: tuple[int, str, list[str]]) -> dict:
    """The report's first entries: what is run and how, on which machine, the useful flops, and the
    machine's state at the start (load average, the BLAS this process loaded, the C compiler's settings)."""
    total, formula, terms = flops
    return {
        "file": opts.file, "program": rec.program.name, "dtype": "float32", "batch": BATCH, "heads": HEADS,
        "dims": plan.dims, "tokens": plan.tokens, "threads": plan.threads, "threads_from": plan.threads_from,
        "repeats": plan.repeats, "budget_s": plan.budget_s, "quick": opts.quick,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "numpy": np.__version__},
        "flops_per_token_head": total, "flop_formula": formula, "flop_terms": terms,
        "load_average_start": load_average(), "blas_in_process": _blas_in_process(),
        "c": c_settings(),
    }


def c_settings() -> dict:
    """The C backend's cache directory, compiler flags and vector width (or the error that hid them)."""
    try:
        return {"cache_dir": str(c_build.cache_dir()), "flags": c_build.flags(),
                "vector_bytes": c_build.vector_bytes()}
    except Exception as err:  # noqa: BLE001 - only informational
        return {"error": str(err)}


def _no_flops_note(rec) -> str:
    return (f"'{rec.program.name}' has no recurrent state" + (" (it reads the sequence directly)"
            if reads_the_sequence(rec) else "") + ": no useful-flop count, so no GFLOP/s or fractions")


def matmul_reference(threads: int, quick: bool, say) -> dict:
    """The same-run matmul's report entries: the reference with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset
    ("sgemm"), with the environment as given ("sgemm_pinned": the same measurement when it sets neither),
    their GFLOP/s, and the BLAS that ran."""
    repeats = 3 if quick else 10
    say(f"reference: float32 matmul {SGEMM_N}³, {threads} thread(s), OPENBLAS_CORETYPE/L2_SIZE unset …")
    ref = sgemm_reference(threads, repeats)
    pinned_env = {k: os.environ[k] for k in PINNING_VARIABLES if k in os.environ}
    if pinned_env:
        say(f"reference with the environment as given ({pinned_env}) …")
        pinned = sgemm_reference(threads, repeats, pinned=True)
    else:
        pinned = dict(ref, note="the environment sets neither OPENBLAS_CORETYPE nor OPENBLAS_L2_SIZE: the same "
                                "measurement")
    return {"sgemm_gflops": ref["gflops"], "sgemm": ref, "sgemm_pinned_gflops": pinned.get("gflops"),
            "sgemm_pinned": pinned, "pinned_env": pinned_env, "blas": ref.get("blas"),
            "blas_summary": blas_summary(ref.get("blas"))}


def machine_reference(threads: int, quick: bool, say, earlier: dict | None = None) -> dict:
    """The machine's limits with the run's thread count (linrec.machine.limits): "fma_peak_gflops" (the bound
    of the prefill rows), "bandwidth_gbs" (the bound of the decode steps), "machine_limits" (the details), or
    None for each with the error in "machine_limits". With `earlier`, this function's result at the start of
    the run: measured again (at its end) and combined — each bound the higher of the two, since a busy spell
    slows a measurement and never speeds it up — with this measurement's details in "machine_limits_end"."""
    if earlier is not None and earlier["fma_peak_gflops"] is None:
        return {}
    say(f"the machine's limits: float32 multiply-add peak and memory bandwidth (triad), {threads} thread(s) …")
    try:
        limits = machine.limits(threads, quick)
    except LinrecError as err:
        if earlier is not None:
            return {"machine_limits_end": {"error": str(err)}}
        return {"fma_peak_gflops": None, "bandwidth_gbs": None, "machine_limits": {"error": str(err)}}
    if earlier is None:
        return {"fma_peak_gflops": limits["fma_peak"]["gflops"], "bandwidth_gbs": limits["triad"]["gbs"],
                "machine_limits": limits}
    return {"fma_peak_gflops": max(earlier["fma_peak_gflops"], limits["fma_peak"]["gflops"]),
            "bandwidth_gbs": max(earlier["bandwidth_gbs"], limits["triad"]["gbs"]), "machine_limits_end": limits}


def with_row_bounds(rows: list[dict], peak: float | None) -> list[dict]:
    """The rows with their bound at the multiply-add peak `peak` (GFLOP/s): "bound_ms", the time their useful
    flops take at it, and "fraction_of_bound", bound_ms / ms (None without a peak or a flop count)."""
    out = []
    for r in rows:
        bound_ms = r["gflops"] * r["ms"] / peak if peak and r["gflops"] else None
        out.append(dict(r, bound_ms=bound_ms, fraction_of_bound=bound_ms / r["ms"] if bound_ms else None))
    return out


def with_decode_bounds(decode: dict[str, dict], moved: int, gbs: float | None) -> dict[str, dict]:
    """Each backend's decode figures with their bound: `moved`, the state bytes one step reads and writes, at
    the bandwidth `gbs` (GB/s), in µs ("bound_us"), and its fraction of the bound step's µs
    ("fraction_of_bound"); None without a bandwidth."""
    bound_us = moved / (gbs * 1e3) if gbs else None
    return {b: dict(d, state_bytes_moved=moved, bound_us=bound_us,
                    fraction_of_bound=bound_us / d["us"] if bound_us else None) for b, d in decode.items()}


def cache_notes(state: int, limits: dict) -> list[str]:
    """A note when one layer's state fits in the last-level cache: a decode loop keeps it there."""
    llc = last_level_cache(limits)
    if not llc or state > llc:
        return []
    return [f"the decode step's state ({format_bytes(state)}) fits in the caches (last level {format_bytes(llc)}): a decode "
            f"loop keeps it there, so a step can beat the bound of the memory bandwidth (fractions above 100%)"]


@dataclass
class KernelLoads:
    """Each compiled backend's first build (s) and cached load (ms), both in fresh processes, the details
    (load_times, and this process's first call) and what could not be measured."""
    build_s: dict[str, float] = field(default_factory=dict)
    cached_load_ms: dict[str, float] = field(default_factory=dict)
    loads: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def load_form(rec, backend: str) -> str | None:
    """The form whose kernel the build and load are timed with: the recurrent one where the backend builds
    it (a decode loop's), else the first form it builds (a program that reads the sequence has no recurrent
    form); None when it builds none."""
    return next((f for f in rec.forms if registry.builds(rec.compiled, backend, f)), None)


def kernel_loads(rec, plan: Plan, path: str, say) -> KernelLoads:
    """For each compiled backend: a first call of a form (load_form) in this process (so this run's cache
    holds the kernel), then the first build and the cached load in fresh processes (load_times)."""
    result = KernelLoads()
    for b in plan.backends:
        if b == "numpy":
            continue
        form = load_form(rec, b)
        if form is None:
            result.notes.append(f"{b}: no kernel build or cached load measured: the {b} backend builds none of "
                                f"'{rec.program.name}''s forms")
            continue
        say(f"{b}: first build of the {form} kernel (fresh process, empty cache) and cached load (fresh process) …")
        try:
            tiny = rec.random_inputs(batch=1, tokens=1, heads=HEADS, dims=plan.dims, dtype=np.float32, seed=0)
            t0 = time.perf_counter()
            rec.run(tiny, form=form, backend=b)
            in_process = time.perf_counter() - t0
        except LinrecError as err:
            result.notes.append(f"{b}: no kernel build or cached load measured: a first {form} call of one token "
                                f"failed: {err}")
            continue
        info = load_times(path, b, plan.dims, plan.threads, form)
        info["this_process_first_call_s"], info["form"] = in_process, form
        result.loads[b] = info
        if "first_call_s" in info["build"]:
            result.build_s[b] = info["build"]["first_call_s"]
        else:
            result.notes.append(f"{b}: first-build measurement failed: {info['build'].get('error')}")
        if "first_call_s" in info["cached"]:
            result.cached_load_ms[b] = info["cached"]["first_call_s"] * 1e3
        else:
            result.notes.append(f"{b}: cached-load measurement failed: {info['cached'].get('error')}")
    return result


def row_of(form: str, backend: str, tokens: int, times: list[float], warmup_s: float, flops: int,
         sgemm: float | None, peak: float | None, batch: int = BATCH, heads: int = HEADS) -> dict:
    """One timed row: median ms, tokens/s, useful GFLOP/s; the bound (the useful flops at the multiply-add
    peak `peak`, GFLOP/s) and the row's fraction of it; the fraction of the matmul `sgemm`. Each None without
    its reference or a flop count."""
    ms = statistics.median(times) * 1e3
    total = batch * tokens * heads * flops
    gflops = total / (ms * 1e6) if flops else None
    bound_ms = total / (peak * 1e6) if peak and flops else None
    return {"form": form, "backend": backend, "T": tokens, "ms": ms,
            "tokens_per_s": batch * tokens / (ms / 1e3), "gflops": gflops,
            "bound_ms": bound_ms, "fraction_of_bound": bound_ms / ms if bound_ms else None,
            "fraction_of_sgemm": gflops / sgemm if sgemm and flops else None,
            "repeats": len(times), "min_ms": min(times) * 1e3, "warmup_s": warmup_s}


def time_rows(rec, plan: Plan, flops: int, sgemm: float | None, peak: float | None,
              say) -> tuple[list[dict], list[dict], dict]:
    """Times each (form, backend, T) of the plan: one warm-up call, then repeats within the budget. Returns
    the rows, a skipped entry for each that failed, and the input checks' ms at each T (input_check_ms)."""
    rows, failed, check_ms = [], [], {}
    x, x_tokens = None, None
    for f, b, t in plan.combos:
        if t != x_tokens:
            x = None  # freed before the next T's are made: one T's inputs at a time (T = 32768: 4 × 8 MiB)
            x = rec.random_inputs(batch=BATCH, tokens=t, heads=HEADS, dims=plan.dims, dtype=np.float32, seed=0)
            x_tokens = t
            check_ms[str(t)] = input_check_ms(rec.program, x)
        say(f"{f:<10} {b:<6} T = {t:<6} …")
        gc.collect()
        try:
            t0 = time.perf_counter()
            rec.run(x, form=f, backend=b)
            warm = time.perf_counter() - t0
            times = timed(lambda x=x, f=f, b=b: rec.run(x, form=f, backend=b), plan.repeats, plan.budget_s)
        except (LinrecError, MemoryError) as err:
            failed.append({"form": f, "backend": b, "T": t, "reason": f"failed: {err}"})
            continue
        rows.append(row_of(f, b, t, times, warm, flops, sgemm, peak))
    return rows, failed, check_ms


def decode_steps(rec, plan: Plan, quick: bool, say, state_dtype: str | None = None) -> tuple[dict[str, dict], list[str]]:
    """The decode step on each backend (decode_step_us), or the note saying why there is none: a program
    that reads the sequence carries a KV cache, a non-causal one has no step."""
    why = no_decode_note(rec)
    if why:
        return {}, [why]
    decode, notes = {}, []
    for b in plan.backends:
        say(f"{b}: decode step …")
        try:
            decode[b] = decode_step_us(rec, b, plan.dims, quick, state_dtype=state_dtype)
        except LinrecError as err:
            notes.append(f"{b}: no decode step: {err}")
    return decode, notes


def _auto_against_rows(auto: list[dict], rows: list[dict]) -> list[dict]:
    """Each auto choice with the fastest form measured at its backend and T, and whether it picked that one
    (None when its own pick was not measured)."""
    out = []
    for a in auto:
        measured = [r for r in rows if r["backend"] == a["backend"] and r["T"] == a["T"]]
        if measured:
            best = min(measured, key=lambda r: r["ms"])["form"]
            picked = best == a["form"] if any(r["form"] == a["form"] for r in measured) else None
            a = dict(a, fastest_measured=best, picked_is_fastest=picked)
        out.append(a)
    return out


def _series(rows: list[dict]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(T, ms) in order of T for each (form, backend) measured, in the order they first appear."""
    keys = dict.fromkeys((r["form"], r["backend"]) for r in rows)
    return {k: sorted((r["T"], r["ms"]) for r in rows if (r["form"], r["backend"]) == k) for k in keys}


def scaling(rows: list[dict]) -> list[dict]:
    """How time grows between consecutive T of each form and backend: ms at T_to / ms at T_from, beside
    T_to / T_from (what a linear cost would give)."""
    return [{"form": f, "backend": b, "T_from": t1, "T_to": t2, "ratio": m2 / m1, "linear": t2 / t1}
            for (f, b), series in _series(rows).items() for (t1, m1), (t2, m2) in zip(series, series[1:])]


def busy_notes(others: float | None, what: str = "these times (and the matmul reference)") -> list[str]:
    """A note when other processes kept more than a quarter of a core busy during the run."""
    if others is None or others <= 0.25:
        return []
    return [f"the machine was busy: other processes kept {others:.2f} core(s) busy on average during this run, "
            f"so {what} are pessimistic and noisy"]


# ---- the run ------------------------------------------------------------------------------------------
NO_THREADPOOLCTL = ("threadpoolctl is not installed: the NumPy backend's BLAS ran with its own thread count "
                    "(pip install 'linrec[bench]')")


def run(opts: Options, progress=None) -> dict:
    """Everything `linrec bench` reports, as plain data (the --json object): the plan, the same-run matmul,
    then, with the run's thread count, the compiled kernels' loads, the timed rows and the decode step."""
    say = progress or (lambda text: None)
    ticks = cpu_ticks()
    rec = api.load(opts.file)
    plan = make_plan(rec, opts)
    if opts.plot:
        check_plot_destination(opts.plot)  # before minutes of measurements, not after them
    report = _opening(opts, rec, plan, flop_count(rec, plan.dims))
    flops = report["flops_per_token_head"]
    notes = [] if flops else [_no_flops_note(rec)]
    report.update(matmul_reference(plan.threads, opts.quick, say))
    sgemm = report["sgemm_gflops"]
    if sgemm is None:
        notes.append(f"the matmul reference failed ({report['sgemm'].get('error')}): no fractions of it")
    report.update(machine_reference(plan.threads, opts.quick, say))
    if report["fma_peak_gflops"] is None:
        notes.append(f"the machine's limits were not measured ({report['machine_limits']['error']}): no bounds")
    with thread_settings(plan.threads) as blas_limited:
        if not blas_limited:
            notes.append(NO_THREADPOOLCTL)
        kernels = kernel_loads(rec, plan, opts.file, say)
        rows, failed, check_ms = time_rows(rec, plan, flops, sgemm, report["fma_peak_gflops"], say)
        decode, decode_notes = decode_steps(rec, plan, opts.quick, say, opts.state_dtype)
    report.update(machine_reference(plan.threads, opts.quick, say, earlier=report))
    rows = with_row_bounds(rows, report["fma_peak_gflops"])
    others = others_cores(ticks, cpu_ticks())
    # the bytes the decode rows move: a bfloat16 state's are half a float32 one's
    state = state_bytes(rec, plan.dims, itemsize=2 if opts.state_dtype == "bfloat16" else 4)
    decode = with_decode_bounds(decode, 2 * BATCH * state, report["bandwidth_gbs"])
    sizes = key_value_sizes(rec, plan.dims)
    if decode:
        decode_notes += cache_notes(BATCH * state, report["machine_limits"])
    report.update({
        "other_processes_cores": others,
        "rows": rows, "skipped": plan.skipped + failed, "auto": _auto_against_rows(plan.auto, rows),
        "scaling": scaling(rows),
        "decode_us": {b: d["us"] for b, d in decode.items()}, "decode": decode, "input_check_ms": check_ms,
        "state_bytes": state, "state_dtype": opts.state_dtype or "float32",
        "reads_the_sequence": reads_the_sequence(rec), "kv_sizes": sizes and list(sizes),
        "kv_cache_bytes": {str(t): kv_cache_bytes(t, sizes) for t in plan.tokens} if sizes else {},
        "build_s": kernels.build_s, "cached_load_ms": kernels.cached_load_ms, "loads": kernels.loads,
        "openmp_wait_policy": c_build.openmp_wait_policy(),
        "notes": notes + kernels.notes + decode_notes + busy_notes(others),
    })
    if opts.plot:
        try:
            report["plot"] = plot(report, opts.plot)
        except LinrecError as err:  # the measurements stand: the caller shows them, then this error
            report["plot_error"] = str(err)  # ("error: cannot write the plot …")
    return report


def check_plot_destination(path: str) -> None:
    """An error when the plot could not be written to `path`: its folder missing or not writable, or `path`
    a folder."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise LinrecError(f"--plot {path} is a folder: give a file name such as {target / 'bench.png'}")
    if not folder.is_dir():
        raise LinrecError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LinrecError(f"--plot {path}: the folder {folder} is not writable")
    formats = plot_formats()
    if formats is None:
        raise LinrecError(f"--plot {path}: {NO_MATPLOTLIB}, so no plot can be written; install it or leave out "
                          f"--plot")
    # (matplotlib's savefig takes the format from the extension, lower-cased; none: its default, PNG)
    extension = os.path.splitext(path)[1][1:].lower()
    if extension and extension not in formats:
        raise LinrecError(f"--plot {path}: matplotlib cannot write '.{extension}' files; use one of "
                          f"{', '.join('.' + f for f in sorted(formats))} (e.g. {Path(path).with_suffix('.png')})")


NO_MATPLOTLIB = "matplotlib is not installed (pip install 'linrec[bench]' or pip install matplotlib)"


def plot_formats() -> dict[str, str] | None:
    """The file formats matplotlib writes (extension → description), or None when it is not installed (then
    nothing is imported)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase
    return FigureCanvasBase.get_supported_filetypes()


# ---- output -------------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def percent(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def number(value, spec: str) -> str:
    """A table cell: `value` formatted, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def _opening_lines(rep: dict) -> list[str]:
    """What was run, with how many threads, and the useful flops counted."""
    dims = ", ".join(f"{k}={v}" for k, v in rep["dims"].items())
    return [(f"{rep['program']} ({rep['file']}): B={rep['batch']}, H={rep['heads']}, {dims}, {rep['dtype']}, "
             f"{rep['threads']} thread(s) (from {rep['threads_from']}; LINREC_NUM_THREADS for C, BLAS threads for "
             f"NumPy)"),
            (f"useful flops per token and head: {rep['flop_formula']} = {rep['flops_per_token_head']}  "
             f"(" + "; ".join(rep["flop_terms"]) + ")") if rep["flops_per_token_head"] else
            "useful flops: none counted (no recurrent state)"]


def _limits_lines(rep: dict) -> list[str]:
    """The machine's limits: the bounds of the rows and of the decode step."""
    lim = rep["machine_limits"]
    if rep["fma_peak_gflops"] is None:
        return [f"bounds: the machine's limits were not measured: {lim.get('error')}"]
    peak, triad = lim["fma_peak"], lim["triad"]
    llc = triad["last_level_cache_bytes"]
    end = rep.get("machine_limits_end", {})
    two = ("fma_peak" in end, "triad" in end)
    return [f"bound of the rows: float32 multiply-add peak {rep['fma_peak_gflops']:.1f} GFLOP/s ({peak['threads']} "
            f"thread(s), {peak['vector_bytes'] * 8}-bit registers, 12 independent chains per thread, best of 3"
            + (f"; the higher of {peak['gflops']:.1f} at the start of the run and {end['fma_peak']['gflops']:.1f} at "
               f"its end" if two[0] else "") + ")",
            f"bound of the decode step: memory bandwidth {rep['bandwidth_gbs']:.1f} GB/s (triad a = b + s·c over 3 × "
            f"{format_bytes(triad['array_bytes'])}, last-level cache {'unknown' if not llc else format_bytes(llc)}, "
            f"{triad['threads']} thread(s), {'non-temporal' if triad['non_temporal'] else 'plain'} stores, best of "
            f"{triad['repeats']}" + (f"; the higher of {triad['gbs']:.1f} at the start and {end['triad']['gbs']:.1f} "
                                     f"at the end" if two[1] else "") + ")"]


def _reference_lines(rep: dict) -> list[str]:
    """The matmul reference, unpinned and with the environment as given."""
    ref = rep["sgemm"]
    if not rep["sgemm_gflops"]:
        return [f"reference: matmul failed: {ref.get('error')}"]
    out = [f"reference: float32 matmul {ref['n']}×{ref['n']} @ {ref['n']}×{ref['n']}: {ref['ms']:.2f} ms, "
           f"{rep['sgemm_gflops']:.1f} GFLOP/s ({rep['blas_summary']}; OPENBLAS_CORETYPE and "
           f"OPENBLAS_L2_SIZE unset)"]
    pin = rep["sgemm_pinned"]
    if rep["pinned_env"]:
        envtext = ", ".join(f"{k}={v}" for k, v in rep["pinned_env"].items())
        out.append(f"           with the environment as given ({envtext}): "
                   + (f"{pin['gflops']:.1f} GFLOP/s ({blas_summary(pin.get('blas'))})" if pin.get("gflops")
                      else f"failed: {pin.get('error')}"))
    else:
        out.append("           (the environment sets neither OPENBLAS_CORETYPE nor OPENBLAS_L2_SIZE: that is "
                   "also the figure as given)")
    return out


def _rows_lines(rep: dict) -> list[str]:
    """The table of timed rows."""
    if not rep["rows"]:
        return ["  (no rows measured)"]
    table = [["form", "backend", "T", "ms", "tokens/s", "GFLOP/s", "bound ms", "of bound", "of matmul", "reps"]]
    for r in rep["rows"]:
        table.append([r["form"], r["backend"], str(r["T"]), f"{r['ms']:.3f}", f"{r['tokens_per_s']:.3g}",
                      "-" if r["gflops"] is None else f"{r['gflops']:.2f}",
                      "-" if r["bound_ms"] is None else f"{r['bound_ms']:.3f}", percent(r["fraction_of_bound"]),
                      percent(r["fraction_of_sgemm"]), str(r["repeats"])])
    return table_lines(table, {2, 3, 4, 5, 6, 7, 8, 9}) + [
        "  (ms: median of Recurrence.run after a warm-up call, input checks included; bound: the useful flops at "
        "the multiply-add peak; of matmul: GFLOP/s over the matmul's)"]


def _skipped_lines(rep: dict) -> list[str]:
    """What was not measured, and why; a form skipped above a T limit once, with the T it skipped."""
    if not rep["skipped"]:
        return []
    out, seen = ["not measured:"], set()
    for s in rep["skipped"]:
        key = (s["form"], s["backend"], s["reason"])
        if s["T"] is not None and "not run above" in s["reason"]:
            if key in seen:
                continue
            seen.add(key)
            ts = [x["T"] for x in rep["skipped"] if (x["form"], x["backend"], x["reason"]) == key]
            out.append(f"  {s['backend']} {s['form']}: {s['reason']} (skipped T = {', '.join(map(str, ts))})")
        else:
            where = " ".join(str(v) for v in (s["backend"], s["form"], s["T"] and f"T={s['T']}") if v)
            out.append(f"  {where}: {s['reason']}")
    return out


def _scaling_lines(rep: dict) -> list[str]:
    """How time grows from T to 2T (only for sizes that double)."""
    doubled = [s for s in rep["scaling"] if s["linear"] == 2]
    if not doubled:
        return []
    return ["scaling (ms at 2T / ms at T; linear = 2.00):"] + [
        f"  {s['form']} ({s['backend']}) T {s['T_from']} → {s['T_to']}: {s['ratio']:.2f}" for s in doubled]


def _input_check_lines(rep: dict) -> list[str]:
    checks = rep.get("input_check_ms")
    if not checks:
        return []
    return ["input checks inside Recurrence.run: shapes and dtypes "
            + ", ".join(f"T={t} {ms['arrays']:.2f} ms" for t, ms in checks.items())
            + "; declared ranges (a NumPy scan, skipped where the kernel tests them as it reads: C "
            "recurrent) " + ", ".join(f"T={t} {ms['ranges']:.2f} ms" for t, ms in checks.items())]


def _decode_lines(rep: dict) -> list[str]:
    if not rep["decode_us"]:
        return []
    out = [f"decode step, one token, B={rep['batch']}, H={rep['heads']}, per call from Python — bound to its arrays "
           "(Recurrence.bind_step): " + ", ".join(f"{b} {us:.2f} µs" for b, us in rep["decode_us"].items())
           + "; Recurrence.step(inplace=True, out=…), the same arrays each call: "
           + ", ".join(f"{b} {d['step_us']:.2f} µs" for b, d in rep["decode"].items())]
    first = next(iter(rep["decode"].values()))
    if first.get("bound_us"):
        out.append(f"  bound: the {first['state_bytes_moved']} state bytes a step reads and writes at "
                   f"{rep['bandwidth_gbs']:.1f} GB/s = {first['bound_us']:.2f} µs; of bound (bound_step): "
                   + ", ".join(f"{b} {percent(d['fraction_of_bound'])}" for b, d in rep["decode"].items()))
    return out


def _memory_line(rep: dict) -> str:
    """One layer's memory (B = 1): the recurrent state in its dtype against softmax attention's float32 KV cache
    of the same key and value sizes; a program that reads the sequence keeps that cache itself."""
    sizes = rep.get("kv_sizes")
    cache = (f"T·H·({' + '.join(map(str, sizes))})·4 (float32): "
             + ", ".join(f"T={t} {format_bytes(n)}" for t, n in rep["kv_cache_bytes"].items())) if sizes else None
    if rep.get("reads_the_sequence"):
        return (f"memory per layer (B=1): no recurrent state — '{rep['program']}' reads the sequence, so it keeps the "
                f"keys and values of every token, a KV cache " + (cache or "of a size not given here: it reads no "
                                                                    "per-token vector through seq or lsh_attention"))
    unknown = "the key and value sizes are unknown (no inputs k and v, no matrix state)"
    state = (f"memory per layer (B=1): state {format_bytes(rep['state_bytes'])} ({rep['state_bytes']} B, "
             f"{rep.get('state_dtype', 'float32')})")
    return state + (f" vs softmax KV cache {cache}" if cache else f"; no softmax KV cache to compare: {unknown}")


def _auto_lines(rep: dict) -> list[str]:
    """What --form auto picked at each backend and T, and how that compares with the fastest measured."""
    if not rep["auto"]:
        return []
    out = ["form auto (Recurrence.choose_form):"]
    for a in rep["auto"]:
        extra = ""
        if a.get("fastest_measured"):
            verdict = {True: "the fastest measured", False: f"fastest measured: {a['fastest_measured']}",
                       None: f"not measured; fastest measured: {a['fastest_measured']}"}[a["picked_is_fastest"]]
            extra = f"  [{verdict}]"
        out.append(f"  {a['backend']:<6} T={a['T']:<6} → {a['form']}: {a['why']}{extra}")
    return out


def _kernel_lines(rep: dict) -> list[str]:
    """Each compiled backend's first build and cached load."""
    out = []
    for b in rep["loads"]:
        bs, cl = rep["build_s"].get(b), rep["cached_load_ms"].get(b)
        out.append(f"{b} kernel: first build {'-' if bs is None else f'{bs:.2f} s'} (fresh process, empty cache), "
                   f"cached load {'-' if cl is None else f'{cl:.1f} ms'} (fresh process, cache "
                   f"{rep['loads'][b]['cache_dir']}); first call of the {rep['loads'][b].get('form', 'recurrent')} form at "
                   f"this size, DSL compile "
                   f"not included")
    return out


def format_report(rep: dict) -> str:
    """The human-readable report of `linrec bench`: the run's settings and reference, the table of rows,
    then one section for each of the other measurements, the notes and the plot."""
    out = _opening_lines(rep) + _limits_lines(rep) + _reference_lines(rep) + [""] + _rows_lines(rep)
    out += _skipped_lines(rep)
    out += _scaling_lines(rep) + _input_check_lines(rep) + _decode_lines(rep) + [_memory_line(rep)]
    out += _auto_lines(rep) + _kernel_lines(rep) + [f"note: {n}" for n in rep["notes"]]
    if rep.get("plot"):
        out.append(rep["plot"])
    return "\n".join(out)


def plot(rep: dict, path: str) -> str:
    """A log-log plot of time against T per form and backend (with the recurrent-form bound), or a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"note: matplotlib is not installed, so no plot was written to {path} "
                f"(pip install 'linrec[bench]' or pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(7, 5))
    for (f, b), series in _series(rep["rows"]).items():
        ax.plot([s[0] for s in series], [s[1] for s in series], marker="o", label=f"{f} ({b})")
    if rep["fma_peak_gflops"] and rep["tokens"] and rep["flops_per_token_head"]:
        ts, peak = rep["tokens"], rep["fma_peak_gflops"]
        bound = [rep["batch"] * t * rep["heads"] * rep["flops_per_token_head"] / (peak * 1e6) for t in ts]
        ax.plot(ts, bound, "k--", label=f"bound: useful flops at the multiply-add peak {peak:.0f} GFLOP/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("ms (median)")
    dims = ", ".join(f"{k}={v}" for k, v in rep["dims"].items())
    ax.set_title(f"{rep['program']}: B={rep['batch']}, H={rep['heads']}, {dims}, float32, {rep['threads']} thread(s)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        plt.close(fig)
        raise LinrecError(f"cannot write the plot {path}: {err.strerror or err}") from None
    plt.close(fig)
    return f"plot: {path}"
