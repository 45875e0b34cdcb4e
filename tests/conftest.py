"""Make tests/reference_impls importable however pytest is started (`python -m pytest tests` or plain
`pytest`), run them on every core (pytest-xdist's workers, when it is installed), and give the session one
kernel cache. linrec itself is imported from the installed package
(`pip install .`, or `pip install -e .` while developing), never from the source folders.

The fuzzer's options (tests/test_fuzz.py, tests/README.md): --fuzz-programs N, --fuzz-c N, --fuzz-grad-every N,
--fuzz-grad-c N, --fuzz-seed S, or the environment variables LINREC_FUZZ_PROGRAMS, LINREC_FUZZ_C,
LINREC_FUZZ_GRAD_EVERY, LINREC_FUZZ_GRAD_C, LINREC_FUZZ_SEED."""
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


WORKERS_AT_MOST = 8  # (each worker holds its own kernels and NumPy: ~0.5 GB)


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist's own, which turns the count into workers)
def pytest_cmdline_main(config):
    """The suite on every core this process may use, one pytest-xdist worker per core (up to WORKERS_AT_MOST),
    when pytest-xdist is installed (the test extra has it) and the command line says nothing of workers:
    half of a serial run's time goes to the C compiler, one process at a time. `-n 0` runs it in this process
    (as --pdb needs); without pytest-xdist it runs here too."""
    if hasattr(config, "workerinput"):
        return  # a worker (pytest-xdist calls this hook in each, with no count of workers: it would start more)
    if getattr(config.option, "numprocesses", "absent") is not None or config.getoption("usepdb", False):
        return  # pytest-xdist absent (or -p no:xdist), or told how many workers, or a debugger wanted
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores > 1:
        config.option.numprocesses = min(cores, WORKERS_AT_MOST)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """One C kernel cache for the whole session (LINREC_CACHE_DIR), its workers' too: every kernel is built
    once, and never into the user's own cache."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's temporary folder is in the run's
        path = tmp_path_factory.getbasetemp().parent / "linrec-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("linrec-cache")
    old = os.environ.get("LINREC_CACHE_DIR")
    os.environ["LINREC_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("LINREC_CACHE_DIR", None)
    else:
        os.environ["LINREC_CACHE_DIR"] = old


def pytest_addoption(parser):
    group = parser.getgroup("linrec fuzzer (tests/test_fuzz.py)")
    group.addoption("--fuzz-programs", type=int, default=None, metavar="N",
                    help="random programs through check and every NumPy form (default: LINREC_FUZZ_PROGRAMS, "
                         "else the CI size in tests/test_fuzz.py)")
    group.addoption("--fuzz-c", type=int, default=None, metavar="N",
                    help="random programs also through the C backend (default: LINREC_FUZZ_C, else the CI size)")
    group.addoption("--fuzz-grad-every", type=int, default=None, metavar="N",
                    help="gradients of one NumPy program in N (default: LINREC_FUZZ_GRAD_EVERY, else the CI "
                         "size; 1: every program)")
    group.addoption("--fuzz-grad-c", type=int, default=None, metavar="N",
                    help="of the C programs, how many with C gradient forms have them checked (default: "
                         "LINREC_FUZZ_GRAD_C, else the CI size)")
    group.addoption("--fuzz-serving-every", type=int, default=None, metavar="N",
                    help="what a serving engine asks (checkpoints, last states, cu_seqlens, the slot pool) of one "
                         "program in N, on the backends it runs on (default: LINREC_FUZZ_SERVING_EVERY, else the CI "
                         "size; 1: every program, 0: none)")
    group.addoption("--fuzz-seed", type=int, default=None, metavar="S",
                    help="the seed of the programs (default: LINREC_FUZZ_SEED, else 0: the same programs every "
                         "run)")
