"""The backends the driver knows, by name, and the questions it asks of all of them."""
from __future__ import annotations

from .compiler import Compiled
from .dsl.errors import RuntimeInputError
from .interface import Backend, Refusal
from .c import BACKEND as C
from .numpy import BACKEND as NUMPY
from .stages import Staged

# (each seen through Staged: a program derived in stages runs its parallel and chunkwise forms stage by stage)
BACKENDS: dict[str, Backend] = {b.name: Staged(b) for b in (NUMPY, C)}
STEP = "step"  # the decode step, run token by token (verify and `linrec run --form step`): the recurrent form's


def backend(name: str) -> Backend:
    """The backend of that name, or an error that lists them."""
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):  # (TypeError: a value no dict key can be, such as a list)
        raise RuntimeInputError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


def refusal(compiled: Compiled, backend_name: str, form: str) -> Refusal | None:
    """Why the backend does not build `form` (the decode step: the recurrent form's kernel), or None."""
    return backend(backend_name).why_not(compiled, "recurrent" if form == STEP else form)


def builds(compiled: Compiled, backend_name: str, form: str) -> bool:
    return refusal(compiled, backend_name, form) is None


def building(compiled: Compiled, form: str) -> list[str]:
    """The backends that build `form` of the program (a form can exist before a backend builds it)."""
    return [name for name in BACKENDS if builds(compiled, name, form)]
