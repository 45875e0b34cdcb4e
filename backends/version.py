"""linrec's version, from the installed package's metadata (generated files and the kernel cache's keys
carry it)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("linrec")
except PackageNotFoundError:  # imported from a source tree that was never installed
    VERSION = "0+unknown"
