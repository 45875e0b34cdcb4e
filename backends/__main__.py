"""`python -m linrec` is the `linrec` command."""
import sys

from .command import main

sys.exit(main())
