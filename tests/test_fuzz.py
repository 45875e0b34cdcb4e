"""The fuzzer (tests/fuzzing.py) in the test suite: random programs over the grammar — generated ones, and
mutations of the example files — each under a time limit, through `check`, every form `check` lists on
NumPy (and, for a sample, on C: the recurrent form, the decode step, form="auto" and a scan form), against
the float64 reference form within verify's tolerance. A failure lists each class of problem with the
programs that show it.

Default size (this CI run): DEFAULT_PROGRAMS programs on NumPy in batches of BATCH, DEFAULT_C of them also
on C (a C kernel costs ~0.5 s to build). Longer runs:

    python -m pytest tests/test_fuzz.py --fuzz-programs 20000 --fuzz-c 300 --fuzz-seed 7
    LINREC_FUZZ_PROGRAMS=20000 python -m pytest tests/test_fuzz.py
    python tests/fuzzing.py 20000 --c 300 --seed 7        # the same, as a report of failure classes
"""
from __future__ import annotations

import os

import pytest

from fuzzing import COMMAND_LINE_EVERY, Stats, exercise, programs, summarize

DEFAULT_PROGRAMS = 3000
DEFAULT_C = 32
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
    if "c_batch" in metafunc.fixturenames:
        count = _option(config, "--fuzz-c", "LINREC_FUZZ_C", DEFAULT_C)
        seed = _option(config, "--fuzz-seed", "LINREC_FUZZ_SEED", 0)
        metafunc.parametrize("c_batch", [(seed * 1_000_003 + 999_999, count)], ids=[f"c{count}"])


def _report(failures, stats) -> str:
    shown, lines = {}, [summarize(failures), "", f"covered: {dict(stats)}"]
    for f in failures:
        key = (f.kind, f.message.splitlines()[0][:60])
        if shown.setdefault(key, 0) < SHOWN:
            shown[key] += 1
            lines += ["", str(f)]
    return "\n".join(lines)


def test_random_programs_on_numpy(numpy_batch):
    """A batch of programs through check and every form it lists on NumPy (T = 12, small sizes); one in
    COMMAND_LINE_EVERY through `linrec check` and `linrec run` as well."""
    seed, count = numpy_batch
    failures, stats = [], Stats()
    for i, source in enumerate(programs(count, seed)):
        failures += exercise(source, ("numpy",), seed=i, seconds=20, stats=stats,
                             command_line=i % COMMAND_LINE_EVERY == 0)
    assert stats["programs"] == count
    assert stats["accepted"] > count // 2, f"the generator should mostly write programs check accepts: {stats}"
    assert not failures, _report(failures, stats)


def test_random_programs_on_c(c_batch):
    """Programs of their own seed through the C backend too: its recurrent form, decode step, form="auto"
    and one scan form, where check lists them (each build ~0.5 s: a time limit of 120 s per program)."""
    seed, count = c_batch
    if count == 0:
        pytest.skip("--fuzz-c 0")
    failures, stats = [], Stats()
    for i, source in enumerate(programs(count, seed)):
        failures += exercise(source, ("numpy", "c"), seed=i, seconds=120, stats=stats)
    assert stats["runs on c"] > 0
    assert not failures, _report(failures, stats)
