"""The recurrent form of a recurrence as a NumPy module, statement by statement as the user wrote them: the
definition every other form is checked against."""
from __future__ import annotations

from ..compiler import Compiled, ir
from .emitter import Emitter


def emit_statements(compiled: Compiled) -> str:
    """The recurrent form, statement by statement as the user wrote them: the living definition."""
    em = Emitter(compiled)
    p, n = em.p, em.name
    helpers: set[str] = set()
    prelude = em.printer(None)
    loop = em.printer("t")
    body = em.prologue()
    body += em.hoisted_lets(prelude, "values that do not depend on a state, for all tokens at once")
    body += ["", "# states [B, H, *]"]
    body += [f"{n(s.name)} = initial_state[\"{s.name}\"]" for s in p.states]
    body += em.output_alloc()

    def step_lines(steps, with_outputs=True, with_updates=True):
        lines = []
        for step in steps:
            if isinstance(step, ir.Let) and step.name not in em.hoisted:
                lines.append(f"{n(step.name)} = {loop(step.value)}")
            elif isinstance(step, ir.Update) and with_updates:
                lines.append(f"# {step.state}: {compiled.decomposition.transition(step.state).kind}")
                lines.append(f"{n(step.state)} = {loop(step.value)}")
            elif isinstance(step, ir.Output) and with_outputs:
                lines.append(f"{n(step.name)}[:, t] = {loop(step.value)}")
        return lines

    if p.causal:
        body += ["", "for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps)]
    else:
        body += ["", "# non-causal: every output reads the final state, so run the updates first",
                 "for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps, with_outputs=False)]
        body += ["for t in range(tokens):"] + ["    " + x for x in step_lines(p.steps, with_updates=False)]
    body += ["", em.returns()]
    helpers |= prelude.helpers | loop.helpers
    return em.render("recurrent", body, helpers)
