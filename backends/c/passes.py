"""The passes of the fused kernel over one state, unrolled: how large a tile of registers is, how many
registers a column block holds, and the statements over those registers (s0_0, y0_1, a2, …) as C lines
(records in fused_plan.py). What a pass reads and writes comes from block_region.py (the block arrays of the
sequence kernel) and step_region.py (the decode step's values), as MatrixOperands."""
from __future__ import annotations

from dataclasses import dataclass

from .fused_plan import (ColumnTail, CorrectionOperands, CorrectionPass, CorrectionRow, CorrectionTail, Lines,
                         PassRow, PrefetchPace, ReadoutTile, RowPass, Tile, TiledPass)

def register_budget(vector_bytes: int) -> int:
    """SIMD registers a pass over the rows may hold (accumulators, right vectors), three quarters of the
    register file, the rest left for broadcasts and temporaries: 24 of AVX-512's 32, 12 of the 16 of AVX2 and
    SSE. (Measured on a Zen 2 core, AVX2, alternating in one process: gated DeltaNet's prefill at d = 64 and
    128 took 10.3 and 31.6 ms with 24, which spill, and 8.8 and 26.9 with 12; gdn2's 14.0 and 41.2 against 13.3
    and 37.8; the same at d = 256, where the strips are narrower anyway.)"""
    return 24 if vector_bytes >= 64 else 12


def tile_registers(vector_bytes: int) -> int:
    """Registers a tile of the pass without corrections may count (tile_shape): 28 of AVX-512's 32; 18 with the
    16 of AVX2 and SSE, a little past them (the spills ride on load slots the tile has to spare)."""
    return 28 if vector_bytes >= 64 else 18


@dataclass(frozen=True)
class Decay:
    """A state's decay as a pass reads it."""

    code: str      # C of the decay: a scalar, or a vector indexable by row
    vector: bool


@dataclass(frozen=True)
class ReadoutOperands:
    """A readout as a pass computes it: q (None: a vector state read as it is) and where its sums go."""

    query: str | None      # indexable by row
    sums: str              # indexable by column: where the readout's sums go
    out: str | None = None  # a tiled pass: the output row the finished sums stream to (see block_region)


@dataclass(frozen=True)
class MatrixOperands:
    """What a pass over a matrix state reads and writes, as C: its buffer (rows `ld` apart), the decay, the
    groups' left vectors (indexable by row) and right vectors (by column), the readouts before and after the
    update, and the corrections (w indexable by row, p by column)."""

    name: str
    comment: str
    state: str
    rows: int
    ld: int
    update: bool
    decay: Decay | None
    lefts: tuple[str, ...]
    rights: tuple[str, ...]
    before: tuple[ReadoutOperands, ...]
    after: tuple[ReadoutOperands, ...]
    corrections: tuple[CorrectionOperands, ...]
    # the decode step of a bfloat16 state (state_dtype="bfloat16", rows of whole registers): the buffer holds
    # the state's bits, which a pass widens as it loads a register and rounds as it stores one; between the
    # two the values stay float32 in registers, so a step's arithmetic is the float32 step's and it rounds
    # each value once
    bits: bool = False


def _load(ops: MatrixOperands, at: str) -> str:
    """C of a register of the state loaded from `at` (widened from its bits when they are bits)."""
    return f"lr_bf16_load_vec({at})" if ops.bits else f"lr_load({at})"


def _store(ops: MatrixOperands, at: str, value: str) -> str:
    """C that stores a register of the state to `at` (rounded to bfloat16 when the state is bits)."""
    return f"lr_bf16_store_vec({at}, {value});" if ops.bits else f"lr_store({at}, {value});"


def divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n that is at most `limit` (1 for n = 0)."""
    limit = max(1, min(n, limit))
    return next(g for g in range(limit, 0, -1) if n % g == 0) if n else 1


def column_block(whole_registers: int, live_per_register: int, vector_bytes: int) -> int:
    """How many registers of a row a pass over the rows takes at a time: the most that divide the row's whole
    registers and, with `live_per_register` registers live for each (accumulators, right vectors, the row's
    own), fit register_budget (1 for a row shorter than a register)."""
    return divisor_at_most(whole_registers, register_budget(vector_bytes) // max(1, live_per_register))


# A strip of a state's columns (a pass token after token, see strip_registers) stays in L1 for a block of
# tokens when its rows take at most this many bytes.
STRIP_BYTES = 16 * 1024
# … and is copied to a contiguous buffer on the thread's stack when it takes at most this many (a larger one,
# dk > 512 in float32, leaves L1 whatever its layout: it runs in place, and the stack stays small)
STRIP_COPY_BYTES = 64 * 1024


def strip_registers(rows: int, whole_registers: int, most: int, vector_bytes: int) -> int:
    """Registers across a strip of columns for a pass token after token: the most, up to `most` (what
    column_block allows), that divide the row's whole registers and whose rows fit STRIP_BYTES — so the strip
    stays in L1 for the whole block instead of the whole state coming from L2 for every token (a state of
    d = 128 or more does not fit L1) —, but two at least where the row has them: a strip one register wide
    loads a register of S and broadcasts three scalars (x, q, the next w) for three multiply-adds, bound by
    its loads (measured on gated DeltaNet at d = 256, one thread: two registers, 32 KiB, 1.2× faster than
    one; at d = 128 two registers, 16 KiB, 1.1× faster than four)."""
    fit = STRIP_BYTES // max(1, rows * vector_bytes)
    return divisor_at_most(whole_registers, max(min(2, most), min(most, fit)))


def block(lines) -> str:
    """Statements as one string, a line each (a block the template indents as a whole)."""
    return "".join(line + "\n" for line in lines)


def _registers(names: list[str], keyword: str) -> str:
    """One declaration of several registers: `vec a0 = …, a1 = …;`"""
    return f"{keyword} {', '.join(names)};"


# ---- the register-tiled pass ---------------------------------------------------------------------------
def tile_shape(whole_registers: int, rows: int, groups: int, vector_bytes: int) -> tuple[int, int]:
    """(registers across, rows) of a tile. With AVX-512's 32 registers, wide tiles first — a row of four
    registers shares each broadcast of x and q over four multiply-adds (measured ~8% faster than two registers
    for GLA at dv = 64) —, then as many rows as the registers allow beside the right vectors. With 16 (AVX2,
    SSE), four across leave room for one row: the shape that holds the most of the state, ties to the wider
    (on a Zen 2 core, 2 × 6 against 4 × 4 — spilling six — made GLA's prefill 6–8% faster at d = 64 and 256, 4%
    at 128; 4 × 2 was slower at 128 and 256)."""
    budget = tile_registers(vector_bytes)

    def tall(across: int) -> int:
        return next((r for r in (8, 6, 4, 3, 2) if r * across + (groups + 2) * across <= budget), 1)
    widths = [c for c in (4, 2, 1) if whole_registers % c == 0]
    across = widths[0] if vector_bytes >= 64 else max(widths, key=lambda c: (c * tall(c), c))
    return across, min(tall(across), rows)


def prefetch_pace(steps: int, inputs: int) -> PrefetchPace:
    """How a tiled pass of `steps` steps issues the next block's rows (`inputs` per token): every row on its
    way before the pass ends, a row's lines at a time: one token's rows over one token's steps. A tiled pass
    is bound by its multiply-adds and has load slots to spare. (A pass token after token prefetches nothing:
    it is bound by its loads and reads from L1, and prefetches inside it cost more than a burst in phase 1,
    measured ~5% on gated DeltaNet.)"""
    if not inputs:
        return PrefetchPace(0, 0)
    return PrefetchPace(max(1, steps // inputs), -(-inputs // steps))


def tiled_pass(ops: MatrixOperands, *, lanes: int, vector_bytes: int, whole_registers: int, inputs: int, slow: str,
               readout_arrays: tuple[str, ...]) -> TiledPass:
    """The pass over a matrix state without corrections, a tile of rows × registers in registers for the
    whole block: tiles of the shape tile_shape() gives, then one tile of the rows left. It prefetches the
    next block's rows of the `inputs` inputs as it goes."""
    across, tall = tile_shape(whole_registers, ops.rows, len(ops.lefts) if ops.update else 0, vector_bytes)
    main_rows = ops.rows - ops.rows % tall
    left = ops.rows % tall
    pace = prefetch_pace(whole_registers // across * -(-ops.rows // tall), inputs)  # (each tile once per token)
    # `last`: C for "this is the last tile of rows", after which the readouts' sums are final
    main = _tile(ops, tall, across, lanes, None if left else f"rt == {main_rows - tall}") if main_rows else None
    return TiledPass(ops.name, ops.comment, ops.state, ops.ld, tall, across * lanes, across,
                     whole_registers * lanes, readout_arrays, pace, slow, main_rows, main,
                     _tile(ops, left, across, lanes, "1") if left else None)


def _tile(ops: MatrixOperands, rows: int, across: int, lanes: int, last: str | None) -> Tile:
    """A tile of `rows` rows × `across` registers, s{row}_{register}, at row rt and column j. Its multiply-adds
    are lr_fma's, rounded once whatever gcc's contraction decides: a part of the value axis (c.value_split)
    then computes its columns bit for bit as the whole head does, by construction."""
    cells = [(r, c) for r in range(rows) for c in range(across)]
    offset = {(r, c): r * ops.ld + c * lanes for r, c in cells}
    loads = tuple(_registers([f"s{r}_{c} = lr_load(base + {offset[r, c]})" for c in range(across)], "vec")
                  for r in range(rows))
    rights = []
    for g, y in enumerate(ops.rights):
        rights += [f"const T *yp{g} = {y} + j;",
                   _registers([f"y{g}_{c} = lr_load(yp{g} + {c * lanes})" for c in range(across)], "const vec")]
    decay = update = ""
    if ops.update and ops.decay:
        d = ops.decay
        decay = block([f"const T *dp = {d.code} + rt;" if d.vector else f"const T d = {d.code};"]
                      + [f"s{r}_{c} = {f'dp[{r}]' if d.vector else 'd'} * s{r}_{c};" for r, c in cells])
    if ops.update and ops.lefts:
        update = block([f"const T *xp{g} = {x} + rt;" for g, x in enumerate(ops.lefts)]
                       + [_update(f"s{r}_{c}", f"s{r}_{c}", [(f"xp{g}[{r}]", f"y{g}_{c}") for g in range(len(ops.lefts))],
                                  True) for r, c in cells])
    # (stored back also by a pass that only reads, a non-causal program's readouts of the final state: the
    # template once tested a dict's `update`, which jinja took for the dict's method, and the C stays as it was)
    stores = tuple(f"lr_store(base + {offset[r, c]}, s{r}_{c});" for r, c in cells)
    return Tile(rows, loads, tuple(rights), rows * across,
                tuple(_readout_tile(rd, rows, across, lanes, last) for rd in ops.before), decay, update,
                tuple(_readout_tile(rd, rows, across, lanes, last) for rd in ops.after), stores)


def _readout_tile(rd: ReadoutOperands, rows: int, across: int, lanes: int, last: str | None) -> ReadoutTile:
    """One multiply-add chain per register of the tile's columns, seeded with the sums of the tiles above:
    the chains of successive tokens are independent, so they overlap. (Two chains per register, even rows and
    odd, halve a chain's latency but need a register more per column: with AVX2's 16, GLA's 6 × 2 tiles then
    spill, and its prefill took 3–7% longer at d = 64, 128 and 256 on a Zen 2 core, alternating.)"""
    streams = last is not None and rd.out is not None
    return ReadoutTile(
        rd.query, rd.sums, _registers([f"a{c} = lr_load(o + {c * lanes})" for c in range(across)], "vec"),
        tuple(_fma(f"a{c}", f"q[{r}]", f"s{r}_{c}") for r in range(rows) for c in range(across)),
        tuple(f"lr_store(o + {c * lanes}, a{c});" for c in range(across)),
        last if streams else None, rd.out if streams else None,
        tuple(f"lr_stream_vec(out + {c * lanes}, a{c});" for c in range(across)) if streams else ())


# ---- passes over the rows, in column blocks of registers ---------------------------------------------------
def row_pass(ops: MatrixOperands, *, lanes: int, vector_bytes: int, columns: int, registers: int,
             next_w: tuple[str, ...] = (), ahead: str | None = None,
             next_p: tuple[str, ...] | None = None) -> RowPass:
    """The fused pass over the rows of a matrix state: `registers` registers of a row at a time over its
    whole registers, then (the decode step, `columns` not a whole number of registers) the columns left one
    by one. next_w: the next token's corrections' w (the sequence kernel forms its p in the same pass), whose
    sums go to next_p (default: the corrections' own p);
    ahead: the next head's rows, prefetched a cache line of each row at a time."""
    readouts = ops.before + ops.after
    whole = columns // lanes * lanes
    assert not (ops.bits and columns > whole), "bfloat16 bits in a pass: rows of whole registers only"
    declarations = [_registers([f"y{g}_{v} = lr_load({y} + j + {v * lanes})" for v in range(registers)],
                               "const vec") for g, y in enumerate(ops.rights)]
    declarations += [_registers([f"o{i}_{v} = {{0}}, e{i}_{v} = {{0}}" for v in range(registers)], "vec")
                     for i in range(len(readouts))]
    declarations += [_registers([f"op{i}_{v} = {{0}}, ep{i}_{v} = {{0}}" for v in range(registers)], "vec")
                     for i in range(len(next_w))]
    stores = [f"lr_store({rd.sums} + j + {v * lanes}, o{i}_{v} + e{i}_{v});"
              for i, rd in enumerate(readouts) for v in range(registers)]
    targets = next_p if next_p is not None else tuple(cr.p for cr in ops.corrections[:len(next_w)])
    stores += [f"lr_store({p} + j + {v * lanes}, op{i}_{v} + ep{i}_{v});  /* the next token's p */"
               for i, p in enumerate(targets) for v in range(registers)]

    def row(index: str, acc: str) -> PassRow:
        return PassRow(index, block(_row_scalars(ops, index, next_w)),
                       tuple(block(_register_statements(ops, v, acc, lanes, len(next_w))) for v in range(registers)))
    tail = None
    if columns > whole:
        tail = ColumnTail(
            whole, columns,
            tuple([f"const T y{g}_0 = {y}[j];" for g, y in enumerate(ops.rights)]
                  + [f"T o{i}_0 = 0;" for i in range(len(readouts))]),
            block(_row_scalars(ops, "i", next_w)), block(_register_statements(ops, 0, "o", None, len(next_w))),
            tuple(f"{rd.sums}[j] = o{i}_0;" for i, rd in enumerate(readouts)))
    return RowPass(
        ops.name, ops.comment, ops.state, ops.ld, ops.rows,
        ops.decay.code if ops.decay and not ops.decay.vector else None, whole, registers * lanes,
        tuple(declarations), (row("i", "o"), row("i + 1", "e")), row(str(ops.rows - 1), "o") if ops.rows % 2 else None,
        tuple(stores), ahead,
        tuple(v * lanes for v in range(registers) if (v * vector_bytes) % 64 == 0) if ahead else (), tail, ops.bits)


def _row_scalars(ops: MatrixOperands, k: str, next_w: tuple[str, ...]) -> list[str]:
    """Row k's values of the decay (a vector's), the left vectors, the queries and the next token's w."""
    lines = [f"const T d = {ops.decay.code}[{k}];"] if ops.decay and ops.decay.vector else []
    lines += [f"const T x{g} = {x}[{k}];" for g, x in enumerate(ops.lefts)]
    lines += [f"const T qb{i} = {rd.query}[{k}];" for i, rd in enumerate(ops.before)]
    lines += [f"const T qa{i} = {rd.query}[{k}];" for i, rd in enumerate(ops.after)]
    return lines + [f"const T wn{i} = {w}[{k}];" for i, w in enumerate(next_w)]


def _fma(target: str, a: str, b: str, vector: bool = True) -> str:
    """C of target += a·b (a a scalar; b and target registers, or scalars where vector=False): in registers
    through lr_fma, rounded once whatever gcc's contraction decides (c_common.h.j2 says why)."""
    return f"{target} = lr_fma({a}, {b}, {target});" if vector else f"{target} += {a} * {b};"


def _update(s: str, start: str, terms: list[tuple[str, str]], vector: bool) -> str:
    """C of s = start + Σ x·y over terms (x, y), added in their order, each rounded once in registers."""
    if not vector:
        return f"{s} = {start}" + "".join(f" + {x} * {y}" for x, y in terms) + ";"
    code = start
    for x, y in terms:
        code = f"lr_fma({x}, {y}, {code})"
    return f"{s} = {code};"


def _register_statements(ops: MatrixOperands, v: int, acc: str, lanes: int | None, nexts: int) -> list[str]:
    """Register v of a row (lanes=None: the row's single column of a column tail): the readouts before the
    update, the update, the readouts after it and the next token's p, accumulated into `acc`'s sums."""
    vector = bool(lanes)
    lines = [f"vec s{v} = {_load(ops, f'row + {v * lanes}')};" if lanes else f"T s{v} = row[0];"]
    lines += [_fma(f"{acc}{i}_{v}", f"qb{i}", f"s{v}", vector) for i in range(len(ops.before))]
    if ops.update:
        scaled = f"d * s{v}" if ops.decay else f"s{v}"
        lines.append(_update(f"s{v}", scaled, [(f"x{g}", f"y{g}_{v}") for g in range(len(ops.lefts))], vector))
        lines.append(_store(ops, f"row + {v * lanes}", f"s{v}") if lanes else f"row[0] = s{v};")
    lines += [_fma(f"{acc}{len(ops.before) + i}_{v}", f"qa{i}", f"s{v}", vector) for i in range(len(ops.after))]
    return lines + [_fma(f"{acc}p{i}_{v}", f"wn{i}", f"s{v}", vector) for i in range(nexts)]


def pair_pass(ops: MatrixOperands, second: MatrixOperands, *, lanes: int, columns: int, registers: int,
              next_w: tuple[str, ...], next_p: tuple[str, ...]) -> RowPass:
    """Two tokens in one pass over the rows of a matrix state without a decay multiply (no decay, or one
    applied lazily): `ops` reads and writes token u's operands, `second` token u + 1's (its right vectors
    already formed from its p, see TokenPair). Each register of a row is loaded and stored once for both
    tokens: S + x_u⊗y_u (token u's readouts after its update and token u + 1's before it read that), then
    + x_(u+1)⊗y_(u+1); the sums of next_w's w over the result go to next_p. A pass token after token loads
    and stores a register of S per three multiply-adds, and two stores and four loads a cycle is more than
    the core does (measured alone in L1: 68% of the multiply-add peak a token at a time, 96% two at a time).
    One row at a time: each sum takes a multiply-add per row, at least its latency apart (the RowPass's
    row_pair holds that row twice; the template's pair_row_pass reads the first)."""
    assert ops.decay is None and second.decay is None and not ops.bits
    tokens = (ops, second)
    reads = [(t, rd, "before") for t in range(2) for rd in tokens[t].before]
    reads += [(t, rd, "after") for t in range(2) for rd in tokens[t].after]
    declarations = [_registers([f"y{t}{g}_{v} = lr_load({y} + j + {v * lanes})" for v in range(registers)],
                               "const vec") for t in range(2) for g, y in enumerate(tokens[t].rights)]
    declarations += [_registers([f"o{i}_{v} = {{0}}" for v in range(registers)], "vec") for i in range(len(reads))]
    declarations += [_registers([f"op{i}_{v} = {{0}}" for v in range(registers)], "vec") for i in range(len(next_w))]
    stores = [f"lr_store({rd.sums} + j + {v * lanes}, o{i}_{v});"
              for i, (_, rd, _) in enumerate(reads) for v in range(registers)]
    stores += [f"lr_store({p} + j + {v * lanes}, op{i}_{v});" for i, p in enumerate(next_p) for v in range(registers)]
    scalars = [f"const T x{t}{g} = {x}[i];" for t in range(2) for g, x in enumerate(tokens[t].lefts)]
    scalars += [f"const T q{i} = {rd.query}[i];" for i, (_, rd, _) in enumerate(reads)]
    scalars += [f"const T wn{i} = {w}[i];" for i, w in enumerate(next_w)]

    def register(v: int) -> str:
        lines = [f"vec s{v} = lr_load(row + {v * lanes});"]
        for t in range(2):
            lines += [_fma(f"o{i}_{v}", f"q{i}", f"s{v}") for i, (r, _, when) in enumerate(reads)
                      if r == t and when == "before"]
            lines.append(_update(f"s{v}", f"s{v}", [(f"x{t}{g}", f"y{t}{g}_{v}") for g in range(len(tokens[t].lefts))],
                                 True))
            if t == 1:
                lines.append(f"lr_store(row + {v * lanes}, s{v});")
            lines += [_fma(f"o{i}_{v}", f"q{i}", f"s{v}") for i, (r, _, when) in enumerate(reads)
                      if r == t and when == "after"]
        return block(lines + [_fma(f"op{i}_{v}", f"wn{i}", f"s{v}") for i in range(len(next_w))])
    row = PassRow("i", block(scalars), tuple(register(v) for v in range(registers)))
    return RowPass(ops.name, ops.comment + ", two tokens a pass", ops.state, ops.ld, ops.rows, None,
                   columns, registers * lanes, tuple(declarations), (row, row), None, tuple(stores), None, (), None)


def correction_pass(ops: MatrixOperands, *, lanes: int, columns: int, registers: int) -> CorrectionPass:
    """p_r = w_rᵀ·S for the corrections of a matrix state: `registers` registers of a row at a time, then
    the columns past the last whole register one by one."""
    whole = columns // lanes * lanes
    assert not (ops.bits and columns > whole), "bfloat16 bits in a pass: rows of whole registers only"

    def row(k: str, acc: str) -> CorrectionRow:
        lines = [f"const vec s{v} = {_load(ops, f'row + {v * lanes}')};" for v in range(registers)]
        for i, cr in enumerate(ops.corrections):
            lines += [f"const T w{i} = {cr.w}[{k}];"] + [_fma(f"{acc}{i}_{v}", f"w{i}", f"s{v}") for v in range(registers)]
        return CorrectionRow(k, tuple(lines))
    tail = None
    if columns > whole:
        tail = CorrectionTail(whole, columns, tuple(f"T a{i} = 0;" for i in range(len(ops.corrections))),
                              tuple(f"a{i} += {cr.w}[i] * sv;" for i, cr in enumerate(ops.corrections)),
                              tuple(f"{cr.p}[j] = a{i};" for i, cr in enumerate(ops.corrections)))
    return CorrectionPass(
        ops.name, ops.state, ops.ld, ops.rows, whole, registers * lanes,
        tuple(_registers([f"a{i}_{v} = {{0}}, e{i}_{v} = {{0}}" for v in range(registers)], "vec")
              for i in range(len(ops.corrections))),
        (row("i", "a"), row("i + 1", "e")), row(str(ops.rows - 1), "a") if ops.rows % 2 else None,
        tuple(f"lr_store({cr.p} + j + {v * lanes}, a{i}_{v} + e{i}_{v});"
              for i, cr in enumerate(ops.corrections) for v in range(registers)), tail, ops.bits)


def correction_arrays(ops: MatrixOperands, size: int) -> Lines:
    """The p of a token's corrections, rows of `size`."""
    return tuple(f"T {cr.p}[{size}] __attribute__((aligned(64)));" for cr in ops.corrections)
