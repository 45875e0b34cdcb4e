"""Kernels an engine embeds without Python: `linrec emit FILE --backend c --standalone --out DIR`.

NAME.c holds the recurrent form's kernel source — the very file c.backend builds through cffi (c.fused's
fused kernel, else c.statements' statement-by-statement one) — once per dtype, float32 then float64, and
after them the public entry points (templates/c_standalone.c.j2) over a clean ABI that NAME.h declares and
documents (templates/c_standalone.h.j2): the prefill, the prefill with checkpoints and the last K states,
the decode step and the slot-pool decode step, each as NAME_*_f32 and NAME_*_f64.

The two kernel sources define the same file-scope names (T, vec, lr_forward, LR_BLOCK, …), so each is put in
a namespace of its own: every identifier of the kernel's own vocabulary (`lr_*`, `LR_*`, and T, VW, vec) is
renamed with the dtype's prefix (lr_forward → lr32_forward), outside comments and literals, and the entry
points become static (an engine links several programs: only NAME_* is exported). User names never reach
that vocabulary: the kernels spell them with a role prefix (in_q, st_S, prm_A, …; see c.kernel_source).

Checkpoints and the last K states come from the same kernel, run over the stretches between the tokens at
which a state is wanted (each call goes on from the state the last one left): a checkpoint is the state
after (j + 1)·C tokens, and each of the last K tokens is one decode step. The slot-pool step runs the
decode step on each request's row of the pool (threads across the requests when there are enough of them).
Both check every argument before any state changes, and the inputs' declared ranges before any kernel runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

import numpy as np

from ..compiler import Compiled, ir
from ..compiler.analysis import refs
from ..compiler.identifiers import Namespace, exported_identifier
from ..dsl.errors import LinrecError
from ..interface import FUSED, STATEMENTS
from ..templating import c_comment_text, comment_lines, environment
from ..version import VERSION

from . import backend as c_backend
from . import build as c_build
from .kernel_source import KernelSource, Target
from .stack import STACK_BUDGET
from .stabilize import Scales

ABI_VERSION = 1
# (dtype, suffix of the public names, C type, prefix of the kernel's renamed vocabulary)
DTYPES = ((np.float32, "f32", "float", "lr32"), (np.float64, "f64", "double", "lr64"))
# the kernels' file-scope names without an lr_/LR_ prefix (c_common.h.j2: the scalar and register types)
_BARE_NAMES = {"T": "{p}_T", "vec": "{p}_vec", "VW": "{P}_VW"}
# a C comment, a string or character literal (left alone), or an identifier
_TOKEN = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|\b[A-Za-z_]\w*", re.S)
# the names of the public entry points' fixed arguments (user names are prefixed: they never take these)
FIXED = ("n_batch", "n_tokens", "n_heads", "n_requests", "n_slots", "nthreads", "state_every", "keep_last",
         "slots")
SIZE_LIMIT = 2**31 - 1  # batch rows, tokens, heads, requests, slots: the kernels count some of them in ints


@dataclass(frozen=True)
class Array:
    """One array argument of the public entry points."""

    c: str          # its parameter name (in_q, prm_A, st_S, …)
    role: str       # input, param, state, log-scale, output, checkpoint, last
    dsl: str        # what it is in the program ("q", "S", "the log-scale of S, z")
    size: int       # values per (batch row, head): per token for inputs and outputs; a param's whole size
    shape: str      # its trailing axes, e.g. "dk=16, dv=16" ("" for a scalar per token)
    per_head: bool  # params: [H, *] (else [*])
    scales: tuple[str, ...] = ()  # a log-scale: the states it scales

    @property
    def written(self) -> bool:
        return self.role not in ("input", "param")


@dataclass(frozen=True)
class Argument:
    """One parameter of a public entry point: an array (`array`), or an integer (`kind` int64 / int)."""

    name: str
    kind: str              # "array", "slots", "int64" or "int"
    array: Array | None = None
    layout: str = ""       # the array's shape in this function, e.g. "[B, T, H, dk=16]"

    @property
    def written(self) -> bool:
        return self.array is not None and self.array.written


@dataclass(frozen=True)
class Function:
    """A public entry point for one dtype: NAME_{what}_{suffix}."""

    name: str
    what: str              # prefill, prefill_snapshots, step, step_slots
    ctype: str
    arguments: list[Argument]

    def parameters(self) -> list[str]:
        """Each parameter's C declaration (const for the arrays read)."""
        out = []
        for a in self.arguments:
            if a.kind == "array":
                out.append(f"{'' if a.written else 'const '}{self.ctype} *{a.name}")
            elif a.kind == "slots":
                out.append(f"const int64_t *{a.name}")
            else:
                out.append(f"{'int64_t' if a.kind == 'int64' else 'int'} {a.name}")
        return out

    def declaration(self) -> str:
        return f"int {self.name}(" + ", ".join(self.parameters()) + ")"


def refusal(compiled: Compiled) -> str | None:
    """Why the program has no standalone kernels (a reason, with what runs it instead), or None."""
    name = compiled.program.name
    why = c_backend.why_not(compiled, "recurrent")
    if why:
        return f"'{name}' has no recurrent C kernel to export: {why}"
    if compiled.decomposition.sequence is not None:
        return (f"'{name}' reads the whole visible sequence (attention: a cache that grows with the tokens, not a "
                f"state of fixed size), and the standalone export holds recurrent kernels over a fixed-size state "
                f"only; its C attention kernels run from Python (linrec run --backend c)")
    if c_backend.recurrent_kernel(compiled) not in (FUSED, STATEMENTS):
        return (f"'{name}' runs its recurrent form in C as a scan that NumPy prepares (a non-causal program with "
                f"exponential feature maps), which has no C entry point of its own to export; it runs from "
                f"Python (linrec run --backend c)")
    return None


class Standalone:
    """The files of one program's standalone export at one assignment of sizes."""

    def __init__(self, compiled: Compiled, dims: dict[str, int], heads: int | None = None,
                 params: dict[str, np.ndarray] | None = None, vector_bytes: int | None = None):
        why = refusal(compiled)
        if why:
            raise LinrecError(why)
        self.compiled = compiled
        self.program = p = compiled.program
        self.dims = {d.name: int(dims.get(d.name, d.default)) for d in p.dims}
        self.heads = heads
        self.params = {k: np.asarray(v, np.float64) for k, v in (params or {}).items() if v is not None}
        self.vector_bytes = c_build.vector_bytes() if vector_bytes is None else vector_bytes
        self.causal = p.causal
        # (not the kernels' renamed vocabulary, nor the entry points' helpers: lrs_*)
        self.prefix = exported_identifier(p.name, reserved={"lr32", "lr64", "lrs"})
        self.macro = self.prefix.upper()
        names = Namespace(reserved=set(FIXED))
        for prefix, group in (("in_", [x.name for x in p.inputs]), ("prm_", [prm.name for prm in p.params]),
                              ("st_", [s.name for s in p.states]), ("out_", [o.name for o in p.outputs]),
                              ("dim_", [d.name for d in p.dims])):
            names.bind(group, prefix)
        self.names = names
        self.kernels = [c_backend.recurrent_source(compiled, self.dims, Target(ct, self.vector_bytes))
                        for _, _, ct, _ in DTYPES]
        first = self.kernels[0]
        self.checks_inputs = bool(first.entry_points()["checks_inputs"])
        self.kernel_kind = c_backend.recurrent_kernel(compiled)
        self._arrays()

    # ---- the arrays, in the kernels' order ----
    def _shape(self, axes) -> str:
        return ", ".join(f"{c_comment_text(d)}={self.dims[d]}" for d in axes)

    def _size(self, axes) -> int:
        return prod(self.dims[d] for d in axes)

    def _arrays(self) -> None:
        p, n = self.program, self.names
        self.inputs = [Array(n.user(x.name, "in_"), "input", x.name, self._size(x.shape), self._shape(x.shape), False)
                       for x in p.inputs]
        self.param_arrays = [Array(n.user(prm.name, "prm_"), "param", prm.name, self._size(prm.shape),
                                   self._shape(prm.shape), prm.per_head) for prm in p.params]
        self.states = [Array(n.user(s.name, "st_"), "state", s.name, self._size(s.shape), self._shape(s.shape), False)
                       for s in p.states]
        # stabilized states (exponential feature maps, c.stabilize): the fused kernel carries them as
        # S·exp(−σ), with σ [B, H] per group of states after the states
        groups = Scales(self.compiled).groups if self.kernel_kind == FUSED else []
        self.scales = [Array(n.fresh(f"log_scale_{n.user(gr['states'][0], 'st_')}"), "log-scale",
                             ", ".join(gr["states"]), 1, "", False, tuple(gr["states"])) for gr in groups]
        self.outputs = [Array(n.user(o.name, "out_"), "output", o.name, self._size(o.value.shape),
                              self._shape(o.value.shape), False) for o in p.outputs]
        carried = self.states + self.scales
        self.checkpoints = [Array(n.fresh(f"ckpt_{a.c}"), "checkpoint", a.dsl, a.size, a.shape, False, a.scales)
                            for a in carried]
        self.lasts = [Array(n.fresh(f"last_{a.c}"), "last", a.dsl, a.size, a.shape, False, a.scales) for a in carried]
        self.dim_macros = [(d.name, f"{self.macro}_{n.user(d.name, 'dim_')}", self.dims[d.name]) for d in p.dims]

    @property
    def carried(self) -> list[Array]:
        """What a (batch row, head) carries from token to token: the states, then their log-scales."""
        return self.states + self.scales

    # ---- the public entry points ----
    def functions(self, suffix: str, ctype: str) -> list[Function]:
        def arrays(group, layout):
            return [Argument(a.c, "array", a, layout(a)) for a in group]

        def tail(a: Array) -> str:
            return (", " + a.shape) if a.shape else ""

        def param(a: Array) -> str:
            return "[" + ", ".join((["H"] if a.per_head else []) + ([a.shape] if a.shape else [])) + "]"

        seq = lambda a: f"[B, T, H{tail(a)}]"  # noqa: E731
        row = lambda a: f"[B, H{tail(a)}]"  # noqa: E731
        common = arrays(self.inputs, seq) + arrays(self.param_arrays, param) + arrays(self.carried, row)
        outs = arrays(self.outputs, seq)
        sizes = [Argument("n_batch", "int64"), Argument("n_tokens", "int64"), Argument("n_heads", "int64"),
                 Argument("nthreads", "int")]
        name = f"{self.prefix}_{{}}_{suffix}"
        out = [Function(name.format("prefill"), "prefill", ctype, common + outs + sizes)]
        if not self.causal:
            return out
        out.append(Function(
            name.format("prefill_snapshots"), "prefill_snapshots", ctype,
            common + outs + [Argument("state_every", "int64")]
            + arrays(self.checkpoints, lambda a: f"[B, T / state_every, H{tail(a)}]")
            + [Argument("keep_last", "int64")] + arrays(self.lasts, lambda a: f"[B, keep_last, H{tail(a)}]")
            + sizes))
        out.append(Function(name.format("step"), "step", ctype,
                            arrays(self.inputs, row) + arrays(self.param_arrays, param) + arrays(self.carried, row)
                            + arrays(self.outputs, row)
                            + [Argument("n_batch", "int64"), Argument("n_heads", "int64"), Argument("nthreads", "int")]))
        pool = lambda a: f"[P, H{tail(a)}]"  # noqa: E731
        req = lambda a: f"[N, H{tail(a)}]"  # noqa: E731
        out.append(Function(name.format("step_slots"), "step_slots", ctype,
                            arrays(self.inputs, req) + arrays(self.param_arrays, param) + arrays(self.carried, pool)
                            + arrays(self.outputs, req)
                            + [Argument("slots", "slots", layout="[N]"), Argument("n_requests", "int64"),
                               Argument("n_slots", "int64"), Argument("n_heads", "int64"), Argument("nthreads", "int")]))
        return out

    def all_functions(self) -> list[Function]:
        return [f for _, suffix, ct, _ in DTYPES for f in self.functions(suffix, ct)]

    # ---- the params' defaults ----
    def param_layout(self) -> list[tuple[Array, int, int]]:
        """(param, offset, count) of each param with a default in NAME_params.bin, in argument order."""
        out, offset = [], 0
        if self.heads is None:
            return out
        for a in self.param_arrays:
            value = self.params.get(a.dsl)
            if value is None:
                continue
            count = (self.heads if a.per_head else 1) * a.size
            if value.size != count:
                raise LinrecError(f"the default of param '{a.dsl}' has {value.size} values, not {count}")
            out.append((a, offset, count))
            offset += count
        return out

    def missing_defaults(self) -> list[tuple[Array, str]]:
        """The params NAME_params.bin lacks, the engine's to supply, each with why: "" (no default in the file), or
        the params without one that its default reads (`lam = exp(−exp(A))` with A left to the engine: the
        engine computes lam from its A, as the kernel takes every param computed)."""
        declared = {prm.name: prm for prm in self.program.params}
        out = []
        for a in self.param_arrays:
            if a.dsl in self.params:
                continue
            default = declared[a.dsl].default
            reads = [n for n in refs(default, ir.ParamRef) if n not in self.params] if default is not None else []
            out.append((a, ", ".join(f"'{c_comment_text(n)}'" for n in reads)))
        return out

    def params_file(self) -> bytes | None:
        """The params' defaults at `heads` heads, float64 little-endian, one after another (None: no defaults)."""
        layout = self.param_layout()
        if not layout:
            return None
        return b"".join(np.ascontiguousarray(self.params[a.dsl], "<f8").tobytes() for a, _, _ in layout)

    # ---- the files ----
    def context(self) -> dict:
        p = self.program
        return dict(
            name=p.name, prefix=self.prefix, macro=self.macro, version=VERSION, abi_version=ABI_VERSION,
            filename=c_comment_text(self.compiled.filename),
            source_lines=comment_lines(self.compiled.source.strip(), "       ", c=True),
            causal=self.causal, kernel_kind=self.kernel_kind, vector_bytes=self.vector_bytes,
            dims=self.dim_macros, inputs=self.inputs, params=self.param_arrays, states=self.states,
            scales=self.scales, outputs=self.outputs, checkpoints=self.checkpoints, lasts=self.lasts,
            carried=self.carried, heads=self.heads, param_layout=self.param_layout(),
            missing_defaults=self.missing_defaults(),
            checks_inputs=self.checks_inputs, size_limit=SIZE_LIMIT, zip=zip, stack_budget_mib=STACK_BUDGET >> 20,
            max_size=max(a.size for a in self.inputs + self.param_arrays + self.carried + self.outputs),
            dtypes=[dict(suffix=suffix, ctype=ct, kp=kp, functions={f.what: f for f in self.functions(suffix, ct)})
                    for _, suffix, ct, kp in DTYPES],
        )

    def header(self) -> str:
        return environment(__package__).get_template("c_standalone.h.j2").render(**self.context())

    def source(self) -> str:
        sections = [_namespaced(k, kp) for k, (_, _, _, kp) in zip(self.kernels, DTYPES)]
        return environment(__package__).get_template("c_standalone.c.j2").render(
            sections=sections, **self.context())

    def files(self) -> dict[str, bytes]:
        """File name → contents: NAME.h, NAME.c and, when a param has a default, NAME_params.bin."""
        out = {f"{self.prefix}.h": self.header().encode(), f"{self.prefix}.c": self.source().encode()}
        params = self.params_file()
        if params is not None:
            out[f"{self.prefix}_params.bin"] = params
        return out


def _namespaced(kernel: KernelSource, kp: str) -> str:
    """The kernel's source with its vocabulary renamed into `kp` (lr_forward → lr32_forward, LR_BLOCK →
    LR32_BLOCK, T → lr32_T) and its entry points static."""
    upper = kp.upper()

    def rename(m: re.Match) -> str:
        tok = m.group(0)
        if tok[0] in "/\"'":
            return tok
        if tok.startswith("lr_"):
            return f"{kp}_{tok[3:]}"
        if tok.startswith("LR_"):
            return f"{upper}_{tok[3:]}"
        bare = _BARE_NAMES.get(tok)
        return bare.format(p=kp, P=upper) if bare else tok
    text = _TOKEN.sub(rename, kernel.source())
    # every function the kernel defines at file scope without `static` (lr_forward, lr_step, …): file-local
    text = re.sub(rf"^(?!static\b)((?:const\s+)?[A-Za-z_]\w*\s*\**\s*)({kp}_\w+\()",
                  r"static __attribute__((unused)) \1\2", text, flags=re.M)
    entry = ["forward"] + (["step"] if kernel.program.causal else [])
    for fn in entry:  # (what the public entry points call)
        if not re.search(rf"^static __attribute__\(\(unused\)\) int {kp}_{fn}\(", text, flags=re.M):
            raise RuntimeError(f"internal error: the kernel source defines no lr_{fn} at the line start")
    return text


def export(compiled: Compiled, dims: dict[str, int], heads: int | None = None,
           params: dict[str, np.ndarray] | None = None) -> dict[str, bytes]:
    """The standalone files of a program (see Standalone.files)."""
    return Standalone(compiled, dims, heads, params).files()
