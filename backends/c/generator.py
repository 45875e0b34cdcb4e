"""The C source of the recurrent form and the decode step: Generator plans the passes over each state of a
factorable recurrence (decay + rank-one corrections + rank-one writes, see compiler.transitions) — register
tiles, the lazy decay's bookkeeping, which outputs stream from the tile loop — and renders
templates/c_recurrent.c.j2 for one scalar type, one SIMD width and one assignment of sizes (dk, dv, … are
compile-time constants). c_backend builds and runs what it renders."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from ..compiler import Compiled, ir
from ..compiler.analysis import walk
from ..compiler.linearity import ONE, split_scalar
from ..dsl.errors import LinrecError

from .build import CTYPE_BYTES
from .kernel_source import STEP_PARALLEL_THRESHOLD, KernelSource, Target
from .printer import CPrinter, Local, UnprintableError, read_only_through_readouts
from .stabilize import Scales
from .support import fused_refusal
from ..version import VERSION

# SIMD registers the fused passes may hold (accumulators, right vectors); AVX-512 has 32.
REGISTER_BUDGET = 24
# The per-token values of a block of tokens (the sequence kernel's unit of work) should fit in L1 beside
# the state: the block holds as many tokens (8…64) as fit in this many bytes.
BLOCK_BYTES = 24 * 1024
# Multiply-adds a thread runs of one head before it looks for the head furthest behind (see lr_claim).
SEGMENT_WORK = 1 << 21
SPLIT_ALWAYS = False  # tests set it: every segment end splits a group of heads (lr_release)


def _sum(terms: list[ir.Expr], shape) -> ir.Expr:
    out = terms[0]
    for t in terms[1:]:
        if isinstance(t, ir.Neg):
            out = ir.Arith(shape, "sub", out, t.operand)
        else:
            out = ir.Arith(shape, "add", out, t)
    return out


def _divisor_at_most(n: int, limit: int) -> int:
    limit = max(1, min(n, limit))
    return next(g for g in range(limit, 0, -1) if n % g == 0) if n else 1


class Generator(KernelSource):
    """Builds the template's context for one (dtype, sizes)."""

    template = "c_recurrent.c.j2"

    def __init__(self, compiled: Compiled, dims: dict[str, int], target: Target):
        refusal = fused_refusal(compiled)  # (what this kernel takes is support.py's to say)
        if refusal:
            raise LinrecError(refusal)
        super().__init__(compiled, dims, target)
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

    # ---- the decode step: one token, the state updated in place in the caller's [B, H, *] arrays ----
    def step_region(self) -> dict:
        """The body of the step kernel for one (batch row, head): the token's values, then per state the
        corrections' p = wᵀS, the right vectors and one fused pass (rows of S at their true stride dv,
        with a column tail when dv is not a whole number of registers), then the outputs."""
        updates = readouts = step = True
        pr = CPrinter(self.target.ctype, self.dims, self.ref)
        states = []
        plans = []
        for st in self.program.states:
            tr = self.derivation.transition(st.name)
            plan = self._plan_state(st, tr, updates=updates, readouts=readouts)
            plans.append(plan)
        # declare everything this region prints, so that shared subexpressions are computed once
        for plan in plans:
            pr.expect(*[e for e in (plan["decay"],) if e is not None], *plan["w"], *plan["x"], *plan["y"],
                      *_queries(plan))
        pr.expect(*self.scales.exponents())
        outputs, scaled = self.scales.outputs(self.derivation.outputs, block=False)
        pr.expect(*[e for _, e in outputs])
        # 1. state-free values of the token (first the scales of stabilized states: the rest reads them)
        scale_lines = self.scales.token_lines(pr, scaled, block=False)
        for st, plan in zip(self.program.states, plans):
            plan["decay_code"] = None
            if plan["decay"] is not None:
                dec = plan["decay"]
                plan["decay_code"] = {"vector": bool(dec.shape),
                                      "code": pr.array(dec) if dec.shape else pr.scalar(dec)}
            plan["w_codes"] = [pr.array(w) for w in plan["w"]]
            plan["x_codes"] = [pr.array(x) for x in plan["x"]]
            plan["q_codes"] = [None if r.is_value else pr.array(r.query) for r in plan["readouts"]]
        prep = scale_lines + pr.take_token()
        # 2. per state: corrections, right vectors, the fused pass
        readout_decls = []
        for st, plan in zip(self.program.states, plans):
            matrix = len(st.shape) == 2
            rows = self.dims[st.shape[0]]
            cols = self.dims[st.shape[1]] if matrix else 1
            cols_padded = self.padded(cols) if matrix else 1
            ld = cols if step else cols_padded
            ncols = cols if step else cols_padded
            nfull = ncols // self.target.lanes
            y_lines = []
            y_names = []
            for gi, y in enumerate(plan["y"]):
                yname = self.local("y", self.cstate(st.name), gi)
                if matrix and isinstance(y, (ir.InputRef, ir.ParamRef)) and (step or cols == cols_padded):
                    y_names.append(pr.array(y))  # a value used as it is: read it in place
                    continue
                if matrix:
                    body = pr.fill(y, yname, cols)
                    pad = [f"for (int i = {cols}; i < {cols_padded}; ++i) {yname}[i] = 0;"] \
                        if cols_padded > cols else []
                    y_lines += pr.take_token() + [f"T {yname}[{cols_padded}] __attribute__((aligned(64)));"] \
                        + body + pad
                else:
                    code = pr.scalar(y)
                    y_lines += pr.take_token() + [f"const T {yname} = {code};"]
                y_names.append(yname)
            before, after = [], []
            for (r, q_code) in zip(plan["readouts"], plan["q_codes"]):
                entry = {"q": q_code, "r": f"r{r.index}", "value": r.is_value}
                (before if r.before_update else after).append(entry)
                readout_decls.append({"r": f"r{r.index}", "scalar": not matrix and not r.is_value,
                                      "size": rows if r.is_value else cols_padded})
            ng = len(plan["x"]) if updates else 0
            nr = len(before) + len(after)
            gv_u = _divisor_at_most(nfull, REGISTER_BUDGET // max(1, ng + 2 * nr + 1)) if nfull else 1
            gv_p = _divisor_at_most(nfull, REGISTER_BUDGET // max(1, 2 * len(plan["w"]) + 1)) if nfull else 1
            state = {
                "name": st.name, "c": self.cstate(st.name), "matrix": matrix, "rows": rows, "cols": ncols,
                "cols_padded": cols_padded, "S": self.local("buf", self.cstate(st.name)), "ld": ld, "nfull": nfull,
                "tail": ncols % self.target.lanes if matrix else 0, "update": updates,
                "decay": plan["decay_code"] if updates else None,
                "corrections": [{"w": w, "p": p.name} for w, p in zip(plan["w_codes"], plan["p"])],
                "groups": [{"x": x, "y": y} for x, y in zip(plan["x_codes"], y_names)],
                "y_lines": y_lines, "before": before, "after": after, "gv_u": gv_u, "gv_p": gv_p,
                "comment": self.derivation.transition(st.name).kind if updates else "readouts of the final state",
                "next": False,
                # read twice (corrections first): the update pass runs from L1 and can prefetch the next head
                "prefetch_next": matrix and bool(plan["w"]),
                "ahead": self.local("next", self.cstate(st.name)),  # (the next head's rows, for the prefetches)
            }
            states.append(state)
        # 3. outputs over the readouts
        out_lines = []
        for name, e in outputs:
            target = self.cout(name)
            if e.shape:
                body = pr.fill(e, self.row(target))
            else:
                body = [f"{target}[tok] = {pr.scalar(e)};"]
            out_lines += pr.take_token() + body
        return {"head": pr.take_head(), "prep": prep, "states": states, "readouts": readout_decls,
                "outputs": out_lines, "scales": self._scale_context(),
                "rows_read": self._rows_mentioned(prep, states, out_lines)}

    # ---- the sequence kernel: blocks of tokens in three phases ----
    def _token_pointer(self, e: ir.Expr) -> str | None:
        """A C pointer to token u's copy of a vector input or parameter (no copy needed), else None."""
        if isinstance(e, ir.InputRef):
            return f"({self.cin(e.name)} + ((b * ntok + t0 + u) * H + h) * {self.size(e.shape)})"
        if isinstance(e, ir.ParamRef) and e.shape:
            return self.ref(e)
        return None

    def block_region(self, prefix: str, *, updates: bool, readouts: bool) -> dict:
        """One block of tokens of one head: (1) every state-free value of every token into block arrays
        (and the bookkeeping of lazily applied decays), (2) the states over the block, (3) the outputs."""
        ct = self.target.ctype
        pr = CPrinter(ct, self.dims, self.ref, prefix)
        po = CPrinter(ct, self.dims, self.ref, prefix + "o")
        plans = [self._plan_state(st, self.derivation.transition(st.name), updates=updates, readouts=readouts)
                 for st in self.program.states]
        for plan in plans:
            pr.expect(*[e for e in (plan["decay"],) if e is not None], *plan["w"], *plan["x"], *_queries(plan),
                      *[e for terms in plan["terms"] for c, kind, v in terms for e in (c, v) if kind == "v"])
            if not plan["w"]:
                pr.expect(*plan["y"])
        pr.expect(*self.scales.exponents())
        outputs, scaled = self.scales.outputs(self.derivation.outputs, block=True) if readouts else ((), [])
        po.expect(*[e for _, e in outputs])
        arrays: list[tuple[str, int]] = []  # block arrays: name, values per token (0: one scalar)
        flags: set[str] = set()  # the block arrays of int32 flags (tested in the tiled passes' inner loops:
        # an integer compare, where a float's takes a vector port from the multiply-adds)
        prep: list[str] = []
        stored: set[str] = set()  # block arrays the lazy bookkeeping of a per-row decay stores itself

        exported: dict[tuple, str] = {}  # (e, n, padded) → the block array that holds e as it is

        def export_vector(e, name, n, padded=None, scale=None, to=prep, share=False) -> str:
            """e into block array `name`; `scale`: C for a factor of element i (a lazy decay's) it is
            multiplied by as it is stored (the array then no longer holds e: later uses compute e anew).
            share=True (callers that use the name returned): the name of a block array that already holds
            e, if any (S's and its normalizer z's keys and queries: one array each, not a copy per state)."""
            shared = scale is None and name not in stored
            if share and shared and (e, n, padded) in exported:
                return exported[(e, n, padded)]
            arrays.append((name, padded or n))
            if name in stored:  # by the lazy bookkeeping
                return name
            body = pr.fill(e, f"{name}[u]", n, keep=scale is None, scale=scale)
            pad = [f"for (int i = {n}; i < {padded}; ++i) {name}[u][i] = 0;"] if padded and padded > n else []
            to.extend(pr.take_token() + body + pad)
            if shared:
                exported.setdefault((e, n, padded), name)
            return name

        def export_scalar(e, name, to=prep):
            arrays.append((name, 0))
            code = pr.scalar(e)
            to.extend(pr.take_token() + [f"{name}[u] = {code};"])

        # the decays first: the lazy bookkeeping after them (phase 1) gives the factors by which the vectors
        # that meet a lazily decayed state are stored
        decay_prep = self.scales.token_lines(pr, scaled, block=True) if updates else []
        arrays += [(f"blk_rsc{i}", 0) for i in scaled]
        lazy: dict[str, dict] = {}
        for st, plan in zip(self.program.states, plans):
            decay = plan["decay"] if updates else None
            if decay is None:
                continue
            c, rows = self.cstate(st.name), self.dims[st.shape[0]]
            if len(st.shape) == 2 and decay.shape:
                arrays.append((self.local("blk_d", c), rows))
                lazy[st.name] = self._lazy_registers(pr, c, decay, plan)
                stored.update(s["array"] for s in lazy[st.name]["stores"])
                decay_prep.extend(pr.take_token())
                continue
            if decay.shape:
                export_vector(decay, self.local("blk_d", c), rows, to=decay_prep)
            else:
                export_scalar(decay, self.local("blk_d", c), to=decay_prep)
            if len(st.shape) == 2:  # a scalar decay, applied lazily: its factors are scalars, prep stores
                lazy[st.name] = {"scalars": {kind: self.local(kind, c) for kind in ("mw", "mx", "mq")}}

        states, lazies, readout_decls = [], [], []
        for st, plan in zip(self.program.states, plans):
            c = self.cstate(st.name)
            matrix = len(st.shape) == 2
            rows = self.dims[st.shape[0]]
            cols = self.dims[st.shape[1]] if matrix else 1
            cp = self.padded(cols) if matrix else 1
            nfull = cp // self.target.lanes if matrix else 0
            entry = {"name": st.name, "c": c, "matrix": matrix, "rows": rows, "cols": cp, "cols_padded": cp,
                     "S": self.local("buf", c), "ld": cp, "nfull": nfull, "tail": 0, "update": updates,
                     "comment": self.derivation.transition(st.name).kind if updates else "readouts of the final state"}
            decay = plan["decay"] if updates else None
            lz = lazy.get(st.name)

            def factor(kind):  # Ŝ = S/c: x/c for a token's writes, q⊙c for reads after it, c before it
                return lz["scalars"][kind] if lz and "scalars" in lz else None
            for r, w in enumerate(plan["w"]):
                export_vector(w, self.local("blk_w", c, r), rows, scale=factor("mw"))
            x_arrays = [export_vector(x, self.local("blk_x", c, g), rows, scale=factor("mx"), share=True)
                        for g, x in enumerate(plan["x"])]
            before, after = [], []
            for k, rd in enumerate(plan["readouts"]):
                if rd.is_value:  # a vector state's own value, copied row by row (no query)
                    (before if rd.before_update else after).append({
                        "q": None, "r": f"r{rd.index}_blk[u]", "value": True, "index": rd.index, "out": None})
                    readout_decls.append({"r": f"r{rd.index}", "blk": f"r{rd.index}_blk", "scalar": False,
                                          "size": rows})
                    arrays.append((f"r{rd.index}_blk", rows))
                    continue
                q_array = export_vector(rd.query, self.local("blk_q", c, k), rows,
                                        scale=factor("mw" if rd.before_update else "mq"), share=True)
                (before if rd.before_update else after).append({
                    "q": f"{q_array}[u]", "r": f"r{rd.index}_blk[u]", "base": q_array,
                    "value": False, "index": rd.index, "out": None})  # out: see _fuse_outputs
                readout_decls.append({"r": f"r{rd.index}", "blk": f"r{rd.index}_blk", "scalar": not matrix,
                                      "size": cp})
                arrays.append((f"r{rd.index}_blk", cp if matrix else 0))
            entry["before"], entry["after"] = before, after
            entry["decay"] = None if decay is None else {"vector": bool(decay.shape),
                                                         "code": f"{self.local('blk_d', c)}[u]"}
            entry["corrections"] = [{"w": f"{self.local('blk_w', c, r)}[u]", "p": p.name}
                                    for r, p in enumerate(plan["p"])]
            groups = []
            tiled = matrix and not plan["w"]
            for g, (x, y, terms) in enumerate(zip(plan["x"], plan["y"], plan["terms"])):
                group = {"x": f"{x_arrays[g]}[u]", "xbase": x_arrays[g]}
                if tiled:
                    # always copied to the block, even a plain input row: a tile reads y once per token and
                    # tile, and a row of the caller's (numpy's rows start 16 bytes into a cache line)
                    # splits every vector load in two. Measured at T = 16384: 7% faster with such rows,
                    # 4% with aligned ones (phase 1 brings the row to L1 for phase 2).
                    group["y"] = f"{export_vector(y, self.local('blk_y', c, g), cols, cp, share=True)}[u]"
                else:
                    group["y"] = self.local("y", c, g)
                    parts = []
                    for m, (coef, kind, payload) in enumerate(terms):
                        part = {"coef": None}
                        if coef != ONE:
                            export_scalar(coef, self.local("blk_k", c, g, m))
                            part["coef"] = f"{self.local('blk_k', c, g, m)}[u]"
                        if kind == "p":
                            part["src"] = plan["p"][payload].name
                        elif not payload.shape:
                            if payload != ONE:
                                export_scalar(payload, self.local("blk_v", c, g, m))
                                part["src"] = f"{self.local('blk_v', c, g, m)}[u]"
                            else:
                                part["src"] = None
                        else:
                            ptr = self._token_pointer(payload) if cols == cp else None
                            if ptr is None:
                                ptr = f"{export_vector(payload, self.local('blk_v', c, g, m), cols, cp, share=True)}[u]"
                            part["src"] = ptr
                        parts.append(part)
                    group["terms"] = parts
                groups.append(group)
            entry["groups"] = groups
            entry["kind"] = "vector" if not matrix else ("tiled" if tiled else "tokens")
            ng = len(groups) if updates else 0
            if entry["kind"] == "tiled":
                # wide tiles first: a row of four registers shares each broadcast of x and q over four
                # multiply-adds (measured ~8% faster than two registers for GLA at dv = 64)
                entry["ct"] = next(c for c in (4, 2, 1) if nfull % c == 0)
                budget = REGISTER_BUDGET + 4
                rt = next(r for r in (8, 6, 4, 3, 2, 1) if r * entry["ct"] + (ng + 2) * entry["ct"] <= budget)
                entry["rt"] = min(rt, rows)
                entry["rows_main"] = rows - rows % entry["rt"]
                entry["rt_tail"] = rows % entry["rt"]
            elif entry["kind"] == "tokens":
                nr = len(before) + len(after)
                nc = len(plan["w"])
                entry["gv_u"] = _divisor_at_most(nfull, REGISTER_BUDGET // max(1, ng + 2 * nr + 2 * nc + 1))
                entry["gv_p"] = _divisor_at_most(nfull, REGISTER_BUDGET // max(1, 2 * len(plan["w"]) + 1))
            if matrix and decay is not None:  # decays applied lazily: the bookkeeping runs in phase 1
                slow, flag = self.local("blk_slow", c), self.local("slow", c)
                arrays.append((slow, 0))
                flags.add(slow)
                entry["slow"] = f"{slow}[u]"
                occurs = {"mw": bool(plan["w"] or before), "mx": bool(groups), "mq": bool(after)}
                lazies.append({"name": st.name, "vector": bool(decay.shape), "rows": rows, "sc": self.local("sc", c),
                               "d": f"{self.local('blk_d', c)}[u]", "slow": f"{slow}[u]", "flag": flag,
                               "c": self.local("c", flag), "cn": self.local("cn", flag),
                               "factors": [kind for kind, yes in occurs.items() if yes],
                               "scalars": lz.get("scalars", {}),
                               "stores": lz.get("stores", []), "decay_v": lz.get("decay_v"),
                               "decay_e": lz.get("decay_e")})
            entry["pf_every"], entry["pf_rows"] = self._prefetch_pace(entry)
            entry["next"] = False
            entry["fast"] = dict(entry, decay=None)
            if entry["kind"] == "tokens" and plan["w"]:
                entry["corrections_first"] = [{"w": f"{self.local('blk_w', c, r)}[0]", "p": p.name}
                                              for r, p in enumerate(plan["p"])]
                nxt = [dict(e, wn=f"{self.local('blk_w', c, r)}[u + 1]") for r, e in enumerate(entry["corrections"])]
                with_next = dict(entry, corrections=nxt, next=True)
                with_next["fast"] = dict(with_next, decay=None)
                entry["with_next"] = with_next
            states.append(entry)
        head = pr.take_head()
        fused = self._fuse_outputs(states, outputs)
        # phase 3: outputs over the readouts
        out_lines, rows = [], []
        for name, e in outputs:
            if name in fused:
                continue
            target = self.cout(name)
            body = po.fill(e, self.row(target)) if e.shape else [f"{target}[tok] = {po.scalar(e)};"]
            out_lines += po.take_token() + body
            if e.shape:  # a row computed into a local, then streamed to its place (never a fused one)
                rows.append({"c": target, "row": self.row(target), "size": self.size(e.shape)})  # (its tile loop has written it)
        # the token's input rows each phase reads (its code mentions them, or it tests their range)
        checked = {self.row(self.cin(x.name)) for x in self.program.inputs if updates and self.outside(x)}
        return {"head": head + po.take_head(), "decay_prep": decay_prep, "prep": prep, "lazy": lazies,
                "scales": self._scale_context() if updates else [],
                "states": states, "checks": updates,
                "spread_prefetches": any(st["pf_every"] for st in states),
                "paced_prefetches": any(st["pf_every"] > 1 for st in states),  # (a tick counts the steps)
                "readouts": readout_decls, "outputs": out_lines, "output_rows": rows, "arrays": arrays,
                "flag_arrays": flags,
                "rows_read": self._rows_mentioned(decay_prep, prep, lazies) | checked,
                "rows_read_by_outputs": self._rows_mentioned(out_lines)}

    def _rows_mentioned(self, *code) -> set[str]:
        """The input rows (in_x_t) that generated code — strings, in lists and dicts — mentions: the rows a
        part of the kernel declares (declaring the others would only draw the compiler's warnings)."""
        text = "\n".join(_strings(code))
        rows = {self.row(self.cin(x.name)) for x in self.program.inputs}
        return {r for r in rows if re.search(rf"\b{re.escape(r)}\b", text)}

    def _lazy_registers(self, pr: CPrinter, c: str, decay: ir.Expr, plan: dict) -> dict:
        """The lazy bookkeeping of a matrix state with a per-row decay: it computes the decay and stores the
        vectors that meet Ŝ times their factors itself, a register at a time, c·D kept in registers (a
        third of phase 1 faster for GLA than through block arrays of factors). Values with no register-wise
        form (c_printer.lanes) are computed into a local row first."""
        vectors = ([(w, self.local("blk_w", c, r), "mw") for r, w in enumerate(plan["w"])]
                   + [(x, self.local("blk_x", c, g), "mx") for g, x in enumerate(plan["x"])]
                   + [(rd.query, self.local("blk_q", c, k), "mw" if rd.before_update else "mq")
                      for k, rd in enumerate(plan["readouts"])])
        for e in [decay] + [v for v, _, _ in vectors]:
            if not pr.has_lanes(e):
                pr.array(e)  # (then at hand)
        return {"decay_v": pr.lanes(decay, "i"), "decay_e": pr.lanes(decay, "i", whole=False),
                "stores": [{"array": name, "target": f"{name}[u]", "factor": factor, "v": pr.lanes(e, "i"),
                            "e": pr.lanes(e, "i", whole=False)} for e, name, factor in vectors]}

    def _fuse_outputs(self, states: list[dict], outputs) -> set[str]:
        """The outputs that are a readout as it is, of a tiled pass over whole registers: the pass's last
        tile of rows streams them to their rows (`out` of the readout), so they skip phase 3 and the block
        array (~3% on GLA). Returns their names."""
        uses = Counter(n.index for _, e in outputs for n in walk(e) if isinstance(n, ir.ReadoutRef))
        fused = set()
        for name, e in outputs:
            if not isinstance(e, ir.ReadoutRef) or uses[e.index] != 1:
                continue
            for entry in states:
                if entry["kind"] == "tiled" and entry["cols"] == self.size(e.shape):
                    for rd in entry["before"] + entry["after"]:
                        if rd["index"] == e.index:
                            rd["out"] = f"({self.cout(name)} + ((b * ntok + t0 + u) * H + h) * {entry['cols']})"
                            fused.add(name)
        return fused

    def _prefetch_pace(self, entry: dict) -> tuple[int, int]:
        """How a tiled pass issues the next block's rows: (steps of its inner loop per prefetched row, rows
        at each of those steps), so that every row is on its way before the pass ends, a row's lines at a
        time: one token's rows over one token's steps. A tiled pass is bound by its multiply-adds and has
        load slots to spare. (0, 0) for a pass token after token: it is bound by its loads and reads from L1,
        and prefetches inside it cost more than a burst in phase 1 (measured ~5% on gated DeltaNet)."""
        if entry["kind"] != "tiled" or not self.program.inputs:
            return 0, 0
        steps = entry["nfull"] // entry["ct"] * -(-entry["rows"] // entry["rt"])  # tiles, each once per token
        rows = len(self.program.inputs)
        return max(1, steps // rows), -(-rows // steps)

    def _plan_state(self, st: ir.State, tr, *, updates: bool, readouts: bool) -> dict:
        """The terms of a state's update, rank-one terms grouped by their left vector."""
        matrix = len(st.shape) == 2
        plan = {"decay": None, "w": [], "p": [], "x": [], "y": [], "readouts": [], "terms": []}
        if updates:
            plan["decay"], writes = self.scales.transition(tr)
            right_shape = (st.shape[1],) if matrix else ()
            groups: dict[ir.Expr, list[ir.Expr]] = {}
            parts: dict[ir.Expr, list[tuple]] = {}  # the same terms as (coefficient, "p" | "v", r | value)
            for r, (u, w) in enumerate(tr.corrections):
                p = Local(right_shape, self.local("p", self.cstate(st.name), r))
                plan["w"].append(w)
                plan["p"].append(p)
                coef, base = split_scalar(u)
                groups.setdefault(base, []).append(_scaled(coef, p, right_shape))
                parts.setdefault(base, []).append((coef, "p", r))
            for key, value in writes:
                coef, base = split_scalar(key)
                rhs = value if value is not None else ONE
                if matrix and not rhs.shape:
                    raise LinrecError(f"state '{st.name}': a write with a scalar value")
                groups.setdefault(base, []).append(_scaled(coef, rhs, right_shape))
                parts.setdefault(base, []).append((coef, "v", rhs))
            for base, terms in groups.items():
                plan["x"].append(base)
                plan["y"].append(_sum(terms, right_shape))
            plan["terms"] = list(parts.values())
        if readouts:
            for r in self.derivation.readouts:
                if r.state == st.name:
                    plan["readouts"].append(replace(r, query=self.scales.query(r)))
        return plan

    # ---- the whole file ----
    def context(self) -> dict:
        causal = self.program.causal
        if causal:
            forward_regions = [self.block_region("", updates=True, readouts=True)]
        else:  # non-causal: every output reads the final state, so run the updates first
            forward_regions = [self.block_region("", updates=True, readouts=False),
                               self.block_region("n", updates=False, readouts=True)]
        step_region = self.step_region() if causal else None
        lazy_rows = {lz["name"]: (lz["rows"] if lz["vector"] else 1) for r in forward_regions for lz in r["lazy"]}
        # block arrays: one allocation per thread, each array on a cache line, LR_BLOCK tokens of each
        sizes: dict[str, int] = {}
        flags = set().union(*(r["flag_arrays"] for r in forward_regions))
        for r in forward_regions:
            for name, n in r["arrays"]:
                sizes[name] = n
        per_token = sum(max(n, 1) for n in sizes.values()) * CTYPE_BYTES[self.target.ctype]
        block_tokens = 8
        while block_tokens < 64 and 2 * block_tokens * per_token <= BLOCK_BYTES:
            block_tokens *= 2
        # a segment (what a thread runs of a head before it looks for another, see lr_claim): whole blocks,
        # enough multiply-adds (~2M, tens of µs) that claiming a head and moving its state cost little
        work = sum(self.size(s.shape) for s in self.program.states) * (2 + len(self.derivation.readouts))
        segment_tokens = block_tokens
        while segment_tokens * work < SEGMENT_WORK and segment_tokens < 8192:
            segment_tokens *= 2
        align = 64 // CTYPE_BYTES[self.target.ctype]
        block_arrays, offset = [], 0
        for name, n in sizes.items():
            block_arrays.append({"name": name, "n": n, "offset": offset, "flag": name in flags})
            offset += -(-block_tokens * max(n, 1) // align) * align
        ct = self.target.ctype
        return dict(
            name=self.program.name, version=VERSION, filename=self.compiled.filename, source_comment=self.source_comment(),
            ctype=ct, vector_bytes=self.target.vector_bytes, lanes=self.target.lanes,
            dims=[(d.name, self.dims[d.name]) for d in self.program.dims],
            inputs=self.input_arrays(), outputs=self.output_arrays(),
            states=[{"c": self.cstate(s.name), "name": s.name, "matrix": len(s.shape) == 2,
                     "lazy_rows": lazy_rows.get(s.name, 0),  # (on whole cache lines: threads write them)
                     "lazy_stride": -(-lazy_rows.get(s.name, 0) // align) * align,
                     "rows": self.dims[s.shape[0]], "cols": self.dims[s.shape[1]] if len(s.shape) == 2 else 1,
                     "cols_padded": self.padded(self.dims[s.shape[1]]) if len(s.shape) == 2 else 1,
                     **self._buffers(s.name)}
                    for s in self.program.states],
            forward_regions=forward_regions, step_region=step_region, block_tokens=block_tokens,
            scales=self._scale_context(),
            segment_tokens=segment_tokens,
            split_always=SPLIT_ALWAYS,
            block_arrays=block_arrays, block_floats=max(offset, 1),
            step_work=work, step_parallel_threshold=STEP_PARALLEL_THRESHOLD,
            **self.entry_points(),
        )

    def _buffers(self, state: str) -> dict[str, str]:
        """The C names of a state's buffers in lr_forward: every head's (all, rows padded to whole registers)
        and this head's (buf), and its lazy decay's (all_sc, sc)."""
        c = self.cstate(state)
        return {"all": self.local("all", c), "buf": self.local("buf", c), "all_sc": self.local("all", "sc", c),
                "sc": self.local("sc", c)}

    def _scale_context(self) -> list[dict]:
        """Per group of stabilized states: its C name, the caller's log-scale array and the states' arrays
        (for the test that a state given at its true scale is all zero)."""
        return [{"g": g, "c": f"lsc{g}", "key": gr["key"], "names": ", ".join(gr["states"]),
                 "states": [{"c": self.cstate(n), "size": self.size(self.program.state(n).shape)} for n in gr["states"]]}
                for g, gr in enumerate(self.scales.groups)]


def _queries(plan) -> list[ir.Expr]:
    """The queries of a state's readouts (a read of the state as it is has none)."""
    return [r.query for r in plan["readouts"] if not r.is_value]


def _scaled(coef: ir.Expr, x: ir.Expr, shape) -> ir.Expr:
    if coef == ONE:
        return x
    if isinstance(coef, ir.Neg):
        return ir.Neg(shape, _scaled(coef.operand, x, shape))
    return ir.Arith(shape, "mul", coef, x)


def _strings(code) -> list[str]:
    """Every string in nested lists, tuples and dicts of generated code."""
    if isinstance(code, str):
        return [code]
    if isinstance(code, dict):
        code = list(code.values())
    if isinstance(code, (list, tuple)):
        return [s for part in code for s in _strings(part)]
    return []
