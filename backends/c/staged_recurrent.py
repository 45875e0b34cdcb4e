"""The recurrent form's sequences of a program derived in stages (compiler.stages), run stage by stage on the
fused kernel where that kernel takes every stage but not the whole program.

The fused kernel (c.fused) takes a state whose update is a decay plus rank-one terms of values it computes
from the token's inputs; it does not take an update that reads another state (the preconditioned delta rule's
key reads the energy state A). Such a program as written runs its statements one by one (c.statements), each a
loop over a state in memory (the preconditioned delta rule at dk = dv = 64, H = 8, T = 4096: 34–35 ms, against
18–20 ms stage by stage). Its stages are programs of their own — stage 1 computes A and hands
A_t on as an output, stage 2 takes A_t as an input — and where the fused kernel takes each of them, the
sequence runs as one fused kernel per stage, the values handed on passing between them as [B, T, H, *]
arrays: the same recurrence, the states updated in the same order (each stage's states depend only on the
stages before it), to the rounding of a different kernel.

The decode step (one token) stays the statement kernel of the program as written: a step is a handful of
small updates, which the stages would split into two calls and an array per handed value.

    stages = sequence_stages(compiled)      # None: the program runs as written (fused, or its statements)
    staged = StagedSequence(compiled, stages, CRecurrent)
    staged.forward(inputs, params, initial_state, dims, num_threads, out)           # as CRecurrent's
    staged.forward_snapshots(inputs, params, initial_state, dims, stops, num_threads, into)
"""
from __future__ import annotations

from ..compiler import Compiled, stage_compiled
from ..compiler.stages import run_in_order
from . import support
from .stabilize import Scales


def sequence_stages(compiled: Compiled) -> tuple | None:
    """The stages the recurrent form's sequences run in, one fused kernel each: where the program is causal,
    has stages, the fused kernel refuses it as a whole and takes every stage, and no stage carries a stabilized
    state (a log-scale beside the state, which would travel between the stages' calls). Else None."""
    stages = compiled.decomposition.stages
    if not stages or not compiled.program.causal or support.fused_refusal(compiled) is None:
        return None
    for stage in stages:
        one = stage_compiled(compiled, stage)
        if support.fused_refusal(one) is not None or Scales(one).groups:
            return None
    return tuple(stages)


def checks_every_range(compiled: Compiled, stages: tuple) -> bool:
    """Whether the stages' kernels test every declared range of the program's inputs (each kernel tests those
    of its own inputs): an input that no stage reads is left to the driver's scan."""
    read = {x.name: x for stage in stages for x in stage.program.inputs}
    return all(x.name in read and read[x.name] == x for x in compiled.program.inputs
               if x.low is not None or x.high is not None)


class StagedSequence:
    """The stages' recurrent forms (c.backend.CRecurrent, each the fused kernel), run in order: each stage
    takes the program's inputs it reads and the values the stages before it handed on."""

    def __init__(self, compiled: Compiled, stages: tuple, recurrent):
        # (recurrent: CRecurrent, passed in — this module is one that c.backend imports)
        self.stages = stages
        self.modules = tuple(recurrent(stage_compiled(compiled, stage)) for stage in stages)
        self.output_names = tuple(o.name for o in compiled.program.outputs)

    def forward(self, inputs, params, initial_state, dims, num_threads=None, out=None):
        """As CRecurrent.forward: (outputs, final states)."""
        outputs, finals, _ = self._run(inputs, params, initial_state, dims, num_threads, out, None, None)
        return outputs, finals

    def forward_snapshots(self, inputs, params, initial_state, dims, stops, num_threads=None, into=None):
        """As CRecurrent.forward_snapshots: each stage writes the snapshots of its own states."""
        return self._run(inputs, params, initial_state, dims, num_threads, None, stops, into or {})

    def _run(self, inputs, params, initial_state, dims, num_threads, out, stops, into):
        snapshots = {}

        def run(stage, given, used, state0):
            module = self.modules[stage.number - 1]
            if stops is None:
                wanted = {name: out[name] for name in stage.outputs if out and name in out} or None
                return module.forward(given, used, state0, dims, num_threads=num_threads, out=wanted)
            mine = {name: into[name] for name in stage.states if name in into}
            got, ends, kept = module.forward_snapshots(given, used, state0, dims, stops, num_threads=num_threads,
                                                       into=mine)
            snapshots.update(kept)
            return got, ends
        outputs, finals, _ = run_in_order(self.stages, inputs, params, initial_state, run)
        return {name: outputs[name] for name in self.output_names}, finals, snapshots
