"""The C source of the recurrent form and the decode step of a factorable recurrence (decay + rank-one
corrections + rank-one writes, see compiler.transitions): templates/c_fused.c.j2 rendered for one scalar
type, one SIMD width and one assignment of sizes (dk, dv, … are compile-time constants). c.backend builds
and runs what it renders.

FusedKernel plans the file — the state buffers, the block arrays and how many tokens a block holds, the
segments of the thread scheduling, the stabilized states' scales —, and takes the rest from the modules of
the plan, records of fused_plan.py all:

    state_terms.py    the terms of a state's update (decay, corrections, groups of writes) and its readouts
    block_region.py   the sequence kernel's block of tokens of one head: phase 1's block arrays and lazy
                      decays, each state's pass, the outputs streamed from a tile loop, phase 3
    step_region.py    the decode step's token of one head
    passes.py         tile shapes, register budgets and the unrolled statements of the passes over a state"""
from __future__ import annotations

from math import prod

from ..compiler import Compiled, ir
from ..dsl.errors import LinrecError
from ..version import VERSION

from .block_region import block_region
from .build import CTYPE_BYTES
from .fused_plan import BlockArray, ScaleGroup, ScaleStart, StateBuffers
from .kernel_source import STEP_PARALLEL_THRESHOLD, KernelSource, Target
from .printer import UnprintableError, read_only_through_readouts
from .stabilize import Scales
from .step_region import step_region
from .support import fused_refusal
from .value_split import split_refusal, value_axis

# The per-token values of a block of tokens (the sequence kernel's unit of work) should fit in L1 beside
# the state: the block holds as many tokens (8…64) as fit in this many bytes.
BLOCK_BYTES = 24 * 1024
# Multiply-adds a thread runs of one head before it looks for the head furthest behind (see lr_claim).
SEGMENT_WORK = 1 << 21
SPLIT_ALWAYS = False  # tests set it: every segment end splits a group of heads (lr_release)
# Multiply-adds a part of a decode step should have at least to go to a helper thread (LR_POOL_PART_WORK in
# c_step_pool.h.j2): a smaller step runs on the caller alone (tests lower it to run tiny steps in parts).
POOL_PART_WORK = 1 << 17


def token_work(compiled: Compiled, dims: dict[str, int]) -> int:
    """Multiply-adds of one token of one (batch row, head), as the kernels' thread rules count them: per
    value of the states, two for the update and one per readout."""
    values = sum(prod(dims[d] for d in s.shape) for s in compiled.program.states)
    return values * (2 + len(compiled.decomposition.readouts))


class FusedKernel(KernelSource):
    """The fused kernels' source for one (dtype, sizes): context() is the template's."""

    template = "c_fused.c.j2"
    writes_snapshots = True
    steps_slots = True

    def __init__(self, compiled: Compiled, dims: dict[str, int], target: Target, state_is_bf16: bool = False,
                 parts: int = 1):
        """state_is_bf16: the decode steps keep the states in bfloat16; parts > 1: a kernel whose unit of work
        is a (batch row, head, part of the value axis), `dims` the caller's sizes (the value axis whole);
        value_split.py says which programs allow it."""
        refusal = fused_refusal(compiled)  # (what this kernel takes is support.py's to say)
        if refusal:
            raise LinrecError(refusal)
        if state_is_bf16 and target.ctype != "float":
            raise LinrecError("a bfloat16 state is accumulated in float32: the kernel's type must be float")
        if parts > 1:
            axis = value_axis(compiled)  # (None: it cannot be split, and split_refusal says why)
            if axis is None:
                raise LinrecError(f"the value axis of '{compiled.name}' cannot be split: {split_refusal(compiled)}")
            if dims[axis] % parts or (dims[axis] // parts) % target.lanes:
                raise LinrecError(f"{axis} = {dims[axis]} is no {parts} parts of whole {target.lanes}-lane registers")
            dims = dims | {axis: dims[axis] // parts}
            self.value_dim, self.value_parts = axis, parts
        super().__init__(compiled, dims, target)
        self.state_is_bf16 = state_is_bf16  # the decode steps' states are bfloat16 bits (lr_step_heads)
        # … read and written as bits by the step's own passes, when every matrix state's row is a whole number
        # of registers (else widened into a float32 scratch: the columns past the last register run the float32
        # step's scalar loop, whose sums only that very loop reproduces bit for bit)
        self.bf16_in_pass = state_is_bf16 and all(
            len(st.shape) == 1 or self.dims[st.shape[1]] % target.lanes == 0 for st in self.program.states)
        self.scales = Scales(compiled)  # exponential feature maps: states carried as S·exp(−σ)

    def array_names(self) -> tuple[list[str], int]:
        names, n_read = super().array_names()
        at = n_read + len(self.program.states)  # stabilized states' log-scales after the states
        return names[:at] + [f"lsc{g}" for g in range(len(self.scales.groups))] + names[at:], n_read

    # ---- leaves ----
    def ref(self, node: ir.Expr) -> str:
        if isinstance(node, ir.ReadoutRef):
            return f"r{node.index}"
        if isinstance(node, ir.StateRef):  # (support.fused_refusal refuses such programs)
            raise UnprintableError(f"the fused kernel reads {read_only_through_readouts(node.name)}, not as a "
                                   f"value of its own")
        return super().ref(node)

    # ---- the whole file ----
    def _forward_regions(self, groups: list[ScaleGroup]):
        if self.program.causal:
            return [block_region(self, self.scales, groups, "", updates=True, readouts=True)]
        # non-causal: every output reads the final state, so run the updates first
        return [block_region(self, self.scales, groups, "", updates=True, readouts=False),
                block_region(self, self.scales, groups, "n", updates=False, readouts=True)]

    def context(self) -> dict:
        groups = self._scale_groups()
        forward_regions = self._forward_regions(groups)
        step = step_region(self, self.scales, groups) if self.steps else None
        scale_rows = {name: n for r in forward_regions for name, n in r.scale_rows.items()}
        block_tokens = self._block_tokens(forward_regions)
        if self.value_parts > 1:
            # the whole head's: where a block starts decides which tokens of a pass over a state with
            # corrections go in pairs and which p the first pass of a block sums anew, so a part of the value
            # axis runs its tokens in the whole head's blocks (c.value_split: the same operations in the same
            # order). Its own per-token values are fewer: the block fits where the whole head's does.
            whole = FusedKernel(self.compiled, self.dims | {self.value_dim: self.dims[self.value_dim] * self.value_parts},
                                self.target, self.state_is_bf16)
            block_tokens = whole._block_tokens(whole._forward_regions(whole._scale_groups()))
        block_arrays, block_floats = self._block_buffer(forward_regions, block_tokens)
        # a segment (what a thread runs of a head before it looks for another, see lr_claim): whole blocks,
        # enough multiply-adds (~2M, tens of µs) that claiming a head and moving its state cost little
        work = token_work(self.compiled, self.dims)
        segment_tokens = block_tokens
        while segment_tokens * work < SEGMENT_WORK and segment_tokens < 8192:
            segment_tokens *= 2
        inputs, outputs = self.input_arrays(), self.output_arrays()
        states = [self._state_buffers(s, scale_rows.get(s.name, 0)) for s in self.program.states]
        return dict(
            name=self.program.name, version=VERSION, filename=self.compiled.filename,
            source_comment=self.source_comment(), **self.common(),
            dims=[(d.name, self.dims[d.name]) for d in self.program.dims],
            inputs=inputs, outputs=outputs, states=states, scales=groups,
            forward_regions=forward_regions, step_region=step,
            block_tokens=block_tokens, block_arrays=block_arrays, block_floats=block_floats,
            segment_tokens=segment_tokens, split_always=SPLIT_ALWAYS, pool_part_work=POOL_PART_WORK,
            value_parts=self.value_parts,
            # the next block's rows noted in phase 1 and prefetched by the tiled passes (lr_prefetch_row)
            notes_rows=any(r.notes_rows for r in forward_regions),
            rows_alike=len({x.prefetch_lines for x in inputs}) == 1 and len({x.size for x in inputs}) == 1,
            state_values=" + ".join(str(s.kept_size) for s in states) or "1",
            # lr_forward's allocations of every head's states and scales
            buffers=[b for s in states for b in [s.every_head] + ([s.every_scale] if s.scale_rows else [])]
            + [f"all_ls{sc.index}" for sc in groups],
            step_work=work, step_parallel_threshold=STEP_PARALLEL_THRESHOLD,
            state_is_bf16=self.state_is_bf16, bf16_in_pass=self.bf16_in_pass, bf16_scratch=self._bf16_scratch(states),
            **self.entry_points(),
        )

    def _bf16_scratch(self, states: list[StateBuffers]) -> tuple[dict[str, int], int]:
        """Where each state's float32 copy lies in a decode step's scratch (bfloat16 states not stepped in the
        passes: lr_step_heads steps a head's states there), each on a cache line, and the scratch's values."""
        at, offset = {}, 0
        for s in states:
            at[s.name] = offset
            offset += -(-s.size // 16) * 16
        return at, max(offset, 16)

    @staticmethod
    def _block_sizes(regions) -> dict[str, int]:
        """Each block array's values per token (0: a scalar)."""
        return {name: n for r in regions for name, n in r.arrays}

    def _block_tokens(self, regions) -> int:
        """The tokens of a block (LR_BLOCK): as many as 8…64 whose per-token values fit in BLOCK_BYTES, at least
        a tiled pass's tile of registers, 64 with a pass strip by strip."""
        sizes = self._block_sizes(regions)
        per_token = sum(max(n, 1) for n in sizes.values()) * CTYPE_BYTES[self.target.ctype]
        # a pass strip by strip (passes.strip_registers) copies each strip in and out once per block and reads
        # the block arrays from L2 anyway: the longest block (d = 256: 64 tokens 1.2× faster than 16)
        strips = any(p.kind == "tokens" and p.strip for r in regions for p in r.passes)
        # a tiled pass loads and stores each tile once per block, and prefetches the next tile one register a
        # token (`u < registers`): a block shorter than a tile's registers leaves part of the next tile to wait
        # on L2 and spreads the loads over fewer tokens (GLA, d = 128 and 256: 16 tokens 1.02-1.14× faster
        # than the 8 that fit BLOCK_BYTES; the tiled pass reads only its columns' slices of y and of the sums)
        tile_registers = max((t.registers for r in regions for p in r.passes if p.kind == "tiled"
                              for t in (p.main, p.tail) if t), default=0)
        block_tokens = 64 if strips else 8
        while block_tokens < 64 and (2 * block_tokens * per_token <= BLOCK_BYTES or block_tokens < tile_registers):
            block_tokens *= 2
        return block_tokens

    def _block_buffer(self, regions, block_tokens: int) -> tuple[list[BlockArray], int]:
        """The block arrays of every region in one allocation per thread, each on a cache line, and its values."""
        flags = set().union(*(r.flag_arrays for r in regions))
        align = 64 // CTYPE_BYTES[self.target.ctype]
        arrays, offset = [], 0
        for name, n in self._block_sizes(regions).items():
            arrays.append(BlockArray(name, n, offset, name in flags))
            offset += -(-block_tokens * max(n, 1) // align) * align
        return arrays, max(offset, 1)

    def _state_buffers(self, st: ir.State, scale_rows: int) -> StateBuffers:
        """A state's buffers in lr_forward: every head's (rows padded to whole registers) and this head's, and
        its lazy decay's (on whole cache lines: threads write them)."""
        c = self.cstate(st.name)
        matrix = len(st.shape) == 2
        cols = self.dims[st.shape[1]] if matrix else 1
        align = 64 // CTYPE_BYTES[self.target.ctype]
        return StateBuffers(
            st.name, c, matrix, self.dims[st.shape[0]], cols, self.padded(cols) if matrix else 1,
            every_head=self.local("all", c), buffer=self.local("buf", c), every_scale=self.local("all", "sc", c),
            scale=self.local("sc", c), scale_rows=scale_rows, scale_stride=-(-scale_rows // align) * align,
            parts=self.value_parts)

    def _scale_groups(self) -> list[ScaleGroup]:
        """Per group of stabilized states: its C names, and where its σ and M start (the test that states
        given at their true scale are all zero reads the states' arrays)."""
        out = []
        for g, gr in enumerate(self.scales.groups):
            names = ", ".join(gr["states"])

            def all_zero(at: str) -> str:
                sizes = [(self.cstate(n), self.size(self.program.state(n).shape)) for n in gr["states"]]
                return " && ".join(f"lr_all_zero({c} + (size_t)({at}) * {n}, {n})" for c, n in sizes)
            out.append(ScaleGroup(
                g, f"lsc{g}", names,
                at_start=ScaleStart(names, f"lsc{g}[bh]", f"all_ls{g}[bh * 16]", f"all_ls{g}[bh * 16 + 1]",
                                    all_zero("bh")),
                at_token=ScaleStart(names, f"lsc{g}[row]", f"ls{g}", f"mx{g}", self._buffers_zero(gr["states"]))))
        return out

    def _buffers_zero(self, states: list[str]) -> str:
        """C for "the step's buffers of these states are all zero" (a head's states where the step holds them:
        its rows of the caller's arrays — a matrix state's bits when the passes step bfloat16 states —, or
        their float32 copy when the states are bfloat16)."""
        def zero(name: str) -> str:
            st = self.program.state(name)
            bits = self.bf16_in_pass and len(st.shape) == 2
            return f"lr_{'bf16_' if bits else ''}all_zero({self.local('buf', self.cstate(name))}, {self.size(st.shape)})"
        return " && ".join(zero(n) for n in states)
