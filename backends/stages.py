"""Programs derived in stages (compiler.stages), run stage after stage on any backend.

A program whose states read each other in one direction has its parallel and chunkwise forms stage by stage:
each stage is a program of its own, whose form the backend builds as it builds any other program's. The
values a stage hands on (a vector state's value, a readout q·S) are per-token outputs of its form and
per-token inputs of the next stage's. `Staged` wraps a backend so that the driver asks it about a staged
program as about any other (registry.BACKENDS are wrapped): which forms it builds (those it builds for every
stage), their source (the stages' in order) and the loaded form (`StagedModule`, which chains the stages'
modules). The recurrent form, the decode step and the recurrent backward run the program as written: they
need no stages.
"""
from __future__ import annotations

from .compiler import Compiled, stage_compiled
from .dsl.errors import LinrecError
from .interface import Backend, Capabilities, Refusal

STAGED_FORMS = ("parallel", "chunkwise")  # the forms a staged program runs stage by stage


def in_stages(compiled: Compiled, form: str) -> bool:
    """The form of this program runs stage after stage."""
    return bool(compiled.decomposition.stages) and form in STAGED_FORMS


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

    def gradient_why_not(self, compiled: Compiled, form: str) -> Refusal | None:
        if in_stages(compiled, form) and not compiled.decomposition.why_not(form):
            return Refusal(f"'{compiled.name}' runs its {form} form in stages, whose backward is not derived",
                           "the recurrent backward (form='recurrent') differentiates the program as written")
        return self.inner.gradient_why_not(compiled, form)


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
            program = stage.program
            given = {x.name: values[x.name] for x in program.inputs}
            used = {p.name: params[p.name] for p in program.params if p.name in params}
            state0 = None if initial_state is None else \
                {s.name: initial_state[s.name] for s in program.states if s.name in initial_state}
            out, ends = module.forward(given, used, state0, dims, chunk_size=chunk_size)
            values.update((h.name, out[h.name]) for h in stage.hands)
            outputs.update((name, out[name]) for name in stage.outputs)
            final.update((s.name, ends[s.name]) for s in program.states)
        return {name: outputs[name] for name in self.output_names}, final
