"""The jinja2 environment a backend renders its templates (<backend package>/templates/*.j2) with."""
from __future__ import annotations

from functools import lru_cache
from importlib import resources

import jinja2


@lru_cache(maxsize=None)
def environment(package: str) -> jinja2.Environment:
    """The templates of `package` (a backend's sub-package, e.g. "linrec.c"): strict (an undefined name is an
    error), with block tags that leave no blank lines behind."""
    folder = resources.files(package).joinpath("templates")

    def source(name: str) -> str:
        return folder.joinpath(name).read_text(encoding="utf-8")
    return jinja2.Environment(loader=jinja2.FunctionLoader(source), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
