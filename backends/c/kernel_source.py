"""What the recurrent C sources share — the fused kernels (fused.py) and the statement-by-statement ones
(statements.py): the target they are written for, the file's C names, sizes, the arrays of the entry points and
the entry points themselves."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, is_dataclass
from math import prod

from ..compiler import Compiled, ir
from ..compiler.analysis import walk
from ..compiler.identifiers import Namespace
from ..dsl.errors import LinrecError
from ..templating import comment_lines, environment

from . import stack
from .build import CTYPE_BYTES, CTYPES
from .printer import CPrinter, Local

_DTYPE_NAMES = {ctype: dtype.name for dtype, ctype in CTYPES.items()}  # float → float32 (for messages)
# Below this many multiply-adds per call the step kernel runs on one thread (waking others costs more).
STEP_PARALLEL_THRESHOLD = 1 << 20
# Multiply-adds a thread of a sequence kernel should have at least (LR_THREAD_WORK in c_common.h.j2): a call
# starts no more threads than its work has of these (tests set it to 1 to run tiny sizes on several threads).
THREAD_WORK = 1 << 21


@dataclass(frozen=True)
class Target:
    ctype: str
    vector_bytes: int

    @property
    def lanes(self) -> int:
        return self.vector_bytes // CTYPE_BYTES[self.ctype]


@dataclass(frozen=True)
class StreamStore:
    """The non-temporal store of one register (lr_stream_vec in templates/c_common.h.j2): what it needs beside
    LR_STREAMS, its integer register type and its intrinsic."""

    guard: str       # C preprocessor condition added to LR_STREAMS ("" for none)
    register: str    # __m256i
    intrinsic: str   # _mm256_stream_si256


@dataclass(frozen=True)
class CommonHeader:
    """What templates/c_common.h.j2, the helpers of every recurrent kernel, is written for beyond T and the
    register width: the mask type of a comparison, the lazy decay's rescale bound, the store of a finished
    output register past the caches, and AVX-512's names for T."""

    mask_lane: str             # the integer type of a lane of lr_mask
    rescale_below: str         # LR_RESCALE_BELOW
    stream: StreamStore | None  # None: no non-temporal store of one register this wide
    avx512_lanes: int          # lanes of T in a 64-byte register
    avx512_compare: str        # AVX-512's compare of registers of T into a mask register
    avx512_splat: str          # … and its register of one value of T

    @staticmethod
    def of(target: Target) -> CommonHeader:
        single = target.ctype == "float"
        bits = target.vector_bytes * 8
        stream = None
        if target.vector_bytes in (16, 32, 64):
            stream = StreamStore(" && defined(__AVX512F__)" if bits == 512 else "", f"__m{bits}i",
                                 f"_mm{'' if bits == 128 else bits}_stream_si{bits}")
        suffix = "ps" if single else "pd"
        return CommonHeader("int32_t" if single else "int64_t", "1e-12f" if single else "1e-30", stream,
                            16 if single else 8, f"_mm512_cmp_{suffix}_mask", f"_mm512_set1_{suffix}")


@dataclass(frozen=True)
class InputArray:
    """An input of the entry points, [B, T, H, *] (the step's [B, H, *])."""

    c: str                     # the array (in_q)
    row: str                   # this token's row of it (in_q_t): a pointer, or the scalar itself
    size: int                  # values per token
    scalar: bool
    declaration: str           # of `row`, at token `tok`
    outside: str | None        # C for "element {v} lies outside the declared range (or is NaN)"; None: no range
    outside_lanes: str | None  # the same for a whole register {v}, as an lr_mask
    prefetch_lines: int        # the cache lines lr_prefetch_row issues for a row


@dataclass(frozen=True)
class OutputArray:
    """An output of the entry points, [B, T, H, *] (the step's [B, H, *])."""

    c: str            # the array (out_o)
    row: str          # this token's row of it (out_o_t); a scalar output is written as out_o[tok]
    size: int
    scalar: bool
    declaration: str  # of `row` as a pointer into the array, at token `tok` (for a vector output)


@dataclass(frozen=True)
class Argument:
    """A parameter of lr_step: its C name and its declaration."""

    name: str
    declaration: str


def common_context(target: Target) -> dict:
    """What templates/c_common.h.j2 needs for a target beyond the program (KernelSource.common; also the
    helpers' own test kernel, which renders the header alone)."""
    return dict(ctype=target.ctype, vector_bytes=target.vector_bytes, lanes=target.lanes,
                header=CommonHeader.of(target), thread_work=THREAD_WORK)


class KernelSource:
    """What the recurrent C sources share (the fused kernels, fused.py; statements.py's statement-by-statement
    ones): the file's C names; sizes; and the entry points, lr_forward, lr_step and lr_step_packed, over the
    arrays in one order (array_names).

    Names: every name of the program is bound first, with a prefix per role (input q → in_q, param W → prm_W,
    state S → st_S, output o → out_o, named value p → let_p); the names made of them (the row pointer in_q_t,
    buf_st_S, blk_w_st_S_0, …) come after, from the same Namespace (local(), row()), and get a numbered
    variant where a user's name holds their spelling (an input q_t beside q). The other names of the kernels
    (loop indices, registers, the lr_* helpers, the printers' s1 and v2, r0, ls0, …) have no role prefix, so
    no user name can reach them."""

    template = ""  # the file under templates/ that source() renders with context()
    writes_snapshots = False  # lr_forward_snapshots: the states after given token counts, written as it passes
    steps_slots = False       # lr_step_slots: the decode step over a pool of states, by slot
    state_is_bf16 = False     # the decode steps' states are bfloat16 bits (FusedKernel(…, state_is_bf16=True))
    bf16_in_pass = False      # … which the step's passes widen and round as they load and store them
    # a kernel over parts of the value axis (fused.py, value_split.py): `dims` holds a part's size of
    # `value_dim`, and a row of the caller's arrays along it holds `value_parts` parts; 1: the whole axis
    value_dim: str | None = None
    value_parts = 1

    def __init__(self, compiled: Compiled, dims: dict[str, int], target: Target):
        self.compiled = compiled
        self.program = compiled.program
        self.decomposition = compiled.decomposition
        self.dims = dims
        self.target = target
        p = self.program
        self.names = Namespace()
        for prefix, names in (("in_", [x.name for x in p.inputs]), ("prm_", [prm.name for prm in p.params]),
                              ("st_", [st.name for st in p.states]), ("out_", [o.name for o in p.outputs]),
                              ("let_", list(p.lets))):
            self.names.bind(names, prefix)

    # ---- identifiers ----
    def cin(self, name):
        return self.names.user(name, "in_")

    def cparam(self, name):
        return self.names.user(name, "prm_")

    def cstate(self, name):
        return self.names.user(name, "st_")

    def cout(self, name):
        return self.names.user(name, "out_")

    def clet(self, name):
        return self.names.user(name, "let_")

    def local(self, *parts) -> str:
        """The C name made of `parts` (blk_w, st_S, 0 → blk_w_st_S_0): the same parts give the same name."""
        return self.names.fresh("_".join(str(x) for x in parts), key=parts)

    def row(self, array: str) -> str:
        """This token's row of an input or output array (in_q → in_q_t): a pointer, or the scalar itself."""
        return self.local(array, "t")

    def size(self, shape) -> int:
        return prod(self.dims[d] for d in shape)

    def row_start(self, c: str, shape, tok: str) -> str:
        """C for where token `tok`'s row of array c (an input or output, values of `shape`) starts: c + tok·n
        (`tok`: a name or a parenthesized expression).
        In a kernel over parts of the value axis a caller's row along it holds every part, and this work
        item's columns start at part·n (`part`: the item's part, a local of the kernel)."""
        n = self.size(shape)
        if self.value_parts > 1 and self.value_dim in shape:
            return f"{c} + {tok} * {n * self.value_parts} + part * {n}"
        return f"{c} + {tok} * {n}"

    @property
    def steps(self) -> bool:
        """The file has the decode step (lr_step …): causal programs, over the whole value axis."""
        return self.program.causal and self.value_parts == 1

    def padded(self, n: int) -> int:
        lanes = self.target.lanes
        return (n + lanes - 1) // lanes * lanes

    # ---- leaves: a token's row of an input (in_x_t), a parameter (this head's), a kernel local ----
    def ref(self, node: ir.Expr) -> str:
        if isinstance(node, ir.InputRef):
            return self.row(self.cin(node.name))
        if isinstance(node, ir.ParamRef):
            base = self.cparam(node.name)
            n = self.size(node.shape)
            if node.per_head:
                return f"({base} + h * {n})" if node.shape else f"{base}[h]"
            return base if node.shape else f"{base}[0]"
        if isinstance(node, Local):
            return node.name
        raise LinrecError(f"the C backend cannot reference {type(node).__name__} here")

    def outside(self, x: ir.Input, lanes: bool = False) -> str | None:
        """C for "element {v} of input x lies outside its declared range (or is NaN)", or None: the sequence
        kernel tests every element as it reads the block, so run() need not scan the inputs first.
        lanes=True: the same test of a whole register {v}, as an lr_mask (all bits set in a lane outside)."""
        lit = CPrinter(self.target.ctype, self.dims, self.ref).literal
        tests = []
        if x.low is not None:
            tests.append(f"({{v}} {'>' if x.low_open else '>='} {lit(x.low)})")
        if x.high is not None:
            tests.append(f"({{v}} {'<' if x.high_open else '<='} {lit(x.high)})")
        if not tests:
            return None
        return f"{'~' if lanes else '!'}({' & '.join(tests)})"  # & rather than &&: the loop vectorizes

    def prefetch_lines(self, x: ir.Input) -> int:
        """The lines lr_prefetch_row issues for a row of input x: one per 64 bytes from its start, and one
        at its last byte (the line a row not on a line boundary reaches into); one for a scalar."""
        return -(-self.size(x.shape) * CTYPE_BYTES[self.target.ctype] // 64) + 1 if x.shape else 1

    # ---- the arrays ----
    def input_arrays(self) -> list[InputArray]:
        out = []
        for x in self.program.inputs:
            c, n = self.cin(x.name), self.size(x.shape)
            row = self.row(c)
            # (unused where a stage's kernel does not read this input: no warning for that under -Wall)
            declaration = f"const T *restrict {row} __attribute__((unused)) = {self.row_start(c, x.shape, 'tok')};" \
                if x.shape else f"const T {row} __attribute__((unused)) = {c}[tok];"
            out.append(InputArray(c, row, n, not x.shape, declaration, self.outside(x), self.outside(x, lanes=True),
                                  self.prefetch_lines(x)))
        return out

    def output_arrays(self) -> list[OutputArray]:
        out = []
        for o in self.program.outputs:
            c, n = self.cout(o.name), self.size(o.value.shape)
            row = self.row(c)
            out.append(OutputArray(c, row, n, not o.value.shape,
                                   f"T *restrict {row} = {self.row_start(c, o.value.shape, 'tok')};"))
        return out

    def rows_mentioned(self, *code) -> set[str]:
        """The input rows (in_x_t) that generated code mentions — strings, in lists, dicts and records: the rows
        a part of the kernel declares (declaring the others would only draw the compiler's warnings)."""
        text = "\n".join(_strings(code))
        rows = {x.row for x in self.input_arrays()}
        return {r for r in rows if re.search(rf"\b{re.escape(r)}\b", text)}

    # ---- the entry points ----
    def array_names(self) -> tuple[list[str], int]:
        """The C names of the arrays every entry point takes, in order — inputs and params (read), then
        states and outputs (written) — and how many are read."""
        p = self.program
        names = ([self.cin(x.name) for x in p.inputs] + [self.cparam(prm.name) for prm in p.params]
                 + [self.cstate(st.name) for st in p.states] + [self.cout(o.name) for o in p.outputs])
        return names, len(p.inputs) + len(p.params)

    def common(self) -> dict:
        """What every kernel's context gives templates/c_common.h.j2 alike (both kernels' templates include it;
        the inputs, LR_BLOCK's tokens and checks_inputs come with the rest of each context)."""
        return common_context(self.target)

    def entry_points(self) -> dict:
        """The signatures of lr_forward, lr_step (causal programs) and lr_step_packed, the struct the last
        takes, and lr_step's parameters (Argument)."""
        names, n_read = self.array_names()
        ct = self.target.ctype
        # a param that only other params' defaults read (Mamba-2's A_log, A = −exp(A_log)) is passed to every
        # entry point like the rest, and read by none
        unread = {self.cparam(prm.name) for prm in self.program.params} - {
            self.cparam(n.name) for step in self.program.steps for n in walk(step.value) if isinstance(n, ir.ParamRef)}
        # a bfloat16 state (state_is_bf16): the decode steps take the states as their bits (uint16_t), the
        # sequence kernel in T as always (prefill converts at its entry and exit, in Python)
        bits = {self.cstate(st.name) for st in self.program.states} if self.state_is_bf16 else set()

        def arguments(state_bits: set[str]) -> list[str]:
            return [f"{'const ' if i < n_read else ''}{'uint16_t' if name in state_bits else ct} *restrict {name}"
                    + (" __attribute__((unused))" if name in unread else "") for i, name in enumerate(names)]
        args, step_args = arguments(set()), arguments(bits)
        fwd = "int lr_forward(" + ", ".join(args + ["int64_t B", "int64_t ntok", "int64_t H", "int nthreads"]) + ")"
        snapshots = "int lr_forward_snapshots(" + ", ".join(
            args + ["int64_t B", "int64_t ntok", "int64_t H", "int nthreads", "const int64_t *restrict stops",
                    "int64_t nstops", f"{ct} *const *restrict snaps",
                    "const int64_t *restrict snap_strides"]) + ")"
        stp = "int lr_step(" + ", ".join(step_args + ["int64_t B", "int64_t H", "int nthreads"]) + ")"
        slots = "int lr_step_slots(" + ", ".join(
            step_args + ["const int64_t *restrict slots", "int64_t B", "int64_t H", "int nthreads"]) + ")"
        # (the arrays, then the slots of a pool: NULL for the ordinary step)
        call = f"typedef struct {{ void *arrays[{len(names) + 1}]; int64_t B, H; int nthreads; }} lr_step_call;"
        return dict(
            checks_inputs=any(self.outside(x) for x in self.program.inputs),  # (lr_inputs_outside is emitted)
            forward_signature=fwd, step_signature=stp if self.steps else "",
            snapshots_signature=snapshots if self.writes_snapshots else "", forward_arguments=", ".join(names),
            step_slots_signature=slots if self.steps_slots and self.steps else "",
            step_packed_signature="int lr_step_packed(const lr_step_call *call)", step_call_struct=call,
            step_args=[Argument(n, a) for n, a in zip(names, step_args)])

    def source_comment(self) -> str:
        """The program's source, for the generated file's opening comment."""
        return "   Source program:\n" + comment_lines(self.compiled.source.strip(), "       ", c=True)

    def context(self) -> dict:
        raise NotImplementedError

    def cdef(self) -> str:
        """The declarations cffi needs: the entry points without `restrict` and attributes."""
        sig = self.entry_points()
        strip = lambda s: s.replace("restrict ", "").replace(" __attribute__((unused))", "")  # noqa: E731
        out = strip(sig["forward_signature"]) + ";\n"
        if sig["snapshots_signature"]:
            out += strip(sig["snapshots_signature"]) + ";\n"
        if sig["step_signature"]:
            out += strip(sig["step_signature"]) + ";\n" + sig["step_call_struct"] + "\n" \
                + sig["step_packed_signature"] + ";\n"
        if sig["step_slots_signature"]:
            out += strip(sig["step_slots_signature"]) + ";\n"
        return out

    def source(self) -> str:
        """The kernel's C source, refused (LinrecError) where its sizes would overflow a thread's stack: every
        kernel is built, emitted or exported from this text, so no kernel that does is ever run (c.stack)."""
        # (the template's macro definitions come first and render as blank lines)
        text = environment(__package__).get_template(self.template).render(**self.context()).lstrip("\n")
        stack.check(text, self.target.ctype, self.dims, self.target.lanes,
                    f"the C kernel of '{self.program.name}' ({_DTYPE_NAMES[self.target.ctype]})")
        return text


def _strings(code) -> list[str]:
    """Every string in nested lists, tuples, sets, dicts and records (dataclasses) of generated code."""
    if isinstance(code, str):
        return [code]
    if is_dataclass(code):
        code = [getattr(code, f.name) for f in fields(code)]
    elif isinstance(code, dict):
        code = list(code.values())
    if isinstance(code, (list, tuple, set, frozenset)):
        return [s for part in code for s in _strings(part)]
    return []
