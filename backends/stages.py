"""Programs derived in stages (compiler.stages), run stage after stage on any backend.

A program whose states read each other in one direction has its parallel and chunkwise forms stage by stage:
each stage is a program of its own, whose form the backend builds as it builds any other program's. The
values a stage hands on (a vector state's value, a readout q·S) are per-token outputs of its form and
per-token inputs of the next stage's. `Staged` wraps a backend so that the driver asks it about a staged
program as about any other (registry.BACKENDS are wrapped): which forms it builds (those it builds for every
stage), their source (the stages' in order) and the loaded form (`StagedModule`, which chains the stages'
modules). The backward of a staged form (`StagedGradient`) runs the stages' backwards from the last. The
recurrent form and the decode step run the program as written: they need no stages; so does the recurrent
backward, but where a backend's is derived from the decomposition (which such a program has per stage: the C
backward, `staged_gradient_forms`) it runs stage by stage too.
"""
from __future__ import annotations

import numpy as np

from .compiler import Compiled, stage_compiled
from .dsl.errors import LinrecError
from .interface import Backend, Capabilities, Refusal

STAGED_FORMS = ("parallel", "chunkwise")  # the forms a staged program runs stage by stage


def in_stages(compiled: Compiled, form: str, forms: tuple[str, ...] = STAGED_FORMS) -> bool:
    """The form of this program runs stage after stage (`forms`: those that do, where it has stages)."""
    return bool(compiled.decomposition.stages) and form in forms


class Staged:
    """A backend (interface.Backend) that runs the parallel and chunkwise forms of staged programs stage by
    stage; everything else is the wrapped backend's."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, attribute):  # (emit_gradient, load_gradient, …: the wrapped backend's)
        return getattr(self.inner, attribute)

    def why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if not in_stages(compiled, form):
            return self.inner.why_not(compiled, form)
        why = compiled.decomposition.why_not(form)
        if why:
            return Refusal(f"'{compiled.name}' has no {form} form: {why}")
        for stage in compiled.decomposition.stages:
            refused = self.inner.why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"stage {stage.number} of '{compiled.name}' (state(s) {', '.join(stage.states)}): "
                               f"{refused.reason}", refused.advice)
        return None

    def emit(self, compiled: Compiled, form: str, **options) -> str:
        if not in_stages(compiled, form):
            return self.inner.emit(compiled, form, **options)
        refused = self.why_not(compiled, form)
        if refused:
            _refuse(self.name, compiled, form, refused)
        parts = []
        for stage in compiled.decomposition.stages:
            source = self.inner.emit(stage_compiled(compiled, stage), form, **options)
            parts.append(_comment(source, _header(stage)) + "\n" + source)
        return "\n\n".join(parts)

    def load(self, compiled: Compiled, form: str):
        if not in_stages(compiled, form):
            return self.inner.load(compiled, form)
        refused = self.why_not(compiled, form)
        if refused:
            _refuse(self.name, compiled, form, refused)
        stages = compiled.decomposition.stages
        return StagedModule(form, compiled, tuple(self.inner.load(stage_compiled(compiled, s), form) for s in stages))

    def recurrent_kernel(self, compiled: Compiled) -> str:
        return self.inner.recurrent_kernel(compiled)

    # ---- gradients: the stages' backwards in reverse stage order (docs/gradients.md) ----
    def gradient_in_stages(self, compiled: Compiled, form: str) -> bool:
        """The backward of this form runs stage by stage: the wrapped backend's backwards of that form are
        derived from the decomposition (`staged_gradient_forms`; the parallel and chunkwise ones by default)."""
        return in_stages(compiled, form, getattr(self.inner, "staged_gradient_forms", STAGED_FORMS))

    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if not self.gradient_in_stages(compiled, form):
            return self.inner.gradient_why_not(compiled, form)
        refused = self.why_not(compiled, form)  # (the backward of a form needs the form)
        if refused:
            return refused
        for stage in compiled.decomposition.stages[:-1]:  # (the backward runs these stages' forwards)
            refused = self.inner.why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"stage {stage.number} of '{compiled.name}' (state(s) {', '.join(stage.states)}): "
                               f"{refused.reason}", refused.advice)
        for stage in compiled.decomposition.stages:
            refused = self.inner.gradient_why_not(stage_compiled(compiled, stage), form)
            if refused:
                return Refusal(f"'{compiled.name}' runs its {form} backward in stages, and the {form} backward of "
                               f"stage {stage.number} (state(s) {', '.join(stage.states)}) is not derived: "
                               f"{refused.reason}", refused.advice or
                               "the recurrent backward (form='recurrent') differentiates the program as written")
        return None

    def emit_gradient(self, compiled: Compiled, form: str) -> str:
        if not self.gradient_in_stages(compiled, form):
            return self.inner.emit_gradient(compiled, form)
        parts = []
        for stage in reversed(compiled.decomposition.stages):
            source = self.inner.emit_gradient(stage_compiled(compiled, stage), form)
            parts.append(_comment(source, f"backward of {_header(stage)}") + "\n" + source)
        return "\n\n".join(parts)

    def load_gradient(self, compiled: Compiled, form: str):
        if not self.gradient_in_stages(compiled, form):
            return self.inner.load_gradient(compiled, form)
        refused = self.gradient_why_not(compiled, form)
        if refused:
            raise LinrecError(f"the {self.name} backend does not build the {form} backward of '{compiled.name}': "
                              f"{refused}")
        stages = compiled.decomposition.stages
        forwards = tuple(self.inner.load(stage_compiled(compiled, s), form) for s in stages[:-1])
        backwards = tuple(self.inner.load_gradient(stage_compiled(compiled, s), form) for s in stages)
        return StagedGradient(form, compiled, forwards, backwards)


def _refuse(backend: str, compiled: Compiled, form: str, refused: Refusal):
    """(The driver asks why_not before it emits or loads: this is for direct callers.)"""
    raise LinrecError(f"the {backend} backend does not build the {form} form of '{compiled.name}': {refused}")


def _header(stage) -> str:
    takes = f"; takes {', '.join(stage.takes)}" if stage.takes else ""
    hands = f"; hands on {'; '.join(h.text() for h in stage.hands)}" if stage.hands else ""
    return f"stage {stage.number}: state(s) {', '.join(stage.states)}{takes}{hands}"


def _comment(source: str, text: str) -> str:
    """`text` as a comment of the source's language (C's opens with /*, Python's does not)."""
    return f"/* ==== {text} ==== */" if source.lstrip().startswith("/*") else f"# ==== {text} ===="


class StagedModule:
    """A form of a staged program: the stages' modules run in order, each given the values the earlier ones
    handed on as inputs; the outputs and final states are gathered from the stages that compute them."""

    def __init__(self, form: str, compiled: Compiled, modules: tuple):
        self.form = form
        self.stages = compiled.decomposition.stages
        self.modules = modules
        self.output_names = tuple(o.name for o in compiled.program.outputs)
        counts = [m.capabilities.largest_count for m in modules if m.capabilities.largest_count is not None]
        # (ranges: the driver checks the program's inputs; zero states: the driver makes them, per stage here)
        self.capabilities = Capabilities(largest_count=min(counts) if counts else None)

    def forward(self, inputs: dict, params: dict, initial_state: dict | None, dims: dict[str, int],
                chunk_size: int | None = None) -> tuple[dict, dict]:
        values = dict(inputs)
        outputs, final = {}, {}
        for stage, module in zip(self.stages, self.modules):
            given, used, state0 = stage_arguments(stage, values, params, initial_state)
            out, ends = module.forward(given, used, state0, dims, chunk_size=chunk_size)
            values.update((h.name, out[h.name]) for h in stage.hands)
            outputs.update((name, out[name]) for name in stage.outputs)
            final.update((s.name, ends[s.name]) for s in stage.program.states)
        return {name: outputs[name] for name in self.output_names}, final


def stage_arguments(stage, values: dict, params: dict, initial_state: dict | None) -> tuple[dict, dict, dict | None]:
    """A stage's inputs (the program's and those handed to it), params and initial states (None: none given)."""
    program = stage.program
    state0 = None if initial_state is None else \
        {s.name: initial_state[s.name] for s in program.states if s.name in initial_state}
    return ({x.name: values[x.name] for x in program.inputs},
            {p.name: params[p.name] for p in program.params if p.name in params}, state0)


class StagedGradient:
    """The backward of a staged form. The forward runs the stages but the last in order, for the values each
    hands on; then the stages' backwards run from the last: a stage's backward gives, besides the gradients of
    its inputs, params and initial states, the gradients of the values earlier stages handed it, which are
    upstream gradients of those stages' outputs of the same name (added to what the program's outputs there
    get, and summed over the stages that take them). A param several stages use gets the sum of their
    gradients (a default computed from other params passes each stage's share on: the chain rule is linear
    in it)."""

    def __init__(self, form: str, compiled: Compiled, forwards: tuple, backwards: tuple):
        self.form = form
        self.program = compiled.program
        self.stages = compiled.decomposition.stages
        self.forwards = forwards
        self.backwards = backwards

    def backward(self, inputs: dict, params: dict, initial_state: dict, dims: dict[str, int], grad_outputs: dict,
                 grad_final_state: dict, derived_params=(), chunk_size: int | None = None):
        values = dict(inputs)  # the program's inputs and the values the stages hand on
        for stage, module in zip(self.stages, self.forwards):
            out, _ = module.forward(*stage_arguments(stage, values, params, initial_state), dims,
                                    chunk_size=chunk_size)
            values.update((h.name, out[h.name]) for h in stage.hands)
        upstream = dict(grad_outputs)  # the program's outputs' gradients, and those of the values handed on
        outputs, final, grads = {}, {}, {}
        for stage, module in zip(reversed(self.stages), reversed(self.backwards)):
            program = stage.program
            given, used, state0 = stage_arguments(stage, values, params, initial_state)
            seeds = {o.name: upstream.get(o.name) for o in program.outputs}
            for name, seed in seeds.items():
                if seed is None:  # (a value handed on that no later stage's gradient reached: none does)
                    seeds[name] = np.zeros_like(values[name])
            ends = {s.name: grad_final_state[s.name] for s in program.states if s.name in grad_final_state}
            derived = tuple(p.name for p in program.params if p.name in derived_params)
            out, fin, got = module.backward(given, used, state0, dims, seeds, ends, derived, chunk_size=chunk_size)
            outputs.update((name, out[name]) for name in stage.outputs)
            final.update(fin)
            for name, g in got.items():
                target = upstream if name in stage.takes else grads
                target[name] = g if name not in target else target[name] + g
        # an input, param or initial state no stage reads has gradient zero (the stages' modules list only theirs)
        for given in (inputs, params, initial_state):
            for name, value in given.items():
                grads.setdefault(name, np.zeros(np.shape(value), np.result_type(value, np.float32)))
        order = [x.name for x in self.program.inputs] + [p.name for p in self.program.params] + \
            [s.name for s in self.program.states]
        grads = {name: grads[name] for name in order if name in grads}
        return {o.name: outputs[o.name] for o in self.program.outputs}, \
            {s.name: final[s.name] for s in self.program.states}, grads


