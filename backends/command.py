"""The `linrec` command's entry point (`[project.scripts]` and `python -m linrec`).

It imports nothing heavy itself: the command line (linrec.cli) imports NumPy, lark, jinja2 and the compiler,
which takes most of a second, and a Ctrl-C in that time would otherwise print a KeyboardInterrupt traceback.
Here it prints `linrec: interrupted` and exits with status 130, as at every other moment (cli.main).
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from . import cli  # (deferred: inside the try, so that a Ctrl-C while it imports is caught)

        return cli.main(argv)
    except KeyboardInterrupt:  # (while importing, or before cli.main's own handling begins)
        print("linrec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
