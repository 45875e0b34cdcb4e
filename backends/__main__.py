"""`python -m linrec` is the `linrec` command."""
import sys

from .cli import main

sys.exit(main())
