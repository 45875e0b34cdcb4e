"""The sequence kernel's unit of work, one block of tokens of one head (fused_plan.BlockRegion), in three
phases: (1) every state-free value of every token of the block into block arrays, with the bookkeeping of
lazily applied decays; (2) the passes over the states; (3) the outputs, from the readouts.

A decayed matrix state is kept as Ŝ = S/c with its decay applied lazily: phase 1 updates c ← c·D per token
and stores the vectors that meet Ŝ times their factor (x/c for the writes' left vectors, q⊙c for the
queries), so that phase 2 does one multiply-add per element fewer. Should c leave its range (or D be
negative), the token is slow: it applies c·D to the rows instead and c restarts at 1."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..compiler import ir
from ..compiler.analysis import walk
from ..compiler.linearity import ONE

from .fused_plan import (BlockRegion, BlockVectorPass, CorrectionDot, CorrectionOperands, LazyStore, OutputRow,
                         RangeCheck, RightVector, RowsLazyDecay, ScalarLazyDecay, ScaleGroup, TokenPair, TokenPass,
                         TokenUpdate, VectorRead)
from .kernel_source import InputArray, KernelSource
from .passes import (STRIP_COPY_BYTES, Decay, MatrixOperands, ReadoutOperands, column_block,
                     correction_arrays, correction_pass, divisor_at_most, pair_pass, register_budget, row_pass,
                     strip_registers, tiled_pass)
from .printer import CPrinter
from .stabilize import Scales
from .state_terms import StateTerms, state_terms


# The vectors that meet a lazily decayed Ŝ = S/c, by when they meet it (the C locals of their factors are named
# so): read before the update (queries, the corrections' w: times c), the writes' left vectors (over c·D), read
# after the update (times c·D).
BEFORE, WRITE, AFTER = "mw", "mx", "mq"


@dataclass(frozen=True)
class _StateLayout:
    """A state as its pass sees it: its C name and this head's buffer, its rows and columns (padded to whole
    registers: the rows of the buffer), and what the pass does (for its comment)."""

    name: str
    c: str
    buffer: str
    matrix: bool
    rows: int
    cols: int
    cols_padded: int
    comment: str


@dataclass(frozen=True)
class _LazyFactors:
    """How phase 1 stores the vectors that meet a lazily decayed Ŝ: with a scalar decay, times the C locals
    of its factors (`scalars`, by BEFORE, WRITE, AFTER); with a decay per row, the bookkeeping stores them
    itself, a register at a time (`stores`: block array, when it meets Ŝ, the store)."""

    scalars: dict[str, str] = field(default_factory=dict)
    decay_register: str = ""
    decay_element: str = ""
    stores: tuple[tuple[str, str, LazyStore], ...] = ()


class BlockArrays:
    """The block arrays of one region: the per-token values phase 1 stores, LR_BLOCK tokens of each, in the
    thread's block buffer (fused.py lays them out)."""

    def __init__(self, printer: CPrinter, values: list[str]):
        self.printer = printer
        self.values = values                      # phase 1's lines (export's default place)
        self.arrays: list[tuple[str, int]] = []   # name, values per token (0: one scalar)
        self.flags: set[str] = set()              # arrays of int32 flags
        self.stored: set[str] = set()             # arrays the lazy bookkeeping of a per-row decay stores itself
        self._exported: dict[tuple, str] = {}     # (e, n, padded) → the array that holds e as it is

    def add(self, name: str, values: int, flags: bool = False) -> None:
        self.arrays.append((name, values))
        if flags:
            self.flags.add(name)

    def vector(self, e: ir.Expr, name: str, n: int, padded: int | None = None, scale: str | None = None,
               lines: list[str] | None = None, share: bool = False) -> str:
        """e into block array `name` (n values, zeros up to `padded`); `scale`: C for a factor of element i (a
        lazy decay's) it is multiplied by as it is stored (the array then no longer holds e: later uses compute
        e anew). share=True (callers that use the name returned): the name of an array that already holds e,
        if any (S's and its normalizer z's keys and queries: one array each, not a copy per state)."""
        pr = self.printer
        shared = scale is None and name not in self.stored
        if share and shared and (e, n, padded) in self._exported:
            return self._exported[(e, n, padded)]
        self.add(name, padded or n)
        if name in self.stored:  # (by the lazy bookkeeping)
            return name
        body = pr.fill(e, f"{name}[u]", n, keep=scale is None, scale=scale)
        pad = [f"for (int i = {n}; i < {padded}; ++i) {name}[u][i] = 0;"] if padded and padded > n else []
        (self.values if lines is None else lines).extend(pr.take_token() + body + pad)
        if shared:
            self._exported.setdefault((e, n, padded), name)
        return name

    def scalar(self, e: ir.Expr, name: str, lines: list[str] | None = None) -> str:
        """Scalar e into block array `name` (one value per token)."""
        self.add(name, 0)
        code = self.printer.scalar(e)
        (self.values if lines is None else lines).extend(self.printer.take_token() + [f"{name}[u] = {code};"])
        return name


def block_region(kernel: KernelSource, scales: Scales, groups: list[ScaleGroup], prefix: str, *, updates: bool,
                 readouts: bool) -> BlockRegion:
    """The region of one pass over the sequence (a causal program's only one; a non-causal program's updates,
    then its readouts of the final state). `prefix` keeps the printers' locals of two regions apart."""
    return _BlockRegionPlanner(kernel, scales, groups, prefix, updates, readouts).region()


class _BlockRegionPlanner:
    """Plans one region: its printers (phase 1's values, phase 3's outputs), the states' terms, the block
    arrays; region() puts the parts together, in the order their C is printed."""

    def __init__(self, kernel: KernelSource, scales: Scales, groups: list[ScaleGroup], prefix: str, updates: bool,
                 readouts: bool):
        self.k, self.scales, self.groups = kernel, scales, groups
        self.updates, self.readouts = updates, readouts
        ct, dims = kernel.target.ctype, kernel.dims
        self.printer = CPrinter(ct, dims, kernel.ref, prefix)              # phase 1
        self.output_printer = CPrinter(ct, dims, kernel.ref, prefix + "o")  # phase 3
        self.terms = [state_terms(kernel, scales, st, updates=updates, readouts=readouts)
                      for st in kernel.program.states]
        self.values: list[str] = []         # phase 1's lines after the decays
        self.blocks = BlockArrays(self.printer, self.values)
        self.readout_rows: list[str] = []   # phase 3: this token's readouts

    def region(self) -> BlockRegion:
        """The region's records, its C printed in phase order: the decays, the lazy bookkeeping, every other
        value of phase 1 and the states' passes, then the outputs."""
        k, pr = self.k, self.printer
        self._expect()
        outputs, scaled = self.scales.outputs(k.decomposition.outputs, block=True) if self.readouts else ((), [])
        self.output_printer.expect(*[e for _, e in outputs])
        # the decays first: the lazy bookkeeping after them gives the factors by which the vectors that meet a
        # lazily decayed state are stored
        decay_values = self.scales.token_lines(pr, scaled, block=True) if self.updates else []
        for i in scaled:
            self.blocks.add(f"blk_rsc{i}", 0)
        factors = [self._decay(st, terms, decay_values) for st, terms in zip(k.program.states, self.terms)]
        streamed = self._streamed(outputs)
        passes, lazies = [], []
        for st, terms, lazy in zip(k.program.states, self.terms, factors):
            state_pass, bookkeeping = self._state(st, terms, lazy, streamed)
            passes.append(state_pass)
            lazies += [bookkeeping] if bookkeeping else []
        head = pr.take_head()
        output_lines, output_rows = self._outputs(outputs, streamed)
        inputs = k.input_arrays()
        checks = [_range_check(x) for x in inputs if self.updates and x.outside]
        # passes that prefetch the next block's rows as they go, paced (phase 1 notes the rows); a vector state's
        # pass alone leaves them to phase 1
        pacing = [p for p in passes if p.kind in ("tiled", "tokens") and inputs]
        return BlockRegion(
            head=tuple(head + self.output_printer.take_head()),
            notes_rows=bool(pacing), ticks=any(p.kind == "tiled" and p.pace.ticks for p in pacing),
            lane_checks=any(not c.scalar for c in checks), scales=tuple(self.groups if self.updates else ()),
            next_rows=tuple(f"pf_row[pf_count++] = {k.row_start(x.c, xi.shape, 'ahead')};" if pacing else
                            f"lr_prefetch_rows({k.row_start(x.c, xi.shape, 'ahead')}, {x.size});"
                            for x, xi in zip(inputs, k.program.inputs)),
            input_rows=self._rows(k.rows_mentioned(decay_values, self.values, lazies) | {c.row for c in checks}),
            range_checks=tuple(checks), decay_values=tuple(decay_values), lazy_decays=tuple(lazies),
            values=tuple(self.values), passes=tuple(passes),
            output_input_rows=self._rows(k.rows_mentioned(output_lines)), readout_rows=tuple(self.readout_rows),
            output_rows=tuple(output_rows), outputs=tuple(output_lines), arrays=tuple(self.blocks.arrays),
            flag_arrays=frozenset(self.blocks.flags), scale_rows={lz.name: lz.scale_rows for lz in lazies})

    def _expect(self) -> None:
        """Declares everything phase 1 prints (shared subexpressions are then computed once)."""
        pr = self.printer
        for t in self.terms:
            values = [e for g in t.groups for term in g.terms if term.value is not None
                      for e in (term.coefficient, term.value)]
            pr.expect(*[e for e in (t.decay,) if e is not None], *[c.w for c in t.corrections],
                      *[g.x for g in t.groups], *t.queries(), *values)
            if not t.corrections:
                pr.expect(*[g.y for g in t.groups])
        pr.expect(*self.scales.exponents())

    # ---- phase 1: decays ----
    def _decay(self, st: ir.State, terms: StateTerms, lines: list[str]) -> _LazyFactors | None:
        """The decay of state st into its block array (`lines`) — or, a decay per row of a matrix state, into
        the lazy bookkeeping's registers —, and how the vectors that meet a lazily decayed state are stored."""
        decay = terms.decay if self.updates else None
        if decay is None:
            return None
        k, c, rows = self.k, self.k.cstate(st.name), self.k.dims[st.shape[0]]
        if len(st.shape) == 2 and decay.shape:
            self.blocks.add(k.local("blk_d", c), rows)
            factors = self._lazy_registers(c, decay, terms)
            self.blocks.stored.update(name for name, _, _ in factors.stores)
            lines.extend(self.printer.take_token())
            return factors
        if decay.shape:
            self.blocks.vector(decay, k.local("blk_d", c), rows, lines=lines)
        else:
            self.blocks.scalar(decay, k.local("blk_d", c), lines=lines)
        if len(st.shape) == 2:  # a scalar decay, applied lazily: its factors are scalars, phase 1 stores
            return _LazyFactors({when: k.local(when, c) for when in (BEFORE, WRITE, AFTER)})
        return None

    def _lazy_registers(self, c: str, decay: ir.Expr, terms: StateTerms) -> _LazyFactors:
        """The lazy bookkeeping of a matrix state with a per-row decay: it computes the decay and stores the
        vectors that meet Ŝ times their factors itself, a register at a time, c·D kept in registers (a
        third of phase 1 faster for GLA than through block arrays of factors). Values with no register-wise
        form (CPrinter.lanes) are computed into a local row first."""
        k, pr = self.k, self.printer
        vectors = ([(cr.w, k.local("blk_w", c, r), BEFORE) for r, cr in enumerate(terms.corrections)]
                   + [(g.x, k.local("blk_x", c, i), WRITE) for i, g in enumerate(terms.groups)]
                   + [(rd.query, k.local("blk_q", c, i), BEFORE if rd.before_update else AFTER)
                      for i, rd in enumerate(terms.readouts)])
        for e in [decay] + [v for v, _, _ in vectors]:
            if not pr.has_lanes(e):
                pr.array(e)  # (then at hand)
        return _LazyFactors(
            decay_register=pr.lanes(decay, "i"), decay_element=pr.lanes(decay, "i", whole=False),
            stores=tuple((name, when, LazyStore(f"{name}[u]", pr.lanes(e, "i"), pr.lanes(e, "i", whole=False)))
                         for e, name, when in vectors))

    # ---- phase 2: a state's pass ----
    def _streamed(self, outputs) -> dict[int, str]:
        """The outputs that are a readout as it is, of a tiled pass over whole registers: the pass's last
        tile of rows streams them to their rows, so they skip phase 3 and the block array (~3% on GLA).
        Returns {readout index: the output row at column 0}."""
        k = self.k
        uses = Counter(n.index for _, e in outputs for n in walk(e) if isinstance(n, ir.ReadoutRef))
        streamed = {}
        for name, e in outputs:
            if not isinstance(e, ir.ReadoutRef) or uses[e.index] != 1:
                continue
            for st, terms in zip(k.program.states, self.terms):
                cols = k.padded(k.dims[st.shape[1]]) if len(st.shape) == 2 else 0
                if len(st.shape) == 2 and not terms.corrections and cols == k.size(e.shape) \
                        and any(rd.index == e.index for rd in terms.readouts):
                    streamed[e.index] = f"({k.row_start(k.cout(name), e.shape, '((b * ntok + t0 + u) * H + h)')})"
        return streamed

    def _state(self, st: ir.State, terms: StateTerms, lazy: _LazyFactors | None, streamed: dict[int, str]):
        """Phase 1's arrays of state st and its pass — tiled (a matrix state without corrections), token after
        token (with corrections), or a vector state's —, and the bookkeeping of its lazily applied decay (None
        when it has none)."""
        k, blocks = self.k, self.blocks
        c = k.cstate(st.name)
        matrix = len(st.shape) == 2
        cols = k.dims[st.shape[1]] if matrix else 1
        s = _StateLayout(st.name, c, k.local("buf", c), matrix, k.dims[st.shape[0]], cols,
                         k.padded(cols) if matrix else 1,
                         k.decomposition.transition(st.name).kind if self.updates else "readouts of the final state")
        decay = terms.decay if self.updates else None
        factors = lazy.scalars if lazy else {}  # Ŝ = S/c: x/c for a token's writes, q⊙c for its reads
        ws = [blocks.vector(cr.w, k.local("blk_w", c, r), s.rows, scale=factors.get(BEFORE))
              for r, cr in enumerate(terms.corrections)]
        xs = [blocks.vector(g.x, k.local("blk_x", c, i), s.rows, scale=factors.get(WRITE), share=True)
              for i, g in enumerate(terms.groups)]
        reads = self._readouts(s, terms, factors, streamed)
        before = tuple(rd for rd, r in zip(reads, terms.readouts) if r.before_update)
        after = tuple(rd for rd, r in zip(reads, terms.readouts) if not r.before_update)
        if matrix and not terms.corrections:
            # the right vectors always copied to the block, even a plain input row: a tile reads y once per
            # token and tile, and a row of the caller's (numpy's rows start 16 bytes into a cache line)
            # splits every vector load in two. Measured at T = 16384: 7% faster with such rows, 4% with
            # aligned ones (phase 1 brings the row to L1 for phase 2).
            rights = [f"{blocks.vector(g.y, k.local('blk_y', c, i), cols, s.cols_padded, share=True)}[u]"
                      for i, g in enumerate(terms.groups)]
        else:
            rights = [RightVector(k.local("y", c, i), s.cols_padded, self._right_value(s, i, g.terms, terms))
                      for i, g in enumerate(terms.groups)]
        bookkeeping = None
        if matrix and decay is not None:  # decays applied lazily: the bookkeeping runs in phase 1
            bookkeeping = self._bookkeeping(st, c, decay, lazy, terms, before, after)
        ops = MatrixOperands(
            st.name, s.comment, s.buffer, s.rows, s.cols_padded, self.updates,
            Decay(f"{k.local('blk_d', c)}[u]", bool(decay.shape)) if decay is not None else None,
            tuple(f"{x}[u]" for x in xs), tuple(y if isinstance(y, str) else y.name for y in rights),
            before, after, tuple(CorrectionOperands(f"{w}[u]", cr.p.name) for w, cr in zip(ws, terms.corrections)))
        if not matrix:
            return self._vector_pass(s, ops, terms, rights, before, after), bookkeeping
        if not terms.corrections:
            return tiled_pass(ops, lanes=k.target.lanes, vector_bytes=k.target.vector_bytes,
                              whole_registers=s.cols_padded // k.target.lanes,
                              inputs=len(k.program.inputs), slow=bookkeeping.slow if bookkeeping else "",
                              readout_arrays=tuple(rd.sums.removesuffix("[u]") for rd in before + after)), bookkeeping
        return self._token_pass(s, ops, ws, rights, terms, bookkeeping.slow if bookkeeping else None), bookkeeping

    def _readouts(self, s: _StateLayout, terms: StateTerms, factors: dict[str, str],
                  streamed: dict[int, str]) -> list[ReadoutOperands]:
        """The readouts of a state: their queries into block arrays (times the lazy decay's factor), their
        sums' block arrays (a row per token, a scalar for a vector state's q·z), phase 3's pointers to them."""
        k, blocks = self.k, self.blocks
        out = []
        for i, rd in enumerate(terms.readouts):
            sums = f"r{rd.index}_blk"
            if rd.is_value:  # a vector state's own value, copied row by row (no query)
                blocks.add(sums, s.rows)
                query = None
                self.readout_rows.append(f"const T *r{rd.index} = {sums}[u];")
            else:
                factor = factors.get(BEFORE if rd.before_update else AFTER)
                query = f"{blocks.vector(rd.query, k.local('blk_q', s.c, i), s.rows, scale=factor, share=True)}[u]"
                blocks.add(sums, s.cols_padded if s.matrix else 0)
                self.readout_rows.append(f"const T {'*' if s.matrix else ''}r{rd.index} = {sums}[u];")
            out.append(ReadoutOperands(query, f"{sums}[u]", streamed.get(rd.index)))
        return out

    def _right_value(self, s: _StateLayout, g: int, parts, terms: StateTerms, token: str = "u") -> str:
        """C of a group's right vector at element j (a vector state's: the scalar) of the block's token
        `token`, summed from its terms: block arrays of their coefficients and values, the corrections' p, a
        token's input row read in place."""
        k, blocks = self.k, self.blocks
        out = []
        for m, term in enumerate(parts):
            coef = None
            if term.coefficient != ONE:
                coef = f"{blocks.scalar(term.coefficient, k.local('blk_k', s.c, g, m))}[{token}]"
            if term.correction is not None:
                src = terms.corrections[term.correction].p.name
            elif not term.value.shape:
                src = f"{blocks.scalar(term.value, k.local('blk_v', s.c, g, m))}[{token}]" if term.value != ONE else None
            else:
                # a matrix state's right vector (a pass token after token, strip by strip) reads the block's
                # copy: the caller's rows lie H·dv apart (4 KiB at H = 8, dv = 128), the same few L1 sets
                # for every token of the block, so each strip found its tokens' columns gone from L1
                # (gated DeltaNet, d = 128: 1.1× faster with the copy)
                src = self._token_pointer(term.value) if s.cols == s.cols_padded and not s.matrix else None
                if src is None:
                    array = blocks.vector(term.value, k.local("blk_v", s.c, g, m), s.cols, s.cols_padded, share=True)
                    src = f"{array}[{token}]"
            if s.matrix:  # a row: element j of each term
                out.append(f"{coef} * {src}[j]" if coef else f"{src}[j]")
            else:
                out.append((coef + (" * " if src else "") if coef else "") + (src or ("" if coef else "1")))
        return " + ".join(out)

    def _token_pointer(self, e: ir.Expr) -> str | None:
        """A C pointer to token u's copy of a vector input or parameter (no copy needed), else None."""
        k = self.k
        if isinstance(e, ir.InputRef):
            return f"({k.row_start(k.cin(e.name), e.shape, '((b * ntok + t0 + u) * H + h)')})"
        if isinstance(e, ir.ParamRef) and e.shape:
            return k.ref(e)
        return None

    def _bookkeeping(self, st: ir.State, c: str, decay: ir.Expr, lazy: _LazyFactors, terms: StateTerms, before,
                     after) -> RowsLazyDecay | ScalarLazyDecay:
        """The bookkeeping of matrix state st's lazily applied decay in phase 1, with its flag per token."""
        k = self.k
        slow, flag = k.local("blk_slow", c), k.local("slow", c)
        self.blocks.add(slow, 0, flags=True)
        scale, d = k.local("sc", c), f"{k.local('blk_d', c)}[u]"
        c_name, cn = k.local("c", flag), k.local("cn", flag)
        if decay.shape:
            stores = {when: tuple(store for _, w, store in lazy.stores if w == when) for when in (BEFORE, WRITE, AFTER)}
            return RowsLazyDecay(
                st.name, k.dims[st.shape[0]], scale, d, f"{slow}[u]", flag, lazy.decay_register, lazy.decay_element,
                stores[BEFORE], stores[WRITE], stores[AFTER],
                # x/c: one division for one write (3% of GLA's kernel against a reciprocal and a multiply, and
                # one rounding), a reciprocal shared by several
                " / cn" if len(stores[WRITE]) == 1 else " * (1 / cn)")
        return ScalarLazyDecay(st.name, scale, d, f"{slow}[u]", flag, c_name, cn,
                               lazy.scalars[BEFORE] if terms.corrections or before else None,
                               lazy.scalars[WRITE] if terms.groups else None, lazy.scalars[AFTER] if after else None)

    def _vector_pass(self, s: _StateLayout, ops: MatrixOperands, terms: StateTerms, rights: list[RightVector],
                     before, after) -> BlockVectorPass:
        """A vector state's pass, token after token."""
        update = None
        if self.updates and (terms.groups or ops.decay is not None):
            update = ((f"{ops.decay.code}{'[i]' if ops.decay.vector else ''} * " if ops.decay else "")
                      + f"{s.buffer}[i]" + "".join(f" + {x}[i] * {y}" for x, y in zip(ops.lefts, ops.rights)))

        def read(rd: ReadoutOperands) -> VectorRead:
            return VectorRead(s.name, s.buffer, s.rows, rd.query, rd.sums)
        return BlockVectorPass(s.name, s.comment, s.buffer, s.rows,
                               ops.corrections,
                               tuple(read(rd) for rd in before), update, tuple(read(rd) for rd in after),
                               right_scalars=tuple(rights))

    def _token_pass(self, s: _StateLayout, ops: MatrixOperands, ws: list[str], rights: list[RightVector],
                    terms: StateTerms, slow: str | None) -> TokenPass:
        """A matrix state with corrections, token after token: the first token's p, then per token its right
        vectors and the update pass (that also forms the next token's p, but for the block's last token).
        `ws`: the block arrays of the corrections' w."""
        lanes, vector_bytes = self.k.target.lanes, self.k.target.vector_bytes
        whole = s.cols_padded // lanes
        # per register of the row: the right vectors', two accumulators per readout and per next p, the row's
        # (then as many as a strip that stays in L1 allows: the tokens run strip by strip, see TokenPass)
        most = column_block(whole, len(ops.lefts) + 2 * len(ops.before + ops.after) + 2 * len(ws) + 1,
                            vector_bytes)
        registers = strip_registers(s.rows, whole, most, vector_bytes)
        # a strip narrower than the row runs on a contiguous copy: the rows of the buffer lie a power of two
        # apart, so a strip of them falls into a few of L1's sets and leaves it, token after token (measured:
        # no faster than the whole rows at d = 128 in place, 1.4× faster as a copy)
        width = registers * lanes
        copied = width < s.cols_padded and s.rows * registers * vector_bytes <= STRIP_COPY_BYTES
        strip = self.k.local("strip", s.c) if copied else None
        buffer, ld = ops.state, ops.ld
        if strip:
            ops = replace(ops, state=strip, ld=width)
        # two tokens a pass (TokenPair): every pass also leaves w(next + 1)ᵀ·S, the partial sums of the
        # token after the next
        partial = [self.k.local("pw", s.c, r) for r in range(len(ws))]
        first_sums = [CorrectionOperands(f"{w}[0]", cr.p) for w, cr in zip(ws, ops.corrections)]
        first_sums += [CorrectionOperands(f"{w}[nb > 1 ? 1 : 0]", pw) for w, pw in zip(ws, partial)]
        first = replace(ops, update=True, decay=None, lefts=(), rights=(), before=(), after=(),
                        corrections=tuple(first_sums))

        def update(next_w: tuple[str, ...]) -> TokenUpdate:
            next_p = tuple(cr.p for cr in ops.corrections) + tuple(partial) if next_w else ()
            whole_pass = row_pass(ops, lanes=lanes, vector_bytes=vector_bytes, columns=s.cols_padded,
                                  registers=registers, next_w=next_w, next_p=next_p)
            if ops.decay is None:
                return TokenUpdate(None, None, whole_pass)
            lazy_pass = row_pass(replace(ops, decay=None), lanes=lanes, vector_bytes=vector_bytes,
                                 columns=s.cols_padded, registers=registers, next_w=next_w, next_p=next_p)
            return TokenUpdate(slow, lazy_pass, whole_pass)
        return TokenPass(
            correction_arrays(ops, s.cols_padded),
            correction_pass(first, lanes=lanes, columns=s.cols_padded,
                            registers=divisor_at_most(registers,
                                                      register_budget(vector_bytes) // (2 * len(first_sums) + 1))),
            tuple(rights), update(tuple(f"{w}[u + 1]" for w in ws) + tuple(f"{w}[{_clamped(2)}]" for w in ws)),
            update(()), s.cols_padded, width, strip, buffer, ld, s.rows,
            self._token_pair(s, ops, ws, terms, rights, partial, slow, registers))

    def _token_pair(self, s: _StateLayout, ops: MatrixOperands, ws: list[str], terms: StateTerms,
                    rights: list[RightVector], partial: list[str], slow: str | None, registers: int) -> TokenPair:
        """Tokens u and u + 1 in one pass (TokenPair, passes.pair_pass): token u + 1's operands are token
        u's block arrays one row on, its p the pass before's partial sums plus what token u's writes add."""
        k = self.k
        ys = tuple(RightVector(k.local("yn", s.c, i), s.cols_padded, self._right_value(s, i, g.terms, terms, "u + 1"))
                   for i, g in enumerate(terms.groups))
        xs = [x.removesuffix("[u]") for x in ops.lefts]
        dots = tuple(CorrectionDot(k.local("wx", s.c, r, g), w, x, s.rows)
                     for r, w in enumerate(ws) for g, x in enumerate(xs))
        p_updates = tuple(f"{cr.p}[j] = {partial[r]}[j]"
                          + "".join(f" + {k.local('wx', s.c, r, g)}[u] * {y.name}[j]" for g, y in enumerate(rights))
                          + ";" for r, cr in enumerate(ops.corrections))

        def one_on(rd: ReadoutOperands) -> ReadoutOperands:
            return replace(rd, query=_one_token_on(rd.query), sums=_one_token_on(rd.sums))
        second = replace(ops, decay=None, lefts=tuple(_one_token_on(x) for x in ops.lefts),
                         rights=tuple(y.name for y in ys), before=tuple(one_on(rd) for rd in ops.before),
                         after=tuple(one_on(rd) for rd in ops.after))
        next_w = tuple(f"{w}[{_clamped(2)}]" for w in ws) + tuple(f"{w}[{_clamped(3)}]" for w in ws)
        # per register of a row: both tokens' right vectors and one sum per readout and next p (register_budget
        # counts these; the row's register is a temporary among the rest): gated DeltaNet's 6 give four
        # registers at d = 64 (1.06-1.08× faster than two, one thread)
        live = 2 * len(ops.lefts) + 2 * len(ops.before + ops.after) + len(next_w)
        pass_ = pair_pass(replace(ops, decay=None), second, lanes=k.target.lanes, columns=s.cols_padded,
                          registers=divisor_at_most(registers, register_budget(k.target.vector_bytes) // live),
                          next_w=next_w,
                          next_p=tuple(cr.p for cr in ops.corrections) + tuple(partial))
        arrays = tuple(f"T {name}[{s.cols_padded}] __attribute__((aligned(64)));"
                       for name in [*partial, *(y.name for y in ys)])
        when = f"{slow} == 0 && {_one_token_on(slow)} == 0" if slow else "1"
        return TokenPair(when, dots, arrays, p_updates, ys, pass_)

    # ---- phase 3 ----
    def _rows(self, rows: set[str]) -> str:
        """The declarations of the input rows a phase reads, in the order of the inputs (a block)."""
        return "".join(x.declaration + "\n" for x in self.k.input_arrays() if x.row in rows)

    def _outputs(self, outputs, streamed: dict[int, str]) -> tuple[list[str], list[OutputRow]]:
        """Phase 3: every output but the streamed ones, each row computed into a local and then streamed to
        its place (never a streamed one: its tile loop has written it)."""
        k, po = self.k, self.output_printer
        lines, rows = [], []
        for name, e in outputs:
            if isinstance(e, ir.ReadoutRef) and e.index in streamed:
                continue
            target = k.cout(name)
            body = po.fill(e, k.row(target)) if e.shape else [f"{target}[tok] = {po.scalar(e)};"]
            lines += po.take_token() + body
            if e.shape:
                rows.append(OutputRow(target, k.row(target), k.size(e.shape), k.row_start(target, e.shape, "tok")))
        return lines, rows


def _one_token_on(code: str) -> str:
    """C of a block array's row of token u (`name[u]`) made token u + 1's."""
    assert code.endswith("[u]"), code
    return code.removesuffix("[u]") + "[u + 1]"


def _clamped(ahead: int) -> str:
    """C of the block's token u + ahead, or u past the block's end (its sums then go unread)."""
    return f"u + {ahead} < nb ? u + {ahead} : u"


def _range_check(x: InputArray) -> RangeCheck:
    """Phase 1's test of input x's declared range."""
    if x.scalar:
        return RangeCheck(True, x.row, 1, x.outside.format(v=x.row), "")
    return RangeCheck(False, x.row, x.size, x.outside.format(v=x.row + "[i]"), x.outside_lanes.format(v="row"))
