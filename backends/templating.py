"""The one jinja2 environment every code generator renders its templates (backends/templates/*.j2) with."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

import jinja2


def _template_source(name: str) -> str:
    return resources.files("backends").joinpath("templates").joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    """Strict (an undefined name is an error), with block tags that leave no blank lines behind."""
    return jinja2.Environment(loader=jinja2.FunctionLoader(_template_source), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
