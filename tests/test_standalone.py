"""`linrec emit --standalone` (backends/c/standalone.py): NAME.h and NAME.c compiled by plain gcc — no Python,
NumPy or cffi header on the include path — with a C driver this test writes from the header's argument lists
(it reads every array from a binary file, calls one entry point, writes back the arrays it writes), and every
entry point compared with the NumPy recurrent form, the definition:

    prefill            outputs and final states
    prefill_snapshots  the same, checkpoint j = the state after (j + 1)·C tokens, the last K states
    step               one token of every batch row
    step_slots         one token of N requests in a pool of P slots; the other slots bit for bit untouched

in float64 (max|x − ref| / max|ref| ≤ 1e-12) and float32 (≤ 1e-5, against the float64 reference on the
float32-rounded arrays). Programs: GLA, Gated DeltaNet, Mamba-2 and RetNet (per-head params), Performer
(stabilized states carried with their log-scales), a statement-by-statement program with a per-head param
matrix, names from the kernels' own vocabulary and non-ASCII ones, `*/` in its file name and comments, and
a non-causal one (prefill only). Every array sits 8 bytes past malloc's alignment. Each
program is built once per session (-O1, GLA at -O2), with -Wall -Wextra -Werror; bad arguments come back as error codes with
nothing written.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import linrec
from linrec.c import standalone
from linrec.compiler.identifiers import exported_identifier
from linrec.cli import main
from linrec.dsl.errors import LinrecError
from compare import rel_err

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None, reason="needs gcc")
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
SUFFIX = {np.float64: "f64", np.float32: "f32"}
B, T, H = 2, 11, 3          # prefill: batch rows, tokens, heads
EVERY, KEEP = 4, 4          # checkpoints after 4 and 8 tokens; the states after tokens 8 … 11
SLOTS = [3, 0, 4]           # three requests in a pool of five slots
POOL = 5

# Mamba-1's selective scan (a decay per element of the state: the statement-by-statement kernel), its names
# those of the kernels' own vocabulary (vec, VW, lr_forward, LR_BLOCK) and non-ASCII, `*/` in its comments
SELECTIVE = """\
# Mamba-1's selective scan */ int injected;
recurrence selective(dk = 5, dv = 7)
input vec[dv], Bσ[dk], lr_forward[dk]
input VW[dv] in (0, 1)
param A[dk] per head = −exp(randn(std=0.5, seed=3))
state Σ[dk, dv]
Σ = exp(A⊗VW) * Σ + Bσ⊗(VW*vec)   # */ int injected2; /*
output LR_BLOCK = lr_forward·Σ
"""
ENCODER = """\
recurrence encoder(dk = 4, dv = 6) noncausal
input q[dk], k[dk], v[dv]
input g <= 0
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = q·S
"""
PROGRAMS = {  # name → (source, file name, sizes)
    "gla": (None, "gla.lin", {}),
    "gated_deltanet": (None, "gated_deltanet.lin", {}),
    "mamba2": (None, "mamba2.lin", {}),
    "retnet": (None, "retnet.lin", {}),
    "performer": (None, "performer.lin", {"m": 24}),
    "selective": (SELECTIVE, "sel */ int x; /*.lin", {}),
    "encoder": (ENCODER, "encoder.lin", {}),
}
# the headers NAME.c and NAME.h may include: the C library's, POSIX threads, OpenMP, x86 intrinsics
ALLOWED_INCLUDES = {"math.h", "stdint.h", "stdlib.h", "string.h", "limits.h", "omp.h", "immintrin.h",
                    "stdatomic.h", "pthread.h", "sched.h", "signal.h", "sys/resource.h", "time.h", "unistd.h"}


def recurrence(name):
    source, filename, _ = PROGRAMS[name]
    return linrec.compile(source, filename) if source else linrec.load(EXAMPLES / filename)


CAUSAL = [name for name in PROGRAMS if recurrence(name).program.causal]  # (the others have no decode step)


def driver_source(sa: standalone.Standalone) -> str:
    """main(argv): FUNCTION DIR INTEGERS…; each array from DIR/NAME.bin (NULL when absent), the integers in
    the order of the function's integer arguments; the arrays it writes to DIR/NAME.out; prints the code."""
    lines = ['#include <stdio.h>', '#include <stdlib.h>', '#include <string.h>', f'#include "{sa.prefix}.h"', "",
             "static void *load(const char *dir, const char *name, long *bytes)", "{",
             "    char path[4096];", '    snprintf(path, sizeof path, "%s/%s.bin", dir, name);',
             '    FILE *f = fopen(path, "rb");', "    if (!f) return NULL;",
             "    fseek(f, 0, SEEK_END);", "    *bytes = ftell(f);", "    fseek(f, 0, SEEK_SET);",
             "    /* 8 bytes past malloc's alignment: the ABI asks for none beyond the element's (never freed) */",
             "    char *p = (char *)malloc((size_t)*bytes + 16) + 8;",
             "    if (fread(p, 1, (size_t)*bytes, f) != (size_t)*bytes) exit(90);", "    fclose(f);",
             "    return p;", "}", "",
             "static void save(const char *dir, const char *name, const void *p, long bytes)", "{",
             "    if (!p) return;", "    char path[4096];", '    snprintf(path, sizeof path, "%s/%s.out", dir, name);',
             '    FILE *f = fopen(path, "wb");', "    if (!f || fwrite(p, 1, (size_t)bytes, f) != (size_t)bytes) exit(91);",
             "    fclose(f);", "}", "",
             "int main(int argc, char **argv)", "{",
             "    if (argc < 3) return 92;", "    const char *fn = argv[1], *dir = argv[2];",
             "    int next = 3, rc = -100;"]
    for f in sa.all_functions():
        lines.append(f'    if (!strcmp(fn, "{f.name}")) {{')
        values = []
        for a in f.arguments:
            if a.kind in ("array", "slots"):
                ctype = "int64_t" if a.kind == "slots" else f.ctype
                lines += [f"        long bytes_{a.name} = 0;",
                          f'        {ctype} *{a.name} = load(dir, "{a.name}", &bytes_{a.name});']
            else:
                lines.append(f"        {'int64_t' if a.kind == 'int64' else 'int'} {a.name} = "
                             f"next < argc ? ({'int64_t' if a.kind == 'int64' else 'int'})atoll(argv[next++]) : 0;")
            values.append(a.name)
        lines.append(f"        rc = {f.name}({', '.join(values)});")
        for a in f.arguments:
            if a.written:
                lines.append(f'        save(dir, "{a.name}", {a.name}, bytes_{a.name});')
        lines.append("    }")
    lines += ['    printf("%d\\n", rc);', "    return 0;", "}", ""]
    return "\n".join(lines)


class Build:
    """One program's standalone files and the driver linked with them, in `where`."""

    def __init__(self, name: str, where: Path, openmp: bool = True, optimize: str = "-O1"):
        self.name = name
        self.rec = recurrence(name)
        self.dims = {d.name: d.default for d in self.rec.program.dims} | PROGRAMS[name][2]
        self.params = self.rec.default_params(H, self.dims)
        self.sa = standalone.Standalone(self.rec.compiled, self.dims, H, self.params)
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        self.files = self.sa.files()
        for fname, data in self.files.items():
            (where / fname).write_bytes(data)
        (where / "driver.c").write_text(driver_source(self.sa))
        flags = [optimize, "-Wall", "-Wextra", "-Werror"] + (["-fopenmp"] if openmp else [])  # (warning-free both ways)
        cmd = [GCC, *flags, "driver.c", f"{self.sa.prefix}.c", "-o", "driver", "-lm"]
        done = subprocess.run(cmd, cwd=where, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        self.calls = 0

    def tail(self, array: standalone.Array) -> tuple[int, ...]:
        """The array's own axes."""
        p = self.rec.program
        if array.role in ("input",):
            return tuple(self.dims[d] for d in next(x for x in p.inputs if x.name == array.dsl).shape)
        if array.role == "output":
            return tuple(self.dims[d] for d in next(o for o in p.outputs if o.name == array.dsl).value.shape)
        if array.scales:  # a log-scale (or its checkpoints): [B, H]
            return ()
        return tuple(self.dims[d] for d in p.state(array.dsl).shape)

    def call(self, function: str, dtype, arrays: dict[str, np.ndarray], *integers) -> tuple[int, dict]:
        """rc and the arrays written (by C name) of one call of NAME_function_SUFFIX."""
        self.calls += 1
        work = self.where / f"call{self.calls}"
        work.mkdir()
        for cname, arr in arrays.items():
            if arr is not None:
                np.ascontiguousarray(arr, np.int64 if cname == "slots" else dtype).tofile(work / f"{cname}.bin")
        fn = f"{self.sa.prefix}_{function}_{SUFFIX[dtype]}"
        done = subprocess.run([str(self.where / "driver"), fn, str(work), *map(str, integers)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        rc = int(done.stdout.split()[-1])
        out = {}
        for cname, arr in arrays.items():
            path = work / f"{cname}.out"
            if path.exists():
                out[cname] = np.fromfile(path, dtype).reshape(arr.shape)
        shutil.rmtree(work)
        return rc, out

    # ---- the arguments of a call, and the states at their true scale ----
    def arguments(self, inputs: dict, state: dict, dtype, lead_tokens: tuple, lead_state: tuple) -> dict:
        sa = self.sa
        args = {a.c: inputs[a.dsl].astype(dtype) for a in sa.inputs}
        args |= {a.c: np.asarray(self.params[a.dsl]).astype(dtype) for a in sa.param_arrays}
        args |= {a.c: state[a.dsl].astype(dtype) for a in sa.states}
        args |= {a.c: np.full(lead_state, np.nan, dtype) for a in sa.scales}
        args |= {a.c: np.zeros(lead_tokens + self.tail(a), dtype) for a in sa.outputs}
        return args

    def true_states(self, got: dict, names=None, lead=None) -> dict[str, np.ndarray]:
        """The states of a call's arrays (C names `names`: states, then log-scales), at their true scale."""
        sa = self.sa
        names = names or [a.c for a in sa.carried]
        arrays = dict(zip([a.c for a in sa.carried], [got[n] for n in names]))
        out = {}
        for a in sa.states:
            value = arrays[a.c].astype(np.float64)
            for sc in sa.scales:
                if a.dsl in sc.scales:
                    sigma = np.nan_to_num(arrays[sc.c].astype(np.float64))
                    value = value * np.exp(sigma).reshape(sigma.shape + (1,) * (value.ndim - sigma.ndim))
            out[a.dsl] = value
        return out

    def reference(self, inputs: dict, state: dict, dtype):
        """The NumPy recurrent form in float64 on the arrays rounded to `dtype` (the params too)."""
        def rounded(d):
            return {k: np.asarray(v).astype(dtype).astype(np.float64) for k, v in d.items()}
        res = self.rec.run(rounded(inputs), form="recurrent", backend="numpy", initial_state=rounded(state),
                           params=rounded(self.params), dims=self.dims)
        return res.outputs, res.final_state


def random_state(rec, batch, dims, seed) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: np.abs(rng.standard_normal((batch, H) + tuple(dims[d] for d in s.shape))) * 0.5
            for s in rec.program.states}  # (positive: a normalizer state stays away from 0)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    made = {}

    def get(name, openmp=True):
        key = (name, openmp)
        if key not in made:
            # -O1 (a third of -O2's build time on a loaded machine), gla at -O2 as an engine builds it,
            # without OpenMP at -O0
            optimize = "-O2" if name == "gla" else "-O1" if openmp else "-O0"
            made[key] = Build(name, tmp_path_factory.mktemp(f"standalone-{name}"), openmp, optimize)
        return made[key]
    return get


def close(got, ref, dtype, what):
    err = rel_err(got, ref)
    assert err <= RTOL[dtype], f"{what}: relative error {err:.3g} > {RTOL[dtype]:g}"


# ---- the four entry points against the NumPy recurrent form ----
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_prefill_and_snapshots_match_the_recurrent_form(builds, name, dtype):
    bd = builds(name)
    sa, rec = bd.sa, bd.rec
    inputs = rec.random_inputs(batch=B, tokens=T, heads=H, dims=bd.dims, seed=1)
    state0 = random_state(rec, B, bd.dims, 2)
    ref_out, ref_final = bd.reference(inputs, state0, dtype)
    args = bd.arguments(inputs, state0, dtype, (B, T, H), (B, H))
    rc, got = bd.call("prefill", dtype, args, B, T, H, 2)
    assert rc == 0
    for a in sa.outputs:
        close(got[a.c], ref_out[a.dsl], dtype, f"prefill output {a.dsl}")
    for dsl, value in bd.true_states(got).items():
        close(value, ref_final[dsl], dtype, f"prefill final state {dsl}")
    if not rec.program.causal:
        assert {f.what for f in sa.all_functions()} == {"prefill"}
        return
    # with checkpoints every EVERY tokens and the last KEEP states
    args = bd.arguments(inputs, state0, dtype, (B, T, H), (B, H))
    for a in sa.checkpoints:
        args[a.c] = np.zeros((B, T // EVERY, H) + bd.tail(a), dtype)
    for a in sa.lasts:
        args[a.c] = np.zeros((B, KEEP, H) + bd.tail(a), dtype)
    rc, got = bd.call("prefill_snapshots", dtype, args, EVERY, KEEP, B, T, H, 2)
    assert rc == 0
    for a in sa.outputs:
        close(got[a.c], ref_out[a.dsl], dtype, f"snapshots output {a.dsl}")
    for dsl, value in bd.true_states(got).items():
        close(value, ref_final[dsl], dtype, f"snapshots final state {dsl}")
    for j in range(T // EVERY):
        _, at = bd.reference({k: v[:, :(j + 1) * EVERY] for k, v in inputs.items()}, state0, dtype)
        states = bd.true_states({a.c: got[a.c][:, j] for a in sa.checkpoints}, [a.c for a in sa.checkpoints])
        for dsl, value in states.items():
            close(value, at[dsl], dtype, f"checkpoint {j} of {dsl}")
    for i in range(KEEP):
        _, at = bd.reference({k: v[:, :T - KEEP + i + 1] for k, v in inputs.items()}, state0, dtype)
        states = bd.true_states({a.c: got[a.c][:, i] for a in sa.lasts}, [a.c for a in sa.lasts])
        for dsl, value in states.items():
            close(value, at[dsl], dtype, f"last state {i} of {dsl}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", CAUSAL)
def test_decode_step_and_slot_pool_step_match_the_recurrent_form(builds, name, dtype):
    bd = builds(name)
    sa, rec = bd.sa, bd.rec
    tokens = rec.random_inputs(batch=B, tokens=1, heads=H, dims=bd.dims, seed=3)
    state0 = random_state(rec, B, bd.dims, 4)
    ref_out, ref_final = bd.reference(tokens, state0, dtype)
    args = bd.arguments({k: v[:, 0] for k, v in tokens.items()}, state0, dtype, (B, H), (B, H))
    rc, got = bd.call("step", dtype, args, B, H, 2)
    assert rc == 0
    for a in sa.outputs:
        close(got[a.c], ref_out[a.dsl][:, 0], dtype, f"step output {a.dsl}")
    for dsl, value in bd.true_states(got).items():
        close(value, ref_final[dsl], dtype, f"step state {dsl}")
    # the slot pool: requests 0, 1, 2 in slots 3, 0, 4 of five
    n = len(SLOTS)
    requests = rec.random_inputs(batch=n, tokens=1, heads=H, dims=bd.dims, seed=5)
    pool = random_state(rec, POOL, bd.dims, 6)
    args = bd.arguments({k: v[:, 0] for k, v in requests.items()}, pool, dtype, (n, H), (POOL, H))
    args["slots"] = np.array(SLOTS, np.int64)
    rc, got = bd.call("step_slots", dtype, args, n, POOL, H, 2)
    assert rc == 0
    ref_out, ref_rows = bd.reference(requests, {k: v[SLOTS] for k, v in pool.items()}, dtype)
    for a in sa.outputs:
        close(got[a.c], ref_out[a.dsl][:, 0], dtype, f"slot-pool output {a.dsl}")
    states = bd.true_states(got)
    for a in sa.states:
        close(states[a.dsl][SLOTS], ref_rows[a.dsl], dtype, f"slot-pool state {a.dsl}")
        untouched = [s for s in range(POOL) if s not in SLOTS]
        np.testing.assert_array_equal(got[a.c][untouched], args[a.c][untouched])


def test_without_openmp_the_kernels_run_on_the_calling_thread(builds):
    """Built without -fopenmp (the pragmas ignored): the same numbers, to float64 rounding."""
    bd = builds("retnet", openmp=False)
    inputs = bd.rec.random_inputs(batch=B, tokens=T, heads=H, dims=bd.dims, seed=7)
    state0 = random_state(bd.rec, B, bd.dims, 8)
    ref_out, ref_final = bd.reference(inputs, state0, np.float64)
    rc, got = bd.call("prefill", np.float64, bd.arguments(inputs, state0, np.float64, (B, T, H), (B, H)), B, T, H, 4)
    assert rc == 0
    close(got["out_o"], ref_out["o"], np.float64, "output")
    close(got["st_S"], ref_final["S"], np.float64, "final state")


# ---- bad arguments: an error code, nothing written ----
@pytest.fixture(scope="module")
def gla(builds):
    return builds("gla")


def slot_call(bd, slots, n_slots=POOL, bad_token=False):
    n = len(slots)
    requests = bd.rec.random_inputs(batch=n, tokens=1, heads=H, dims=bd.dims, seed=9)
    if bad_token:
        requests["g"][n - 1, 0, H - 1, 2] = 0.5  # input g <= 0
    pool = random_state(bd.rec, n_slots, bd.dims, 10)
    args = bd.arguments({k: v[:, 0] for k, v in requests.items()}, pool, np.float64, (n, H), (n_slots, H))
    args["slots"] = np.array(slots, np.int64)
    rc, got = bd.call("step_slots", np.float64, args, n, n_slots, H, 2)
    return rc, got, args


@pytest.mark.parametrize("slots, code", [([1, 1], 3), ([0, 5], 3), ([-1, 2], 3), ([0, 1, 2, 3, 4, 0], 3)],
                         ids=["duplicate", "past-the-pool", "negative", "more-requests-than-slots"])
def test_bad_slots_are_refused_and_the_pool_is_untouched(gla, slots, code):
    rc, got, args = slot_call(gla, slots)
    assert rc == code
    np.testing.assert_array_equal(got["st_S"], args["st_S"])


def test_a_token_outside_its_declared_range_changes_no_slot(gla):
    rc, got, args = slot_call(gla, [2, 0, 4], bad_token=True)
    assert rc == 2  # ERR_RANGE: input g <= 0, checked for every request before the first one runs
    np.testing.assert_array_equal(got["st_S"], args["st_S"])


def test_prefill_refusals_leave_the_state_alone(gla):
    inputs = gla.rec.random_inputs(batch=B, tokens=T, heads=H, dims=gla.dims, seed=11)
    state0 = random_state(gla.rec, B, gla.dims, 12)
    bad = {k: v.copy() for k, v in inputs.items()}
    bad["g"][1, T - 1, 0, 0] = np.nan
    rc, got = gla.call("prefill", np.float64, gla.arguments(bad, state0, np.float64, (B, T, H), (B, H)), B, T, H, 2)
    assert rc == 2
    np.testing.assert_array_equal(got["st_S"], state0["S"])
    ok = gla.arguments(inputs, state0, np.float64, (B, T, H), (B, H))
    for every, keep in [(-1, 0), (0, T + 1), (0, -1)]:  # state_every < 0, keep_last outside 0…T
        rc, got = gla.call("prefill_snapshots", np.float64, ok, every, keep, B, T, H, 2)
        assert rc == 3
        np.testing.assert_array_equal(got["st_S"], state0["S"])
    rc, got = gla.call("prefill", np.float64, ok, -1, T, H, 2)  # a negative size
    assert rc == 3
    rc, got = gla.call("prefill", np.float64, {k: v for k, v in ok.items() if k != "in_q"}, B, T, H, 2)
    assert rc == 3  # a NULL input
    np.testing.assert_array_equal(got["st_S"], state0["S"])
    rc, got = gla.call("prefill", np.float64, ok, 0, T, H, 2)  # nothing to do: nothing written
    assert rc == 0
    np.testing.assert_array_equal(got["st_S"], state0["S"])


# ---- the files themselves ----
def test_files_include_no_python_and_export_only_the_abi(builds):
    bd = builds("selective")  # unicode names, `*/` in its file name and comments
    for fname in (f"{bd.sa.prefix}.c", f"{bd.sa.prefix}.h"):
        text = (bd.where / fname).read_text()
        included = set(re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', text, re.M))
        assert included <= ALLOWED_INCLUDES | {f"{bd.sa.prefix}.h"}, included
    done = subprocess.run([GCC, "-O0", "-fopenmp", "-c", f"{bd.sa.prefix}.c", "-o", "k.o"], cwd=bd.where,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    nm = subprocess.run(["nm", "-g", "--defined-only", "k.o"], cwd=bd.where, capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if line.strip()}
    assert exported == {f.name for f in bd.sa.all_functions()}  # no lr_forward, nothing from the comments


def test_header_is_strict_c99_and_cpp_and_the_source_compiles_as_c99_and_c11(builds):
    """The header in strict C99 and C++; the source in strict C99 and C11 (where the C library declares only ISO
    C unless asked for POSIX's clocks and signal masks), with OpenMP and without it, as docs/embedding.md says."""
    bd = builds("performer")
    (bd.where / "uses_header.c").write_text(f'#include "{bd.sa.prefix}.h"\nint main(void) {{ return 0; }}\n')
    source = [[GCC, f"-std={std}", "-Wall", "-Wextra", "-Werror", *openmp, "-fsyntax-only", f"{bd.sa.prefix}.c"]
              for std in ("c99", "c11") for openmp in ([], ["-fopenmp"])]
    for cmd in ([GCC, "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "uses_header.c"],
                ["g++", "-std=c++11", "-pedantic", "-Wall", "-Werror", "-fsyntax-only", "-x", "c++", "uses_header.c"],
                *source):
        if shutil.which(cmd[0]) is None:
            continue
        done = subprocess.run(cmd, cwd=bd.where, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stderr[-3000:]}"


# a program C runs statement by statement (decays on both axes), one in three stages whose kernels each read
# some of the inputs, and a fused kernel's program that declares an input it never reads (found by probing: its
# decode step's pointer to `k` was an unused variable)
WARNING_FREE = {
    "no_state": "recurrence no_state(dk = 8)\ninput q[dk], k[dk]\noutput o = q·k\n",  # (found by probing: `&& ()`)
    "unread_input": "recurrence unread_input(dk = 8, dv = 6)\ninput q[dk], k[dk], v[dv]\ninput a[dk] in (0, 1]\n"
                    "state S[dk, dv]\nS = diag(a)·S + (1 − a)⊗v\noutput o = q·S\n",
    "both_decays": "recurrence both_decays(dk = 4, dv = 6)\ninput q[dk], k[dk], v[dv], ak[dk], av[dv]\n"
                   "state S[dk, dv]\nS = diag(exp(logsigmoid(ak)))·S·diag(exp(logsigmoid(av))) + k⊗v\n"
                   "output o = q·S\n",
    "three_stages": "recurrence three_stages(dk = 6, dv = 6)\ninput q[dk], k[dk], v[dv], g <= 0\n"
                    "state z[dk], S1[dk, dv], S2[dv, dv]\nz = exp(g)*z + relu(k)\nS1 = exp(g)·S1 + (k/(1 + z))⊗v\n"
                    "u = l2norm(k·S1)\nS2 = S2 + u⊗v\noutput o = l2norm(v)·S2\n",
    # a program's comments are copied into the files' opening comments: C's comment marks and trigraphs (??/ …,
    # which gcc warns of in every mode, comments included) in them are broken apart
    "comment_marks": "# or not?? */ /* ??= ???( \\\n# does it saturate??/\nrecurrence comment_marks(dk = 4, dv = 4)\n"
                     "input q[dk], k[dk], v[dv], g <= 0\nstate S[dk, dv]\nS = exp(g)·S + k⊗v  # ??' ??-\n"
                     "output o = q·S\n",
}


@pytest.mark.parametrize("name", WARNING_FREE)
def test_statement_kernels_and_stages_compile_without_warnings(tmp_path, name):
    """-Wall -Wextra -Werror beyond the examples: a statement-by-statement kernel with no declared ranges (its
    inputs' pointers gathered for a range check it does not make), a stage's kernel that does not read every
    input (its row pointers) and a fused decode step of a program with an input it never reads warned of
    unused variables."""
    if GCC is None:
        pytest.skip("no gcc")
    rec = linrec.compile(WARNING_FREE[name], f"{name}.lin")
    dims = {d.name: d.default for d in rec.program.dims}
    sa = standalone.Standalone(rec.compiled, dims, 2, rec.default_params(2, dims))
    for fname, data in sa.files().items():
        (tmp_path / fname).write_bytes(data)
    for openmp in ([], ["-fopenmp"]):
        cmd = [GCC, "-std=c11", "-Wall", "-Wextra", "-Werror", *openmp, "-fsyntax-only", f"{sa.prefix}.c"]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stderr[-3000:]}"


def test_params_file_holds_the_defaults_at_the_offsets_the_header_gives(builds):
    bd = builds("mamba2")
    data = np.fromfile(bd.where / "mamba2_params.bin", "<f8")
    header = (bd.where / "mamba2.h").read_text()
    assert "#define MAMBA2_PARAMS_HEADS 3" in header
    for name in ("A_log", "A", "D"):
        offset = int(re.search(rf"#define MAMBA2_prm_{name}_OFFSET (\d+)", header).group(1))
        count = int(re.search(rf"#define MAMBA2_prm_{name}_COUNT (\d+)", header).group(1))
        np.testing.assert_array_equal(data[offset:offset + count], bd.params[name])
    assert data.size == 3 * H


def test_cli_writes_the_files(tmp_path, capsys):
    out = tmp_path / "kernels"
    assert main(["emit", str(EXAMPLES / "gla.lin"), "--backend", "c", "--standalone", "--out", str(out),
                 "--dim", "dk=8"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gla.c", "gla.h"]  # (no params: no params file)
    assert "#define GLA_dim_dk 8" in (out / "gla.h").read_text()
    assert "gla.h" in capsys.readouterr().out


def test_no_two_programs_export_the_same_names(tmp_path, capsys):
    """An engine links several programs: programs named γ and u_3b3 both exported u_3b3.h and u_3b3_prefill_f32
    (found by a probe), and int and int_ both int_. Each name now gives a prefix no other name gives."""
    names = ["γ", "u_3b3", "u_", "σx", "u_3c3_x", "int", "int_", "u_i_n_t", "lr32", "main", "gla", "a_b", "A", "Γ"]
    prefixes = [exported_identifier(n, {"lr32", "lr64", "lrs"}) for n in names]
    assert len(set(prefixes)) == len(names), dict(zip(names, prefixes))
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in prefixes)
    assert prefixes[names.index("gla")] == "gla" and prefixes[names.index("γ")] == "u_3b3"  # (as ever)
    for name in ("γ", "u_3b3"):
        (tmp_path / "p.lin").write_text(f"recurrence {name}(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                                        "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S\n", encoding="utf-8")
        assert main(["emit", str(tmp_path / "p.lin"), "--backend", "c", "--standalone", "--out",
                     str(tmp_path / name)]) == 0
    assert {p.name for p in (tmp_path / "γ").iterdir()} == {"u_3b3.c", "u_3b3.h"}
    assert {p.name for p in (tmp_path / "u_3b3").iterdir()} == {"u_u_5f_3_b_3.c", "u_u_5f_3_b_3.h"}


@pytest.mark.parametrize("argv, message", [
    (["softmax.lin", "--backend", "c", "--standalone", "--out", "x"], "reads the whole visible sequence"),
    (["gla.lin", "--standalone", "--out", "x"], "add --backend c"),
    (["gla.lin", "--backend", "c", "--standalone"], "--out DIR"),
    (["gla.lin", "--backend", "c", "--standalone", "--out", "x", "--form", "chunkwise"], "recurrent form"),
    (["gla.lin", "--out", "x"], "go with --standalone"),
])
def test_cli_refusals_say_why(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["emit", str(EXAMPLES / argv[0]), *argv[1:]]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_programs_without_a_recurrent_kernel_are_refused_with_their_reason():
    for name in ("softmax", "reformer", "linformer"):
        rec = linrec.load(EXAMPLES / f"{name}.lin")
        with pytest.raises(LinrecError, match=name):
            standalone.Standalone(rec.compiled, {})
    # non-causal with an exponential feature map: C runs its recurrent form as a scan NumPy prepares
    source = (EXAMPLES / "performer.lin").read_text().replace("m = 256)", "m = 256) noncausal")
    with pytest.raises(LinrecError, match="scan that NumPy prepares"):
        standalone.Standalone(linrec.compile(source, "bidirectional_performer.lin").compiled, {})


def test_a_default_computed_from_a_param_without_one_is_the_engines_too(tmp_path, capsys):
    """lam = exp(−exp(A)) with A without a default: `emit --standalone` was an internal TypeError (exit 2); the
    header leaves both to the engine, lam to be computed from its A, and no params file is written."""
    path = tmp_path / "dep.lin"
    path.write_text("recurrence dep(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nparam A per head\n"
                    "param lam per head = exp(−exp(A))\nstate S[dk, dv]\nS = lam·S + k⊗v\noutput o = q·S\n")
    out = tmp_path / "kernels"
    assert main(["emit", str(path), "--backend", "c", "--standalone", "--out", str(out), "--heads", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["dep.c", "dep.h"]
    header = " ".join((out / "dep.h").read_text().split())
    assert "'A' has no default: the engine supplies it." in header
    assert ("'lam' has a default computed from 'A', left to the engine: the engine supplies 'lam' too, computed "
            "from its 'A'.") in header
    capsys.readouterr()
