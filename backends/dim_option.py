"""The --dim NAME=SIZE option of `linrec run`, `bench` and `emit`: the sizes a program runs at (or C compiles)."""
from __future__ import annotations

from collections.abc import Iterable

from .compiler.resolve import SIZE_LIMIT, too_large
from .dsl.errors import LinrecError


def dims_with_overrides(program, overrides: Iterable[tuple[str, int]],
                        preset: dict[str, int] | None = None) -> dict[str, int]:
    """The file's default sizes, then `preset` for the dimensions the file declares (bench's dk = dv = 64),
    then `overrides`, the (name, size) pairs of --dim: a name the file does not declare is an error."""
    declared = {dim.name: dim.default for dim in program.dims}
    dims = declared | {name: size for name, size in (preset or {}).items() if name in declared}
    for name, size in overrides:
        if name not in declared:
            raise LinrecError(f"--dim {name}={size}: '{program.name}' has no dimension '{name}'; its dimensions "
                              f"are {', '.join(declared) or 'none'}")
        if size > SIZE_LIMIT:
            raise LinrecError(too_large(f"--dim {name}={size}"))
        dims[name] = size
    return dims
