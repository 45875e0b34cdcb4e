"""The fuzzer (tests/fuzzing.py) in the test suite: random programs over the grammar — generated ones, and
mutations of the example files — each under a time limit, through `check`, every form `check` lists on
NumPy (and, for a sample, on C: the recurrent form, the decode step, form="auto" and a scan form), against
the float64 reference form within verify's tolerance; for one program in GRAD_EVERY (and the first GRAD_C of
the C programs whose gradient C builds) every gradient form `check` lists as well, against the NumPy
recurrent backward at 1e-9 and that against central differences at 1e-6 (fuzzing._gradients); for one in
SERVING_EVERY (on C one in C_SERVING_EVERY) what a serving engine asks of it (fuzzing._serving); for one in
TORCH_EVERY, where torch is installed, linrec.torch.apply and autograd through it (fuzzing._through_torch); one
C program in C_MODEL_SIZES_EVERY at a model's head sizes (fuzzing.at_model_sizes). A failure lists each class
of problem with the programs that show it.

Default size (this CI run): DEFAULT_PROGRAMS programs on NumPy in batches of BATCH, DEFAULT_C of them also
on C (a C kernel costs ~0.5 s to build). Longer runs:

    python -m pytest tests/test_fuzz.py --fuzz-programs 20000 --fuzz-c 300 --fuzz-seed 7 \
        --fuzz-grad-every 1 --fuzz-grad-c 300             # gradients of every program, on C of every C one
    LINREC_FUZZ_PROGRAMS=20000 LINREC_FUZZ_GRAD_EVERY=1 python -m pytest tests/test_fuzz.py
    python tests/fuzzing.py 20000 --c 300 --seed 7        # the same, as a report (gradients of every program)
"""
from __future__ import annotations

import os

import pytest

from fuzzing import COMMAND_LINE_EVERY, TORCH, Stats, at_model_sizes, exercise, programs, summarize

DEFAULT_PROGRAMS = 2000
DEFAULT_C = 30
DEFAULT_GRAD_EVERY = 30  # gradients of one NumPy program in this many (~0.15 s each with finite differences)
DEFAULT_GRAD_C = 2       # C programs whose C gradient forms are checked (a backward build costs ~1 s)
DEFAULT_SERVING_EVERY = 20  # serving checked on one program in this many (~0.07 s each on NumPy, ~0.5 s on C)
C_SERVING_EVERY = 10        # of the C programs, at most one in this many (their every form built on C)
TORCH_EVERY = 40            # linrec.torch.apply and autograd on one NumPy program in this many (where torch is)
C_MODEL_SIZES_EVERY = 15    # of the C programs, one in this many at a model's head sizes (dk, dv from 64 to 200)
BATCH = 250
SHOWN = 3  # failing programs printed per class


def _option(config, name: str, variable: str, default: int) -> int:
    value = config.getoption(name)
    if value is None:
        value = int(os.environ.get(variable, default))
    return value


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "numpy_batch" in metafunc.fixturenames:
        count = _option(config, "--fuzz-programs", "LINREC_FUZZ_PROGRAMS", DEFAULT_PROGRAMS)
        seed = _option(config, "--fuzz-seed", "LINREC_FUZZ_SEED", 0)
        batches = [(seed * 1_000_003 + i, min(BATCH, count - i * BATCH)) for i in range(-(-count // BATCH))]
        metafunc.parametrize("numpy_batch", batches, ids=[f"seed{s}x{n}" for s, n in batches])
    if "grad_every" in metafunc.fixturenames:
        every = _option(config, "--fuzz-grad-every", "LINREC_FUZZ_GRAD_EVERY", DEFAULT_GRAD_EVERY)
        metafunc.parametrize("grad_every", [every], ids=[f"grad1in{every}"])
    if "serving_every" in metafunc.fixturenames:
        every = _option(config, "--fuzz-serving-every", "LINREC_FUZZ_SERVING_EVERY", DEFAULT_SERVING_EVERY)
        metafunc.parametrize("serving_every", [every], ids=[f"serving1in{every}"])
    if "c_batch" in metafunc.fixturenames:
        count = _option(config, "--fuzz-c", "LINREC_FUZZ_C", DEFAULT_C)
        seed = _option(config, "--fuzz-seed", "LINREC_FUZZ_SEED", 0)
        grad_c = _option(config, "--fuzz-grad-c", "LINREC_FUZZ_GRAD_C", DEFAULT_GRAD_C)
        metafunc.parametrize("c_batch", [(seed * 1_000_003 + 999_999, count, grad_c)], ids=[f"c{count}grad{grad_c}"])


def _report(failures, stats) -> str:
    shown, lines = {}, [summarize(failures), "", f"covered: {dict(stats)}"]
    for f in failures:
        key = (f.kind, f.message.splitlines()[0][:60])
        if shown.setdefault(key, 0) < SHOWN:
            shown[key] += 1
            lines += ["", str(f)]
    return "\n".join(lines)


def test_random_programs_on_numpy(numpy_batch, grad_every, serving_every):
    """A batch of programs through check and every form it lists on NumPy (T = 12, small sizes); one in
    COMMAND_LINE_EVERY through `linrec check` and `linrec run` as well, one in grad_every through every
    gradient form it lists, one in serving_every through what a serving engine asks of it (0: none)."""
    seed, count = numpy_batch
    failures, stats = [], Stats()
    for i, source in enumerate(programs(count, seed)):
        gradients = ("numpy",) if grad_every and i % grad_every == 0 else ()
        serving = ("numpy",) if serving_every and i % serving_every == 0 else ()
        through_torch = ("numpy",) if i % TORCH_EVERY == 0 else ()
        failures += exercise(source, ("numpy",), seed=i, seconds=20, stats=stats,
                             command_line=i % COMMAND_LINE_EVERY == 0, gradients=gradients, serving=serving,
                             through_torch=through_torch)
    assert stats["programs"] == count
    if grad_every and count >= 20 * grad_every:  # (enough programs that some have a gradient)
        assert stats["gradients"] > 0, stats
    if serving_every and count >= 5 * serving_every:  # (a batch of 250 samples 13 programs, most of them accepted)
        assert stats["serving rows on numpy"] > 0, stats
    if TORCH and count >= 5 * TORCH_EVERY:
        assert stats["torch gradients on numpy"] > 0, stats
    assert stats["accepted"] > count // 2, f"the generator should mostly write programs check accepts: {stats}"
    assert not failures, _report(failures, stats)


def test_random_programs_on_c(c_batch, serving_every):
    """Programs of their own seed through the C backend too: its recurrent form, decode step, form="auto"
    and one scan form, where check lists them (each build ~0.5 s: a time limit of 120 s per program); the
    gradients of every program, on NumPy and C, until grad_c programs have had C gradient forms checked; what a
    serving engine asks, on C, of one program in C_SERVING_EVERY (every form it lists: more builds); one
    program in C_MODEL_SIZES_EVERY at a model's head sizes, where the kernels tile, block and split the state."""
    seed, count, grad_c = c_batch
    if count == 0:
        pytest.skip("--fuzz-c 0")
    failures, stats, with_c_gradients = [], Stats(), 0
    every = max(1, min(serving_every, C_SERVING_EVERY)) if serving_every else 0
    for i, source in enumerate(programs(count, seed)):
        before = stats["gradient runs on c"]
        gradients = ("numpy", "c") if with_c_gradients < grad_c else ()
        serving = ("c",) if every and i % every == 0 else ()
        if i % C_MODEL_SIZES_EVERY == C_MODEL_SIZES_EVERY - 1:
            source = at_model_sizes(source, i // C_MODEL_SIZES_EVERY)
            gradients = ("numpy", "c")  # (every such program's, on C too)
        failures += exercise(source, ("numpy", "c"), seed=i, seconds=120, stats=stats, gradients=gradients,
                             serving=serving)
        with_c_gradients += stats["gradient runs on c"] > before
    assert stats["runs on c"] > 0
    if every and count >= 30:
        assert stats["serving rows on c"] > 0, stats
    if grad_c and count >= 30:
        assert with_c_gradients > 0, stats
    assert not failures, _report(failures, stats)
