"""What linrec guarantees on hostile or careless input (issue 20): user strings never become code, every
output of a kernel is written, and so on. Each test here failed before the fix it names.

Tolerances are those of tests/test_c_backend.py: C float64 1e-10, C float32 2e-5, relative to the largest
value of the float64 NumPy recurrent form's array.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import linrec
from compare import rel_err

F64_RTOL, F32_RTOL = 1e-10, 2e-5
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def assert_c_matches_numpy(rec, dims, dtype, tokens=40, heads=3, batch=2):
    x = rec.random_inputs(batch, tokens, heads, dims=dims, dtype=np.float64, seed=5)
    ref = rec.run(x, form="recurrent", backend="numpy", dims=dims)
    got = rec.run({k: v.astype(dtype) for k, v in x.items()}, form="recurrent", backend="c", dims=dims)
    rtol = F64_RTOL if dtype == np.float64 else F32_RTOL
    for group in ("outputs", "final_state"):
        for name, want in getattr(ref, group).items():
            err = rel_err(getattr(got, group)[name], want)
            assert err <= rtol, (group, name, err)


# ---- every output of the fused kernel is written -------------------------------------------------------
# `o` is a readout as it is: the tile loop streams it to its row when the row is whole registers (64 bytes:
# dv = 16, 32, 64 in float32, 8 and 16 in float64); `p` (no readout) and `n` (another readout, through a
# normalization) are computed after the tile loop. The phase that writes those used to stream an unwritten
# local over `o`'s row.
STREAMED_BESIDE_OTHERS = """\
recurrence streamed(dk = 8, dv = 16)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
output p = 2*v
output n = groupnorm(k·S) + sum(v)
"""


@pytest.mark.parametrize("dtype,dv", [(np.float32, 16), (np.float32, 32), (np.float32, 64),
                                      (np.float64, 8), (np.float64, 16), (np.float32, 19)])
def test_a_streamed_output_beside_outputs_computed_later(dtype, dv):
    rec = linrec.compile(STREAMED_BESIDE_OTHERS, "streamed.lin")
    assert_c_matches_numpy(rec, {"dk": 8, "dv": dv}, dtype)


# ---- user text never becomes code ----------------------------------------------------------------------
# A path whose directories spell `*/`, a C function marked to run when its library loads, and `/*`: before
# the fix, the file name went unescaped into the kernel's opening comment, and `linrec run` ran the function.
INJECTED = ["x*", '\n__attribute__((constructor)) static void injected(void) { system("touch injected"); } ', "*y"]


def test_a_file_path_never_becomes_c_code(tmp_path):
    folder = tmp_path.joinpath(*INJECTED)
    folder.mkdir(parents=True)
    program = folder / "gla.lin"
    program.write_text(EXAMPLES.joinpath("gla.lin").read_text(encoding="utf-8"), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "linrec", "run", str(program), "--backend", "c", "--form", "recurrent",
                          "--tokens", "4", "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "injected").exists()
    source = linrec.load(program).emit("recurrent", backend="c")
    assert "injected(void)" in source and "__attribute__((constructor))" in source  # shown, inside the comment
    opening = source[:source.index("*/")]
    assert "injected(void)" in opening and "\\n__attribute__" in opening  # the newline shown as an escape


def test_a_folder_named_with_a_star(tmp_path):
    """`a*/gla.lin`: the path holds `*/`, which used to end the kernel's comment (a raw compiler error)."""
    folder = tmp_path / "a*"
    folder.mkdir()
    program = folder / "gla.lin"
    program.write_text(EXAMPLES.joinpath("gla.lin").read_text(encoding="utf-8"), encoding="utf-8")
    rec = linrec.load(program)
    assert_c_matches_numpy(rec, {"dk": 4, "dv": 4}, np.float64, tokens=5)


# every character a comment of the program may hold: a NUL, a lone carriage return (a line end to Python),
# C's comment delimiters, a bidirectional override, a line separator
ODD_COMMENT = "# a NUL \x00, a CR \r x = 1, */ int injected; /* \u202e, \u2028 end\n"


@pytest.mark.parametrize("where", ["header", "statement"])
def test_odd_characters_in_the_programs_comments(where):
    lines = EXAMPLES.joinpath("gla.lin").read_text(encoding="utf-8").splitlines(keepends=True)
    at = 1 if where == "header" else len(lines) - 1
    source = "".join(lines[:at]) + ODD_COMMENT + "".join(lines[at:])
    rec = linrec.compile(source, "odd.lin")
    dims = {"dk": 4, "dv": 4}
    x = rec.random_inputs(1, 9, 2, dims=dims, seed=1)
    ref = rec.run(x, form="recurrent", backend="numpy", dims=dims)
    for form in rec.forms:
        got = rec.run(x, form=form, backend="numpy", dims=dims)
        assert rel_err(got.outputs["o"], ref.outputs["o"]) <= 1e-12, form
        for backend in ("numpy", "c"):
            text = rec.emit(form, backend=backend)
            assert "\x00" not in text and "\u202e" not in text and "\u2028" not in text
    assert_c_matches_numpy(rec, dims, np.float64, tokens=9)


# ---- one decode semantics on both backends ----------------------------------------------------------------
BACKENDS = ["numpy", "c"]
GATED = """\
recurrence gated(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0
param w[dv] per head = randn(seed=1)
state S[dk, dv]
S = diag(exp(g))·S + k⊗(v*w)
output o = q·S
"""


def _token(rec, seed=3, dtype=np.float64):
    x = rec.random_inputs(2, 1, 3, dtype=dtype, seed=seed)
    return {k: np.ascontiguousarray(v[:, 0]) for k, v in x.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_replaced_in_its_dict_is_read_again(backend):
    rec = linrec.compile(GATED, "gated.lin")
    token, params = _token(rec), {"w": np.ones((3, 3))}
    first, _ = rec.step(token, None, backend=backend, params=params)
    params["w"] = 2 * np.ones((3, 3))  # the same dict, another array: the next step reads it
    second, _ = rec.step(token, None, backend=backend, params=params)
    np.testing.assert_allclose(second["o"], 2 * first["o"], rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bound_step_reads_the_arrays_it_was_bound_to(backend):
    rec = linrec.compile(GATED, "gated.lin")
    token = _token(rec)
    state = {"S": np.zeros((2, 3, 4, 3))}
    step = rec.bind_step(token, state, backend=backend)
    bound_q = token["q"]
    token["q"] = np.zeros_like(bound_q)  # another array in the dict: the bound step still reads bound_q
    out = step()
    fresh, _ = rec.step(dict(token, q=bound_q), {"S": np.zeros((2, 3, 4, 3))}, backend=backend)
    np.testing.assert_allclose(out["o"], fresh["o"], rtol=1e-12)
    assert np.abs(out["o"]).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_binding_needs_every_state(backend):
    rec = linrec.compile(GATED, "gated.lin")
    with pytest.raises(linrec.RuntimeInputError, match="pass every state \\(missing: S"):
        rec.bind_step(_token(rec), {"other": np.zeros(3)}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["fortran", "strided", "big-endian"])
def test_a_bound_step_reads_token_buffers_of_any_layout_every_call(backend, layout):
    """Token buffers the C kernel cannot read where they lie are copied every call, so their refills reach the
    step as on NumPy (C refused them: 'must be a C-contiguous float64 array … to be bound')."""
    rec = linrec.compile(GATED, "gated.lin")
    x = rec.random_inputs(2, 4, 3, seed=5)
    reference = rec.run(x, form="recurrent").outputs["o"]
    make = {"fortran": np.asfortranarray, "big-endian": lambda a: a.astype(a.dtype.newbyteorder(">")),
            "strided": lambda a: np.repeat(a, 2, axis=-1)[..., ::2]}[layout]
    tokens = {k: make(np.ascontiguousarray(v[:, 0])) for k, v in x.items()}
    step = rec.bind_step(tokens, {"S": np.zeros((2, 3, 4, 3))}, backend=backend)
    for t in range(4):
        for k in tokens:
            tokens[k][...] = x[k][:, t]
        np.testing.assert_allclose(step()["o"], reference[:, t], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_not_given_starts_from_zeros(backend):
    rec = linrec.compile(GATED, "gated.lin")
    token = _token(rec)
    without, _ = rec.step(token, {}, backend=backend)
    zeros, _ = rec.step(token, {"S": np.zeros((2, 3, 4, 3))}, backend=backend)
    np.testing.assert_array_equal(without["o"], zeros["o"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dtypes_in_a_step(backend):
    """Copied in the call's dtype when the step does not update it in place (as run() takes initial states);
    refused when it must be updated in place."""
    rec = linrec.compile(GATED, "gated.lin")
    token = _token(rec)
    s32 = np.random.default_rng(0).standard_normal((2, 3, 4, 3)).astype(np.float32)
    out, state = rec.step(token, {"S": s32}, backend=backend)
    ref, _ = rec.step(token, {"S": s32.astype(np.float64)}, backend=backend)
    assert state["S"].dtype == np.float64
    np.testing.assert_allclose(out["o"], ref["o"], rtol=1e-12)
    with pytest.raises(linrec.RuntimeInputError, match="state 'S' must be a writeable C-contiguous float64.*"
                                                        "; state\\['S'\\] is float32"):
        rec.step(token, {"S": s32}, backend=backend, inplace=True)
    with pytest.raises(linrec.RuntimeInputError, match="or a bound step\\); state\\['S'\\] is float32"):
        rec.bind_step(token, {"S": s32}, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_output_arrays_are_refused_with_what_is_wrong(backend):
    """The message names the first way the array given differs: its dtype, shape, layout, or writeability."""
    rec = linrec.compile(GATED, "gated.lin")
    read_only = np.zeros((2, 3, 3))
    read_only.flags.writeable = False
    for given, why in ((np.zeros((2, 1, 3)), "has shape \\[2, 1, 3\\]"),
                       (np.zeros((2, 3, 3), np.float32), "is float32"),
                       (np.asfortranarray(np.zeros((2, 3, 3))), "is not C-contiguous"),
                       (read_only, "is read-only"), ([0.0], "is a list, not an ndarray")):
        with pytest.raises(linrec.RuntimeInputError,
                           match=f"out\\['o'\\] must be a writeable C-contiguous float64 .*; out\\['o'\\] {why}"):
            rec.step(_token(rec), None, backend=backend, out={"o": given})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_misspelt_name_in_a_steps_dicts_is_an_error(backend):
    """A state name that is none of the program's would leave the state it meant at zero, an output name
    its buffer unwritten: both are errors, on both backends, in place or not, bound or not."""
    rec = linrec.compile(GATED, "gated.lin")
    token, state = _token(rec), {"s": np.zeros((2, 3, 4, 3))}
    for inplace in (False, True):
        with pytest.raises(linrec.RuntimeInputError, match=r"unknown state\(s\) 's'; the states of 'gated' are S"):
            rec.step(token, state, backend=backend, inplace=inplace)
    with pytest.raises(linrec.RuntimeInputError, match=r"unknown state\(s\) 's'"):
        rec.bind_step(token, dict(state, S=np.zeros((2, 3, 4, 3))), backend=backend)
    with pytest.raises(linrec.RuntimeInputError, match=r"unknown output\(s\) 'O' in out; the outputs of 'gated' are o"):
        rec.step(token, {"S": np.zeros((2, 3, 4, 3))}, backend=backend, inplace=True, out={"O": np.zeros((2, 3, 3))})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_made_read_only_after_a_step_is_refused(backend):
    """The C step's fast path (the same arrays again) checks that the arrays it writes are still writeable."""
    rec = linrec.compile(GATED, "gated.lin")
    token, state, out = _token(rec), {"S": np.zeros((2, 3, 4, 3))}, {"o": np.zeros((2, 3, 3))}
    rec.step(token, state, backend=backend, inplace=True, out=out)
    rec.step(token, state, backend=backend, inplace=True, out=out)  # (C: now on the fast path)
    for frozen in (state["S"], out["o"]):
        frozen.flags.writeable = False
        before = state["S"].copy()
        with pytest.raises(linrec.RuntimeInputError, match="must be a writeable"):
            rec.step(token, state, backend=backend, inplace=True, out=out)
        np.testing.assert_array_equal(state["S"], before)
        frozen.flags.writeable = True


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tokens_range_error_names_an_index_of_the_tokens_array(backend):
    """A token's g is [B, H, dk]: the index has no T axis (NumPy's step checked it as [B, 1, H, dk])."""
    rec = linrec.compile(GATED, "gated.lin")
    token = _token(rec)
    token["g"][1, 2, 0] = 1.0
    with pytest.raises(linrec.RuntimeInputError, match=r"input 'g' must lie in .* found 1 at index \[1, 2, 0\]"):
        rec.step(token, None, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_causal_program_has_no_step(backend):
    rec = linrec.compile(GATED.replace("dv = 3)", "dv = 3) noncausal"), "encoder.lin")
    with pytest.raises(linrec.LinrecError, match="non-causal"):
        rec.step(_token(rec), None, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_misshapen_token_input_is_the_one_named(backend):
    """A token's arrays are [B, H, *]. The step checked them as a sequence of one, [B, 1, H, *]: a v one wider
    than the state was the state's error ("initial state 'S' should have shape …", or C's "state 'S' …"), a q
    one wider was k's, and every shape came with a T axis. Now the size most of the step's arrays have (a
    tie to the state) is the one expected, and the array that disagrees is named, with both shapes."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(2, 1, 3, dims={"dk": 4, "dv": 3}, seed=3)
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in x.items()}
    state = {"S": np.zeros((2, 3, 4, 3))}
    rec.step(token, state, backend=backend, inplace=True)  # (C: a stepper bound to these sizes, refusing the next)
    wide_v = dict(token, v=np.zeros((2, 3, 4)))
    v_error = r"^error: input 'v' should have shape \[B, H, dv\] = \[2, 3, 3\] but has shape \[2, 3, 4\] " \
              r"\(dv = 3 in state 'S'\)$"
    for inplace in (False, True):
        with pytest.raises(linrec.RuntimeInputError, match=v_error):
            rec.step(wide_v, state, backend=backend, inplace=inplace)
    with pytest.raises(linrec.RuntimeInputError, match=v_error):
        rec.bind_step(wide_v, state, backend=backend)
    with pytest.raises(linrec.RuntimeInputError, match=r"^error: input 'q' should have shape \[B, H, dk\] = "
                       r"\[2, 3, 4\] but has shape \[2, 3, 5\] \(dk = 4 in input 'k' and input 'g'\)$"):
        rec.step(dict(token, q=np.zeros((2, 3, 5))), None, backend=backend)
    with pytest.raises(linrec.RuntimeInputError, match=r"^error: input 'v' should have shape \[B, H, dv\] but "
                                                        r"has shape \[2, 3\]$"):
        rec.step(dict(token, v=np.zeros((2, 3))), state, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_that_does_not_fit_the_kv_cache_is_named(backend):
    """Softmax attention's decode state is the inputs so far: a token's v one wider than the cache's was
    NumPy's ValueError from concatenate (an internal error)."""
    rec = linrec.load(EXAMPLES / "softmax.lin")
    x = rec.random_inputs(2, 3, 2, dims={"dk": 4, "dv": 3}, seed=3)
    token = {k: np.ascontiguousarray(v[:, 0]) for k, v in x.items()}
    with pytest.raises(linrec.RuntimeInputError, match=r"^error: input 'v' should have shape \[B, H, dv\] = "
                       r"\[2, 2, 3\] but has shape \[2, 2, 4\] \(dv = 3 in the KV cache's 'v'\)$"):
        rec.step(dict(token, v=np.zeros((2, 2, 4))), x, backend=backend)
    with pytest.raises(linrec.RuntimeInputError, match=r"^error: the KV cache's 'v' has shape \[1, 3, 2, 3\] but "
                                                        r"the token's 'v' has \[2, 2, 3\]"):
        rec.step(token, dict(x, v=x["v"][:1]), backend=backend)


# ---- counts past a C int --------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["recurrent", "chunkwise", "parallel"])
def test_more_tokens_than_a_c_int_is_a_clear_error(form):
    """2³¹ tokens (views with no memory per token): the C kernels count in ints, and cffi's OverflowError was
    an internal error; now the call is refused before any array is prepared."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = {n: np.broadcast_to(np.zeros(4), (1, 2**31, 1, 4)) for n in "qkvg"}
    with pytest.raises(linrec.RuntimeInputError, match="tokens = 2147483648: the c backend's kernels take at most"):
        rec.run(x, backend="c", form=form, dims={"dk": 4, "dv": 4})


# ---- threads (docs/guarantees.md#threads-and-processes) ------------------------------------------------
def test_one_recurrence_called_from_several_threads(tmp_path, monkeypatch):
    """The first calls build and load the kernels (a fresh cache), from six threads at once, over three forms:
    every thread gets the float64 recurrent form's outputs."""
    monkeypatch.setenv("LINREC_CACHE_DIR", str(tmp_path / "cache"))
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(2, 48, 2, dims={"dk": 8, "dv": 8}, seed=3)
    reference = rec.run(x, form="recurrent", backend="numpy").outputs["o"]
    results, errors = {}, []

    def call(i):
        try:
            form = ("recurrent", "chunkwise", "parallel")[i % 3]
            results[i] = rec.run(x, form=form, backend="c", chunk_size=16).outputs["o"]
        except Exception as error:  # reported below, with the thread's number
            errors.append((i, repr(error)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 6
    for o in results.values():
        assert rel_err(o, reference) <= F64_RTOL


def test_threads_stepping_requests_of_other_shapes_on_one_recurrence():
    """Threads decoding their own requests on one Recurrence, at other [B, H] or dtypes: each gets, token for
    token, the very numbers it gets alone. A compiled step is bound to one [B, H] and dtype and rebinds
    itself, and every thread shared one: a call read what another had just bound (the heap corrupted, the
    process aborted; wrong numbers; errors about shapes nobody passed). Thread switches made frequent, so that
    the interleavings that exist at the default interval show in a short run."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    tokens, heads = 150, 2
    requests = [(1, np.float32), (2, np.float32), (1, np.float64)]
    sequences = [rec.random_inputs(batch, tokens, heads, dtype=dtype, seed=i)
                 for i, (batch, dtype) in enumerate(requests)]

    def decode(i, backend):
        state, outputs = None, []
        for t in range(tokens):
            o, state = rec.step({n: a[:, t] for n, a in sequences[i].items()}, state, backend=backend)
            outputs.append(o["o"])
        return np.stack(outputs)

    for backend in ("c", "numpy"):
        alone = [decode(i, backend) for i in range(len(requests))]
        together, errors = {}, []

        def run(i):
            try:
                together[i] = decode(i, backend)
            except Exception as error:  # reported below, with the thread's number
                errors.append((i, repr(error)))

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for _ in range(2):
                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not errors, (backend, errors)
                for i, want in enumerate(alone):
                    assert np.array_equal(together[i], want), (backend, requests[i])
        finally:
            sys.setswitchinterval(interval)


def _in_a_forked_child(work, seconds=60) -> str:
    """work() run in a child forked from this process: "ok", "failed" (it raised or returned False), or "hung"
    (no exit within `seconds`: an alarm ends it)."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            signal.alarm(seconds)
            code = 0 if work() else 1
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        return "hung" if os.WTERMSIG(status) == signal.SIGALRM else f"killed by signal {os.WTERMSIG(status)}"
    return "ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_after_a_kernel_ran_on_threads_runs_kernels():
    """GNU OpenMP's threads do not survive a fork: a child forked after a run on two threads waited forever in
    its first kernel (multiprocessing's "fork" start method, DataLoader workers). Its kernels now run on one
    thread (build.num_threads), with the parent's numbers."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(2, 4096, 8, dtype=np.float32, seed=1)  # (work enough for a team of two)
    want = rec.run(x, backend="c", form="recurrent", threads=2).outputs["o"]
    assert _in_a_forked_child(lambda: np.array_equal(
        rec.run(x, backend="c", form="recurrent", threads=2).outputs["o"], want)) == "ok"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_a_thread_builds_a_kernel_runs_kernels(tmp_path, monkeypatch):
    """A thread of the parent holds the C backend's locks through a build (seconds of gcc); a child forked
    meanwhile inherited them held, by a thread it does not have, and waited forever for a kernel that was
    built and loaded already. The child gets them free (backends/c/fork.py)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LINREC_CACHE_DIR", str(cache))
    source = (EXAMPLES / "gla.lin").read_text(encoding="utf-8")
    x = linrec.compile(source).random_inputs(1, 16, 2, seed=2)
    want = linrec.compile(source).run(x, backend="c", form="recurrent").outputs["o"]  # built and loaded
    other = linrec.compile((EXAMPLES / "retnet.lin").read_text(encoding="utf-8") + "# built while forking\n")
    building = threading.Thread(target=lambda: other.run(other.random_inputs(1, 16, 2), backend="c"))
    building.start()
    try:
        deadline = time.monotonic() + 60
        while not any(cache.glob(".tmp-*")) and building.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # (until gcc runs: a build's temporary directory is there)
        assert building.is_alive()
        # (a new Recurrence of the same source: the child looks its kernel up in the cache)
        assert _in_a_forked_child(lambda: np.array_equal(
            linrec.compile(source).run(x, backend="c", form="recurrent").outputs["o"], want)) == "ok"
    finally:
        building.join()


def test_prefill_and_vjp_take_threads_as_run_does():
    """`threads=` on prefill and vjp, as on run: the same numbers on one thread and two. prefill took it for an
    input ("unknown input array(s) 'threads'"), vjp for a TypeError; a bad count is the same error as run's."""
    rec = linrec.load(EXAMPLES / "gla.lin")
    x = rec.random_inputs(2, 40, 3, seed=4)
    up = {"o": np.random.default_rng(4).standard_normal(x["v"].shape)}
    one = rec.prefill(x, backend="c", threads=1)
    two = rec.prefill(x, backend="c", threads=2)
    assert np.array_equal(one.outputs["o"], two.outputs["o"])
    assert np.array_equal(one.final_state["S"], two.final_state["S"])
    grads = [rec.vjp(x, up, backend="c", threads=n).grads for n in (1, 2)]
    assert all(np.array_equal(grads[0][k], grads[1][k]) for k in grads[0])
    for call in (lambda: rec.prefill(x, backend="c", threads=0), lambda: rec.vjp(x, up, backend="c", threads=0),
                 lambda: rec.run(x, backend="c", threads=0)):
        with pytest.raises(linrec.LinrecError, match="thread count must be a positive integer"):
            call()
