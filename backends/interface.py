"""What a backend is: the questions the driver asks one, and what a loaded form says about itself.

A backend turns a compiled program (linrec.compiler.Compiled) into code that runs one of its forms. The
driver — the API, the command line, verify, bench, the automatic choice of form — knows backends only
through `Backend` below; the NumPy backend (linrec.numpy) and the C backend (linrec.c) each provide one
object that implements it, and linrec.registry lists them. A loaded form is a `FormModule`, whose
`capabilities` declare what it does itself, so that the driver does not do it twice (or probe for it).

    backend.why_not(compiled, "chunkwise")   # None: it builds the form; else a Refusal (reason, advice)
    backend.emit(compiled, "chunkwise")      # the generated source, for people to read
    module = backend.load(compiled, "chunkwise")
    module.forward(inputs, params, initial_state, dims, chunk_size=64)   # → (outputs, final states)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .compiler import FORMS, Compiled

# The statements exactly as written, also where the recurrent form is stabilized (exponential feature maps,
# carried as S·exp(−M)): verify's reference for such programs, so that the stabilized forms are checked
# against something other than themselves. Only the NumPy backend builds it; it is no form a user picks.
DEFINITION = "definition"

# How a backend runs a program's recurrent form (Backend.recurrent_kernel)
FUSED = "fused"                        # one compiled kernel, the state in registers: no per-token overhead
STATEMENTS = "statement by statement"  # one compiled kernel running the statements as written
SCAN = "scan"                          # per-token arrays prepared in NumPy, a compiled scan over them
INTERPRETED = "interpreted"            # Python runs the token loop


@dataclass(frozen=True)
class Refusal:
    """Why a backend does not build a form of a program. `reason` says what in the program is in the way,
    `advice` what to do instead (another backend, another form); kept apart so that a caller can quote
    the reason inside a sentence of its own."""

    reason: str
    advice: str = ""

    def __str__(self) -> str:
        return self.reason + (f"; {self.advice}" if self.advice else "")


@dataclass(frozen=True)
class Capabilities:
    """What a loaded form does itself (declared by the backend, read by the driver)."""

    checks_ranges: bool = False       # forward() tests the inputs' declared ranges: the driver need not scan
    zero_states: bool = False         # forward(initial_state=None) starts from zeros: no arrays to make
    binds_steps: bool = False         # stepper(params, dims): a compiled decode step bound to arrays
    decodes_over_cache: bool = False  # (a program that reads the sequence) its step runs in compiled kernels
    largest_count: int | None = None  # the most batch rows, tokens or heads one call may have (None: no limit)
    snapshots: bool = False           # forward_snapshots(…, stops): also the states after given token counts
    steps_slots: bool = False         # slot_step(params, dims): the decode step over a pool of states, by slot
    bfloat16_steps: bool = False      # stepper/slot_step(…, state_is_bf16=True): the step's states in bfloat16


class FormModule(Protocol):
    """One form of one program, loaded: what Backend.load returns."""

    form: str
    capabilities: Capabilities

    def forward(self, inputs: dict[str, np.ndarray], params: dict[str, np.ndarray],
                initial_state: dict[str, np.ndarray] | None, dims: dict[str, int],
                chunk_size: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Inputs [B, T, H, *], params (per-head ones [H, *]), initial states [B, H, *] (not modified) →
        (outputs [B, T, H, *], final states [B, H, *])."""
        ...


class Backend(Protocol):
    """The questions the driver asks a backend."""

    name: str
    compiles_sizes: bool  # True: emit(compiled, form, dims=…) gives the code at those sizes (C's kernels)

    def why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        """None when this backend builds `form` of the program, else why not. Answered from the program's
        structure, without generating code."""
        ...

    def emit(self, compiled: Compiled, form: str) -> str:
        """The generated source of a form (at the program's default sizes where the code depends on them; a
        backend that compiles_sizes also takes dims=, every dimension's size)."""
        ...

    def load(self, compiled: Compiled, form: str) -> FormModule:
        """The form, ready to run (compiled code is built lazily, at the first call with given sizes)."""
        ...

    def recurrent_kernel(self, compiled: Compiled) -> str:
        """How this backend runs the program's recurrent form: FUSED, STATEMENTS, SCAN or INTERPRETED."""
        ...

    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        """None when this backend builds the backward of `form` (docs/gradients.md), else why not. A backend
        that builds one also has emit_gradient(compiled, form) → source and load_gradient(compiled, form) →
        a module whose backward(inputs, params, initial_state, dims, grad_outputs, grad_final_state,
        derived_params, chunk_size) returns (outputs, final states, gradients by name)."""
        ...


def no_such_form(compiled: Compiled, form: str) -> Refusal | None:
    """The refusal every backend shares: a form the program does not have (None: it has it)."""
    if form not in FORMS:
        return Refusal(f"there is no {form} form; the forms are {', '.join(FORMS)}")
    why = compiled.decomposition.why_not(form)
    if why:
        return Refusal(f"'{compiled.name}' has no {form} form: {why}")
    if compiled.decomposition.stages and form != "recurrent":  # (no backend derives it from the whole program)
        return Refusal(f"'{compiled.name}' runs its {form} form in stages, each stage a program of its own",
                       "linrec.stages runs them (the backends of linrec.registry)")
    return None
