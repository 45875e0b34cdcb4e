"""The linrec DSL: grammar, parser and syntax tree with source spans."""
from .errors import LinrecError, RuntimeInputError, Span
from .parser import parse

__all__ = ["LinrecError", "RuntimeInputError", "Span", "parse"]
