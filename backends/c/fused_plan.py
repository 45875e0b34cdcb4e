"""The plan of the fused recurrent kernel, as templates/c_fused.c.j2 reads it: frozen records of what each
part of the C is made of. Python decides (fused.py for the file, block_region.py for the sequence
kernel's blocks of tokens, step_region.py for the decode step, passes.py for the passes over a state and
their register tiles); the template only chooses which blocks of C appear and fills in names, sizes and the
statements made here.

Statements come in two forms: a tuple of lines (`lines`), each a C statement, or one string of statements, a
line each (`block`), which the template places as a whole, indented (`{{ block | indent(n, first=True) }}`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

Lines = tuple[str, ...]


# ---- the file ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBuffers:
    """A state in lr_forward: every head's copy, rows padded to whole registers (`every_head`), this head's
    (`buffer`), and its lazily applied decay c (`every_scale`, `scale`) when it has one."""

    name: str             # the DSL name (comments)
    c: str                # the caller's array (st_S)
    matrix: bool
    rows: int
    cols: int             # 1 for a vector
    cols_padded: int      # cols rounded up to whole registers (1 for a vector)
    every_head: str       # all_st_S
    buffer: str           # buf_st_S
    every_scale: str      # all_sc_st_S
    scale: str            # sc_st_S
    scale_rows: int       # values of c per head: the rows (a decay per row), 1 (a scalar decay) or 0 (none)
    scale_stride: int     # … on whole cache lines (threads write them)
    parts: int = 1        # a kernel over parts of the value axis: a caller's matrix row holds `parts` parts

    @property
    def shared(self) -> bool:
        """Every part of the value axis holds this state whole (a vector state, when split): part 0 writes it."""
        return self.parts > 1 and not self.matrix

    @property
    def caller_cols(self) -> int:
        """The values of a row in the caller's arrays (every part's)."""
        return self.cols * self.parts if self.matrix else self.cols

    @property
    def caller_size(self) -> int:
        return self.rows * self.caller_cols

    @property
    def part_column(self) -> str:
        """C for the first column of work item `part`'s part in a caller's row."""
        return f"part * {self.cols}" if self.parts > 1 and self.matrix else "0"

    def caller_row(self, item: str, i: str) -> str:
        """C for where row i of work item `item`'s copy starts in the caller's array [B, H, *]: the item's head
        is item / LR_PARTS, and a matrix row along the value axis holds every part, this one at its columns."""
        if self.parts == 1:
            return f"{self.c} + (size_t){item} * {self.size} + (size_t){i} * {self.cols}"
        if not self.matrix:
            return f"{self.c} + (size_t)({item} / LR_PARTS) * {self.size} + (size_t){i}"
        return (f"{self.c} + (size_t)({item} / LR_PARTS) * {self.size * self.parts} + (size_t){i} * "
                f"{self.cols * self.parts} + (size_t)({item} % LR_PARTS) * {self.cols}")

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def padded_size(self) -> int:
        return self.rows * self.cols_padded

    @property
    def scale_index(self) -> str:
        """C for the scale of row i: c[i] for a decay per row, c[0] for a scalar one."""
        return "i" if self.scale_rows > 1 else "0"

    @property
    def kept_size(self) -> int:
        """The values lr_forward keeps of one head: its padded rows and its scale."""
        return self.padded_size + self.scale_stride


@dataclass(frozen=True)
class ScaleStart:
    """σ and M of a group of stabilized states from the caller's log-scale (see stabilize.py), into the
    lvalues `sigma` and `maximum`."""

    names: str       # the states, for the comment
    given: str       # the caller's log-scale of this head
    sigma: str
    maximum: str
    all_zero: str    # C for "the states are all zero" (then σ = −∞)


@dataclass(frozen=True)
class ScaleGroup:
    """Stabilized states that share their σ and M (stabilize.Scales.groups): lsc{index} is the caller's
    [B, H] array of log-scales, all_ls{index} lr_forward's σ and M of every head, ls{index} and mx{index}
    this head's."""

    index: int
    c: str                   # the caller's array (lsc0)
    names: str               # the states, for comments
    at_start: ScaleStart     # lr_forward's first segment of a head
    at_token: ScaleStart     # the decode step


@dataclass(frozen=True)
class BlockArray:
    """An array of the per-token values of a block of tokens, in the thread's block buffer: `values` per token
    (0: one scalar per token), or a flag per token (int32: tested in the tiled passes' inner loops as an
    integer, where a float's compare takes a vector port from the multiply-adds)."""

    name: str
    values: int
    offset: int
    flags: bool


@dataclass(frozen=True)
class NextHead:
    """The decode step's pointer to the next head's rows of a state (the update pass prefetches them)."""

    name: str      # next_st_S
    c: str         # the caller's array
    size: int      # values per head
    buffer: str    # this head's rows (the pointer for the last head)


# ---- passes over a state ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefetchPace:
    """How a tiled pass issues the next block's input rows: one row every `every` steps of its inner loop
    (counted by pf_tick), or `rows` rows each step (0: none)."""

    every: int
    rows: int

    @property
    def ticks(self) -> bool:
        return self.every > 1


@dataclass(frozen=True)
class ReadoutTile:
    """A readout's sums over one tile of rows: q[rt …]ᵀ times the tile's registers, added to its block row
    (`sums`, at column j); the last tile of rows streams the finished sums to an output that is this readout
    as it is, when `last` (C: this is the last tile) is set."""

    query: str
    sums: str
    load: str              # the sums so far into registers a0, a1, …
    multiply_adds: Lines
    stores: Lines          # the sums back to the block row
    last: str | None
    out: str | None        # the output row's address at column 0
    streams: Lines         # the sums to the output row (when `last`)


@dataclass(frozen=True)
class Tile:
    """A tile of `rows` rows × TiledPass.registers registers of a state, s{row}_{register}: loaded once per
    block, updated by every token, stored at the end."""

    rows: int
    loads: Lines
    right_vectors: Lines             # this token's y_g at column j, into registers y{g}_{register}
    registers: int                   # the tile's registers (prefetched one a step for the next tile)
    readouts_before: tuple[ReadoutTile, ...]
    decay: str                       # block: the decay applied to the registers (a slow token's); "" for none
    update: str                      # block: the rank-one terms added; "" for none
    readouts_after: tuple[ReadoutTile, ...]
    stores: Lines


@dataclass(frozen=True)
class TiledPass:
    """Phase 2 for a matrix state without corrections: a tile of rows × registers of S stays in registers
    for the whole block, one multiply-add chain per register. Tiles of `tile_rows` rows up to `main_rows`,
    then one tile of the rows left (`tail`)."""

    kind: ClassVar[str] = "tiled"
    name: str
    comment: str
    state: str
    ld: int
    tile_rows: int
    tile_columns: int
    registers: int                   # registers across a tile
    columns: int                     # the columns of the whole registers
    readout_arrays: tuple[str, ...]  # the block arrays of the readouts' sums (zeroed first)
    pace: PrefetchPace
    slow: str                        # C: this token applies its decay to the rows ("" without decay)
    main_rows: int
    main: Tile | None
    tail: Tile | None


@dataclass(frozen=True)
class PassRow:
    """One row of a pass over a state's rows (its index: `i`, `i + 1` or a number): its scalars — the
    decay, left vectors and queries at that row — and the statements of each register of the column block."""

    index: str
    scalars: str           # block
    registers: Lines       # a block per register


@dataclass(frozen=True)
class ColumnTail:
    """The columns past the last whole register of a row pass, one by one (the decode step's true row
    stride leaves them)."""

    start: int
    end: int
    declarations: Lines    # the right vectors at column j, the readouts' sums
    scalars: str           # block (at row i)
    body: str              # block
    stores: Lines


@dataclass(frozen=True)
class RowPass:
    """A fused pass over the rows of a matrix state, in column blocks of registers: decay, rank-one terms
    and readouts a row at a time, two rows per iteration with two sets of accumulators (o…, e…) so that the
    sums over rows are two dependency chains, not one that waits on itself."""

    name: str
    comment: str
    state: str
    ld: int
    rows: int
    scalar_decay: str | None          # C of a decay that is one scalar for every row
    columns: int                      # the columns of whole registers
    block_columns: int                # the columns of one block of registers
    declarations: Lines               # the right vectors' registers and the accumulators
    row_pair: tuple[PassRow, PassRow]
    last_row: PassRow | None          # the last row of an odd number
    stores: Lines
    ahead: str | None                 # the decode step: the next head's rows, prefetched as the rows go
    prefetch_offsets: tuple[int, ...]  # … at these offsets of a row (one per cache line)
    tail: ColumnTail | None
    bits: bool = False                # the state is bfloat16 bits (the decode step's, see passes.MatrixOperands)


@dataclass(frozen=True)
class CorrectionRow:
    """One row of a correction pass (its index: `i`, `i + 1` or a number): the row's registers, and per
    correction its w at the row and the multiply-adds into its sums."""

    index: str
    statements: Lines


@dataclass(frozen=True)
class CorrectionTail:
    """p = wᵀ·S for the columns past the last whole register, one by one."""

    start: int
    end: int
    sums: Lines
    multiply_adds: Lines
    stores: Lines


@dataclass(frozen=True)
class CorrectionPass:
    """p_r = w_rᵀ·S_(t−1) for the rank-one corrections of a matrix state, before any term of the update
    changes S: a pass over its rows in column blocks of registers, two rows at a time (a…, e…)."""

    name: str
    state: str
    ld: int
    rows: int
    columns: int
    block_columns: int
    accumulators: Lines
    row_pair: tuple[CorrectionRow, CorrectionRow]
    last_row: CorrectionRow | None
    stores: Lines
    tail: CorrectionTail | None
    bits: bool = False                # the state is bfloat16 bits (the decode step's, see passes.MatrixOperands)


@dataclass(frozen=True)
class RightVector:
    """A group's right vector y of a token, summed from its terms (a coefficient times p or a value)."""

    name: str
    size: int
    value: str     # C of element j (of the vector) or of the scalar


@dataclass(frozen=True)
class TokenUpdate:
    """The update pass of one token of a pass token after token: with a lazily applied decay, the pass
    without the decay multiply (`lazy`) unless the token is slow (`slow`, C), then the pass that applies it
    (`whole`); without a decay, `whole` alone."""

    slow: str | None
    lazy: RowPass | None
    whole: RowPass


@dataclass(frozen=True)
class CorrectionDot:
    """w_r of token u + 1 · x_g of token u, for every token of the block but the last (`sums`, a block-long
    array): what token u's write adds to token u + 1's p = w_rᵀ·S per unit of y_g."""

    sums: str
    w: str         # block arrays, a row per token
    x: str
    rows: int


@dataclass(frozen=True)
class TokenPair:
    """Two tokens u, u + 1 in one pass over a strip (passes.pair_pass) when neither applies its decay to the
    rows (`when`, C). The pass before left p(u) = w(u)ᵀ·S and `partial` = w(u + 1)ᵀ·S, so p(u + 1) =
    partial + Σ_g dot_(r,g)[u]·y_g(u) (`p_updates`, element j), then token u + 1's right vectors (`rights`);
    the pair's pass leaves p(u + 2) and w(u + 3)ᵀ·S for the next pair."""

    when: str
    dots: tuple[CorrectionDot, ...]
    arrays: Lines                      # the partial sums and token u + 1's right vectors
    p_updates: Lines
    rights: tuple[RightVector, ...]
    pass_: RowPass


@dataclass(frozen=True)
class TokenPass:
    """Phase 2 for a matrix state with corrections: token after token. The pass that updates Ŝ for token u
    also forms p = wᵀŜ for token u + 1 (its w is known: phase 1 computed it), so Ŝ is read once per token;
    the first token's p comes from a correction pass of its own. Every term of a column's update (p's
    column, the right vectors', the readouts' sums) reads that column alone, so the tokens run strip by strip
    of columns: a strip small enough for L1 stays there for the whole block (see passes.strip_registers)."""

    kind: ClassVar[str] = "tokens"
    correction_arrays: Lines          # the p_r of a token
    first_corrections: CorrectionPass
    right_vectors: tuple[RightVector, ...]
    with_next: TokenUpdate            # every token but the block's last: also the next token's p
    last: TokenUpdate
    columns: int                      # the state's columns (whole registers)
    strip_columns: int                # the columns of a strip: every token of the block runs over one strip
    strip: str | None                 # a strip narrower than the state: its contiguous copy, which the passes read
    state: str                        # the state's buffer, rows `ld` apart (the strip's copies come from there)
    ld: int
    rows: int
    pair: TokenPair | None = None     # two tokens a pass where no decay multiplies the rows


@dataclass(frozen=True)
class VectorRead:
    """A readout of a vector state z into `sums` (a scalar, or a row for z itself): q·z, or z itself."""

    name: str
    state: str
    rows: int
    query: str | None     # None: z itself
    sums: str


@dataclass(frozen=True)
class CorrectionOperands:
    """A rank-one correction as a pass reads it: C of its w (indexable by row) and the local p = wᵀ·S of its
    old state (a row of a matrix state's, indexable by column; a vector state's scalar)."""

    w: str
    p: str


@dataclass(frozen=True)
class VectorPass:
    """A vector state z[n] a token at a time: the corrections' p = w·z, the right scalars y, the readouts
    before the update, the update (one scalar per row), the readouts after it."""

    kind: ClassVar[str] = "vector"
    name: str
    comment: str
    state: str
    rows: int
    corrections: tuple[CorrectionOperands, ...]
    before: tuple[VectorRead, ...]
    update: str | None     # C of the new z[i]; None: no update
    after: tuple[VectorRead, ...]


@dataclass(frozen=True)
class BlockVectorPass(VectorPass):
    """Phase 2 for a vector state, token after token: the right scalars summed from phase 1's arrays."""

    right_scalars: tuple[RightVector, ...]


@dataclass(frozen=True)
class StepVectorPass(VectorPass):
    """A vector state in the decode step: the lines that compute the right scalars, a scalar decay (`d`)."""

    right_scalars: Lines
    scalar_decay: str | None


# ---- the lazily applied decay of a matrix state (phase 1) -----------------------------------------------------
@dataclass(frozen=True)
class LazyStore:
    """A vector that meets Ŝ (a left vector, a query, a correction's w), stored into its block row
    `target` times its factor: C of a register of it at i (`register`) and of element i (`element`)."""

    target: str
    register: str
    element: str


@dataclass(frozen=True)
class RowsLazyDecay:
    """The lazy bookkeeping of a matrix state with a decay per row: c ← c·D and the stores of the vectors
    that meet Ŝ, a register at a time (c·D kept in registers), the rows left over one by one."""

    kind: ClassVar[str] = "rows"
    name: str
    rows: int
    scale: str           # c (sc_st_S)
    decay: str           # this token's c·D, then D (blk_d_st_S[u])
    slow: str            # this token's flag (blk_slow_st_S[u])
    flag: str            # … as a local
    decay_register: str  # C of a register of D at i
    decay_element: str   # C of element i of D
    before: tuple[LazyStore, ...]    # read before the update (queries, corrections' w): times c
    over_c: tuple[LazyStore, ...]    # the writes' left vectors: over c·D
    after: tuple[LazyStore, ...]     # queries read after the update: times c·D
    division: str        # how the left vectors are divided by c·D: " / cn" (one of them) or " * (1 / cn)"

    @property
    def as_they_are(self) -> tuple[LazyStore, ...]:
        """The stores a slow token makes without a factor (c restarts at 1): the left vectors, then the
        queries read after the update."""
        return self.over_c + self.after

    @property
    def scale_rows(self) -> int:
        return self.rows


@dataclass(frozen=True)
class ScalarLazyDecay:
    """The lazy bookkeeping of a matrix state with one decay for every row: c ← c·D, and the factors
    phase 1 stores the vectors that meet Ŝ with (None where none needs one)."""

    kind: ClassVar[str] = "scalar"
    name: str
    scale: str
    decay: str
    slow: str
    flag: str
    c: str
    cn: str
    before: str | None   # c
    over_c: str | None   # 1/(c·D)
    after: str | None    # c·D

    @property
    def scale_rows(self) -> int:
        return 1


# ---- the regions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RangeCheck:
    """The declared range of an input, tested as phase 1 reads the row: element by element, or for a
    vector a register at a time (the lanes reduced once per block) and the elements left one by one."""

    scalar: bool
    row: str
    size: int
    element_test: str   # C, nonzero when outside (of element i, or of the scalar)
    lanes_test: str     # C, an lr_mask of register `row`


@dataclass(frozen=True)
class OutputRow:
    """An output row phase 3 computes into a local (`row`), then streams to its place in the array."""

    c: str
    row: str
    size: int
    start: str    # C: where the row starts in the array (at token `tok`)


@dataclass(frozen=True)
class BlockRegion:
    """One block of tokens of one head, in three phases: (1) every state-free value of every token into block
    arrays, with the bookkeeping of lazily applied decays, (2) the passes over the states, (3) the outputs."""

    head: Lines                       # per head, before the block
    notes_rows: bool                  # phase 1 notes the next block's rows, the tiled and token passes prefetch them
    ticks: bool                       # a tiled pass paces its prefetches (pf_tick)
    lane_checks: bool                 # a vector input's range is checked a register at a time
    scales: tuple[ScaleGroup, ...]    # the groups whose σ and M the region carries
    next_rows: Lines                  # phase 1: the next block's rows of this token (noted or prefetched)
    input_rows: str                   # block: the rows phase 1 reads
    range_checks: tuple[RangeCheck, ...]
    decay_values: Lines               # phase 1, first: σ, decays
    lazy_decays: tuple[RowsLazyDecay | ScalarLazyDecay, ...]
    values: Lines                     # phase 1: everything else
    passes: tuple[TiledPass | TokenPass | BlockVectorPass, ...]
    output_input_rows: str            # block: the rows phase 3 reads
    readout_rows: Lines               # phase 3: this token's readouts
    output_rows: tuple[OutputRow, ...]
    outputs: Lines                    # phase 3 (empty: no phase 3)
    arrays: tuple[tuple[str, int], ...]  # the block arrays (name, values per token, 0 for a scalar) …
    flag_arrays: frozenset[str]          # … of which these hold flags
    scale_rows: dict[str, int]           # state → values of its lazily applied decay (see StateBuffers)


@dataclass(frozen=True)
class StepMatrixPass:
    """A matrix state in the decode step: the corrections' p = wᵀ·S, the right vectors, then one fused pass
    (rows at the state's true stride, a column tail when a row is not a whole number of registers)."""

    kind: ClassVar[str] = "matrix"
    correction_arrays: Lines
    corrections: CorrectionPass | None
    right_vectors: Lines
    update: RowPass


@dataclass(frozen=True)
class StepRegion:
    """One token of one (batch row, head) in the decode step, on the caller's state rows."""

    head: Lines
    scales: tuple[ScaleGroup, ...]
    input_rows: str                 # block
    values: Lines
    readouts: Lines                 # their declarations
    passes: tuple[StepMatrixPass | StepVectorPass, ...]
    output_rows: Lines              # declarations of the vector outputs' rows (none when no outputs)
    outputs: Lines
    next_heads: tuple[NextHead, ...]
