"""Make tests/reference_impls importable however pytest is started (`python -m pytest tests` or plain
`pytest`), and give the session one kernel cache. linrec itself is imported from the installed package
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


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """One C kernel cache for the whole session (LINREC_CACHE_DIR): every kernel is built once, and
    never into the user's own cache."""
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
    group.addoption("--fuzz-seed", type=int, default=None, metavar="S",
                    help="the seed of the programs (default: LINREC_FUZZ_SEED, else 0: the same programs every "
                         "run)")
