"""The C recurrent form and decode step of a program the fused kernels do not take, statement by statement.

The fused kernel (c.fused) needs every update factored as a decay plus rank-one terms and every read of a
matrix state a readout q·S. Everything else the DSL writes runs here, as the NumPy recurrent form runs it:
an elementwise decay of a matrix (Mamba-1's exp(A⊗dt)*S), a factor on the right (S·diag(d)), a dense
transition (W·S), a write that reads another state, a read from the right (S·q). Per (batch row, head)
the kernel runs the token's statements in the order written, each state updated in place.

Every value is a loop over its elements (StatementPrinter). Elementwise arithmetic on matrices is fused
into the loop that consumes it, and products go by their structure — diag(d)·X scales rows, (u⊗w)·X is
u⊗(w·X), sums and scalar multiples distribute, (A·B)·X is A·(B·X) — so a rank-one correction of a state
costs a vector product, not a matrix product. What has no such structure (a vector times a matrix, a
product of two dense matrices) is computed first, into a local vector or a per-thread scratch matrix: the
loop that writes a state then reads no element of it but the one it writes, which is why the update can
run in place.

A state named before its update is S_(t−1), after it S_t: at each point of the token the buffer holds the
one the statement names. A named value that reads a state (`p = k·S`) is computed where it is defined;
state-free ones are inlined, so that what they share is computed once (CPrinter's common subexpressions).
"""
from __future__ import annotations

from contextlib import contextmanager

from ..compiler import Compiled, ir
from ..compiler.analysis import to_text, walk
from ..dsl.errors import LinrecError
from ..templating import c_comment_text

from .kernel_source import STEP_PARALLEL_THRESHOLD, KernelSource, Target
from .printer import (_ELEMENTWISE, _ROWS, MATRIX_LEAVES, CPrinter, by_registers, elu_plus_one, token_variant,
                      vector_product)
from .support import fused_refusal, printed_statements, statements_refusal
from ..version import VERSION


def _rank(e: ir.Expr) -> int:
    return len(e.shape)


def _scalar_times(e: ir.Expr) -> tuple[ir.Expr, ir.Expr] | None:
    """(s, B) for a scalar times a matrix written s*B, s·B or B·s; else None."""
    if isinstance(e, ir.Arith) and e.op == "mul" and not e.left.shape:
        return e.left, e.right
    if isinstance(e, ir.Dot) and not (e.left.shape and e.right.shape):
        return (e.left, e.right) if not e.left.shape else (e.right, e.left)
    return None


def _costly(e: ir.Expr) -> bool:
    """Worth computing once when used twice: a builtin or a product somewhere inside (else recomputed)."""
    return any(isinstance(n, (ir.Apply, ir.Dot)) for n in walk(e))


class StatementPrinter(CPrinter):
    """CPrinter with matrices: melem(e, i, j) is element (i, j) of a matrix expression, fused into the loop
    that calls it; vector·matrix and matrix·vector products (other than a parameter matrix times a vector,
    lr_matvec) are computed into local arrays. Matrices computed whole go to the per-thread buffer `scr`;
    `scratch` is how many elements they take."""

    def __init__(self, ctype: str, dims: dict[str, int], ref, prefix: str = ""):
        super().__init__(ctype, dims, ref, prefix)
        self.scratch = 0
        self._matrices: dict[ir.Expr, str] = {}  # matrix expression → its scratch pointer's name
        # while matrix_store prints its element: what its loop over the rows runs before the loop over a row
        self._row_prologue: list[str] | None = None

    def cols(self, e: ir.Expr) -> int:
        return self.size(e.shape[1])

    def scratch_block(self, n: int) -> int:
        """The offset in `scr` of n more elements (from a whole cache line)."""
        offset = self.scratch
        self.scratch += -(-n // 16) * 16
        return offset

    @contextmanager
    def _loop(self, prologue: list[str] | None):
        """Around the printing of the element code of one loop over (i, j): the lines its loop over the rows runs
        before each row (matrix_store's), or None (a loop printed before the one that needs it: a vector
        product's, a product's — it has no rows of that loop's). Every loop over (i, j) this printer prints
        enters it, so that _row_builtin's rows go to the loop that reads them."""
        outer, self._row_prologue = self._row_prologue, prologue
        try:
            yield
        finally:
            self._row_prologue = outer

    def matrix_store(self, target: str, rows: int, cols: int, element) -> list[str]:
        """target[i, j] = element("i", "j") for every element, rows of `cols`. A builtin with a row helper of a
        token's matrix (Mamba-1's exp(A·diag(dt))) goes a row at a time into a buffer first (_row_builtin)."""
        return self._matrix_loop(target, rows, cols, *self._element_by_rows(element))

    def _element_by_rows(self, element) -> tuple[str, list[str]]:
        """element("i", "j") printed, and what the loop over the rows must run before each row."""
        prologue: list[str] = []
        with self._loop(prologue):
            code = element("i", "j")
        return code, prologue

    @staticmethod
    def _matrix_loop(target: str, rows: int, cols: int, code: str, prologue: list[str]) -> list[str]:
        return [f"for (int i = 0; i < {rows}; ++i) {{", *(f"    {line}" for line in prologue), "    #pragma omp simd",
                f"    for (int j = 0; j < {cols}; ++j) {target}[i * {cols} + j] = {code};", "}"]

    def _row_builtin(self, e: ir.Apply, i: str, j: str) -> str | None:
        """Row i of builtin e of a per-token matrix, into a buffer by the builtin's row helper (whole registers,
        c_common.h.j2), where matrix_store's loop over the rows prints it: GCC vectorizes a loop over the scalar
        lr_exp, but with its two-halves scaling where lr_exp_v has one vscalefps (Mamba-1's update, dk = dv = 64:
        1.78 against 1.10 µs a token and head, measured alone). The argument may read the state being written
        only at (i, j), as every element code of an update does, so row i is read before it is written. None
        where there is no such row: outside matrix_store's element, or in a loop it prints before its own (_loop)."""
        if self._row_prologue is None or (i, j) != ("i", "j") or e.function not in _ROWS or not token_variant(e):
            return None
        cols = self.cols(e)
        name = self._name(e, "r")
        argument = self.melem(e.args[0], "i", "j")  # (its own row buffers, if any, are printed first)
        self._row_prologue += [f"T {name}[{cols}];{self._comment(e)}", "#pragma omp simd",
                               f"for (int j = 0; j < {cols}; ++j) {name}[j] = {argument};",
                               f"{_ROWS[e.function]}({name}, {name}, {cols});"]
        return f"{name}[{j}]"

    def _row_power(self, e: ir.Arith, i: str, j: str) -> str | None:
        """Row i of x^y, a per-token matrix whose exponent is not one the printer writes as products, a register
        at a time (lr_pow_v: lr_pow in a loop is a branch and a libm call apart, which no loop vectorizes) into a
        buffer where matrix_store's loop over the rows prints it, its matrix operands' rows into buffers first;
        None where there is no such row (as _row_builtin)."""
        if self._row_prologue is None or (i, j) != ("i", "j") or not token_variant(e) \
                or not self._general_pow(e, rank=2):
            return None
        cols = self.cols(e)
        name = self._name(e, "r")
        whole, tail = [], []
        for x in (e.left, e.right):
            if not x.shape:
                code = self.scalar(x)
                whole.append(f"lr_splat({code})")
                tail.append(code)
                continue
            if isinstance(x, MATRIX_LEAVES):  # (its row where it lies)
                row = f"({self.ref(x)} + i * {cols})"
            else:
                row = self._name(x, "r")
                argument = self.melem(x, "i", "j")  # (its own row buffers, if any, are printed first)
                self._row_prologue += [f"T {row}[{cols}];{self._comment(x)}", "#pragma omp simd",
                                       f"for (int j = 0; j < {cols}; ++j) {row}[j] = {argument};"]
            whole.append(f"lr_load({row} + jj)")
            tail.append(f"{row}[jj]")
        self._row_prologue += [f"T {name}[{cols}];{self._comment(e)}",
                               *by_registers(name, cols, "jj", f"lr_pow_v({', '.join(whole)})",
                                             f"lr_pow({', '.join(tail)})")]
        return f"{name}[{j}]"

    def _part(self, x: ir.Expr, i: str, j: str = "") -> str:
        if not j:
            return super()._part(x, i)
        return self.scalar(x) if not x.shape else self.melem(x, i, j)

    # ---- vectors: products with a matrix (printer.vector_product) ----
    def _elem(self, e: ir.Expr, i: str) -> str:
        if vector_product(e):
            return f"{self.array(e)}[{i}]"
        return super()._elem(e, i)

    def array(self, e: ir.Expr) -> str:
        if e in self._cache or not vector_product(e):
            return super().array(e)
        name = self._name(e, "v")
        lines = self._product_into(e, name)
        self._sink(e).extend([f"T {name}[{self.size(e.shape[0])}];{self._comment(e)}"] + lines)
        self._cache[e] = name
        return name

    def store(self, e: ir.Expr, target: str) -> list[str]:
        """Statements that store vector e into `target` (a vector product straight into it)."""
        if e in self._cache or not vector_product(e):
            return self.fill(e, target)
        return self._product_into(e, target)

    def _product_into(self, e: ir.Dot, target: str) -> list[str]:
        with self._loop(None):  # (printed before the loop that reads it)
            return self._vector_product(e, target)

    def _vector_product(self, e: ir.Dot, target: str) -> list[str]:
        n = self.size(e.shape[0])
        a, b = e.left, e.right
        # a matrix as it is in memory (a state, a param): the helpers that keep registers of sums across its rows
        # (lr_matvec: 16 rows' sums at once, where a loop over the rows sums each row's lanes on its own)
        if _rank(a) == 1 and isinstance(b, MATRIX_LEAVES):
            return [f"lr_vecmat({target}, {self.array(a)}, {self.ref(b)}, {self.size(b.shape[0])}, {n});"]
        if _rank(b) == 1 and isinstance(a, MATRIX_LEAVES):
            return [f"lr_matvec({target}, {self.ref(a)}, {self.array(b)}, {n}, {self.cols(a)});"]
        if _rank(a) == 1:  # a·M: r_j = Σ_i a_i M_ij, row after row of M
            ai, m = self.elem(a, "i"), self.melem(b, "i", "j")
            return [f"for (int j = 0; j < {n}; ++j) {target}[j] = 0;",
                    f"for (int i = 0; i < {self.size(a.shape[0])}; ++i) {{",
                    f"    const T a_i = {ai};",
                    "    #pragma omp simd",
                    f"    for (int j = 0; j < {n}; ++j) {target}[j] += a_i * {m};",
                    "}"]
        m, bj = self.melem(a, "i", "j"), self.elem(b, "j")  # M·a: r_i = Σ_j M_ij a_j
        return [f"for (int i = 0; i < {n}; ++i) {{",
                "    T acc = 0;",
                "    #pragma omp simd reduction(+:acc)",
                f"    for (int j = 0; j < {self.size(b.shape[0])}; ++j) acc += {m} * {bj};",
                f"    {target}[i] = acc;",
                "}"]

    # ---- matrices ----
    def melem(self, e: ir.Expr, i: str, j: str) -> str:
        """C code for element (i, j) of matrix expression e (i, j: C index variables); what it needs
        first is written first."""
        if _rank(e) != 2:
            raise self._unsupported(e)
        if e not in self._matrices and self._uses[e] > 1 and _costly(e) and not isinstance(e, MATRIX_LEAVES):
            self._materialize(e, lambda a, b: self._melem(e, a, b))
        if e in self._matrices:
            return f"{self._matrices[e]}[{i} * {self.cols(e)} + {j}]"
        return self._melem(e, i, j)

    def _melem(self, e: ir.Expr, i: str, j: str) -> str:
        if isinstance(e, MATRIX_LEAVES):
            return f"{self.ref(e)}[{i} * {self.cols(e)} + {j}]"
        if isinstance(e, ir.Identity):
            return f"((T)({i} == {j}))"
        if isinstance(e, ir.Diag):
            return f"({i} == {j} ? {self.elem(e.operand, i)} : (T)0)"
        if isinstance(e, ir.Outer):
            return f"({self.elem(e.left, i)} * {self.elem(e.right, j)})"
        if isinstance(e, ir.Neg):
            return f"(-{self.melem(e.operand, i, j)})"
        if isinstance(e, ir.Apply):
            if e.function not in _ELEMENTWISE:
                raise self._unsupported(e)
            return self._row_builtin(e, i, j) or self._call(e.function, self.melem(e.args[0], i, j))
        if isinstance(e, ir.Arith):
            x = elu_plus_one(e)
            if x is not None:  # elu(x) + 1 cancels to 0 for very negative x in low precision
                return f"lr_elu_plus_one({self.melem(x, i, j)})"
            if e.op == "pow":
                row = self._row_power(e, i, j)
                if row is not None:
                    return row
            return self._binary(e.op, self._part(e.left, i, j), self._part(e.right, i, j), e.right)
        if isinstance(e, ir.Dot):
            return self._product(e, i, j)
        raise self._unsupported(e)

    def _product(self, e: ir.Dot, i: str, j: str) -> str:
        """Element (i, j) of a·b by the structure of its factors (see the module's docstring)."""
        a, b = e.left, e.right
        if not a.shape or not b.shape:
            return f"({self._part(a, i, j)} * {self._part(b, i, j)})"
        if isinstance(a, ir.Identity):
            return self.melem(b, i, j)
        if isinstance(b, ir.Identity):
            return self.melem(a, i, j)
        if isinstance(a, ir.Diag):  # rows scaled
            return f"({self.elem(a.operand, i)} * {self.melem(b, i, j)})"
        if isinstance(b, ir.Diag):  # columns scaled
            return f"({self.melem(a, i, j)} * {self.elem(b.operand, j)})"
        if isinstance(a, ir.Outer):  # (u⊗w)·B = u⊗(w·B)
            wb = ir.Dot((b.shape[1],), a.right, b)
            return f"({self.elem(a.left, i)} * {self.elem(wb, j)})"
        if isinstance(b, ir.Outer):  # A·(u⊗w) = (A·u)⊗w
            au = ir.Dot((a.shape[0],), a, b.left)
            return f"({self.elem(au, i)} * {self.elem(b.right, j)})"
        for side, other in ((a, b), (b, a)):  # a sum, a difference, a negation, a scalar multiple: distribute
            def with_(x, side=side, other=other):
                return ir.Dot(e.shape, x, other) if side is a else ir.Dot(e.shape, other, x)
            if isinstance(side, ir.Neg):
                return f"(-{self.melem(with_(side.operand), i, j)})"
            if isinstance(side, ir.Arith) and side.op in ("add", "sub") and side.left.shape and side.right.shape:
                sym = "+" if side.op == "add" else "-"
                return f"({self.melem(with_(side.left), i, j)} {sym} {self.melem(with_(side.right), i, j)})"
            if isinstance(side, ir.Arith) and side.op in ("mul", "div") and not side.right.shape:
                return self._binary(side.op, self.melem(with_(side.left), i, j), self.scalar(side.right), side.right)
            scaled = _scalar_times(side)  # (s*B)·X = (s·B)·X = s·(B·X)
            if scaled:
                return f"({self.scalar(scaled[0])} * {self.melem(with_(scaled[1]), i, j)})"
        if isinstance(a, ir.Dot) and _rank(a.left) == 2 and _rank(a.right) == 2:  # (A·B)·b = A·(B·b)
            return self.melem(ir.Dot(e.shape, a.left, ir.Dot((a.right.shape[0], b.shape[1]), a.right, b)), i, j)
        if e not in self._matrices:  # two matrices with no structure to use: their product, computed whole
            self._materialize_product(e)
        return f"{self._matrices[e]}[{i} * {self.cols(e)} + {j}]"

    def _scratch_matrix(self, e: ir.Expr) -> str:
        """A name for e in the scratch buffer (its rows of `cols` elements, from a whole cache line)."""
        name = self._name(e, "m")
        rows, cols = (self.size(d) for d in e.shape)
        self._sink(e).append(f"T *restrict {name} = scr + {self.scratch_block(rows * cols)};{self._comment(e)}")
        self._matrices[e] = name
        return name

    def _materialize(self, e: ir.Expr, element) -> None:
        code, prologue = self._element_by_rows(element)
        name = self._scratch_matrix(e)
        self._sink(e).extend(self._matrix_loop(name, *(self.size(d) for d in e.shape), code, prologue))

    def _materialize_product(self, e: ir.Dot) -> None:
        a, b = e.left, e.right
        rows, inner, cols = self.size(a.shape[0]), self.size(a.shape[1]), self.size(b.shape[1])
        with self._loop(None):  # (printed before the loop that reads it)
            aik, bkj = self.melem(a, "i", "k"), self.melem(b, "k", "j")
        name = self._scratch_matrix(e)
        self._sink(e).extend([
            f"for (int i = 0; i < {rows}; ++i) {{",
            f"    for (int j = 0; j < {cols}; ++j) {name}[i * {cols} + j] = 0;",
            f"    for (int k = 0; k < {inner}; ++k) {{",
            f"        const T a_ik = {aik};",
            "        #pragma omp simd",
            f"        for (int j = 0; j < {cols}; ++j) {name}[i * {cols} + j] += a_ik * {bkj};",
            "    }",
            "}"])


class StatementKernel(KernelSource):
    """The template's context for one (dtype, sizes): the statements of one token of one head as C, for the
    sequence kernel (the inputs' rows of token t) and the decode step (the token's rows)."""

    template = "c_statements.c.j2"

    def __init__(self, compiled: Compiled, dims: dict[str, int], target: Target):
        refusal = statements_refusal(compiled)  # (what this kernel takes is support.py's to say)
        if refusal:
            raise LinrecError(refusal)
        super().__init__(compiled, dims, target)
        self.why_not_fused = fused_refusal(compiled) or ""  # for the file's opening comment
        self.let_names: dict[str, str] = {}  # named values that read a state → their C locals

    def ref(self, node: ir.Expr) -> str:
        if isinstance(node, ir.StateRef):
            return self.local("buf", self.cstate(node.name))
        if isinstance(node, ir.LetRef):
            return self.let_names[node.name]
        return super().ref(node)

    def _statements(self, pr: StatementPrinter, updates: bool, outputs: bool) -> list[str]:
        """One token's statements in program order: the named values that read a state, the updates (in
        place) and the outputs (into their rows, out_x_t, or out_x[tok] for a scalar)."""
        chosen = [(s, v) for s, v in printed_statements(self.program) if isinstance(s, ir.Let)
                  or (isinstance(s, ir.Update) and updates) or (isinstance(s, ir.Output) and outputs)]
        steps, values = [s for s, _ in chosen], [v for _, v in chosen]
        pr.expect(*values)
        lines: list[str] = []
        for step, value in zip(steps, values):
            text = c_comment_text(to_text(step.value))
            if isinstance(step, ir.Let):
                name = self.let_names[step.name] = self.clet(step.name)
                lines += [f"/* {step.name} = {text} */"] + self._copy(pr, value, name)
            elif isinstance(step, ir.Update):
                st = self.program.state(step.state)
                kind = self.decomposition.transition(step.state).kind
                lines += [f"/* {step.state} = {text}  ({kind}) */"]
                lines += self._store(pr, value, self.local("buf", self.cstate(st.name)), fresh=False)
            else:
                target = self.cout(step.name)
                lines += [f"/* output {step.name} = {text} */"]
                if value.shape:
                    lines += self._store(pr, value, self.row(target))
                else:
                    code = pr.scalar(value)
                    lines += pr.take_token() + [f"{target}[tok] = {code};"]
        return lines

    def _store(self, pr: StatementPrinter, value: ir.Expr, target: str, fresh: bool = True) -> list[str]:
        """Statements that write value into `target` element by element; fresh=False: target is a state
        the value may read (a vector product is then computed first, not summed up in the target)."""
        if _rank(value) == 1:
            body = pr.store(value, target) if fresh else pr.fill(value, target)
            return pr.take_token() + body
        loop = pr.matrix_store(target, *(self.dims[d] for d in value.shape), lambda i, j: pr.melem(value, i, j))
        return pr.take_token() + loop

    def _copy(self, pr: StatementPrinter, value: ir.Expr, name: str) -> list[str]:
        """A named value into a local of its own (a copy: the state it reads may change after it)."""
        if not value.shape:
            code = pr.scalar(value)
            return pr.take_token() + [f"const T {name} = {code};"]
        if _rank(value) == 1:
            return [f"T {name}[{self.size(value.shape)}];"] + self._store(pr, value, name)
        return [f"T *restrict {name} = scr + {pr.scratch_block(self.size(value.shape))};"] \
            + self._store(pr, value, name)

    def _region(self, prefix: str, updates: bool, outputs: bool) -> dict:
        pr = StatementPrinter(self.target.ctype, self.dims, self.ref, prefix)
        token = self._statements(pr, updates, outputs)
        return {"head": pr.take_head(), "token": token, "scratch": pr.scratch}

    def context(self) -> dict:
        if self.program.causal:
            passes = [self._region("", updates=True, outputs=True)]
        else:  # every output reads the final state: the updates over every token first, then the outputs
            passes = [self._region("", updates=True, outputs=False), self._region("n", updates=False, outputs=True)]
        step = self._region("", updates=True, outputs=True) if self.program.causal else None
        scratch = max([r["scratch"] for r in passes] + ([step["scratch"]] if step else []))
        # multiply-adds per token and head, roughly: every state's elements once per statement
        work = max(1, sum(self.size(s.shape) for s in self.program.states)) * max(1, len(self.program.steps))
        return dict(
            name=self.program.name, version=VERSION, filename=self.compiled.filename,
            source_comment=self.source_comment(),
            why_not_fused=self.why_not_fused, **self.common(), block_tokens=1,
            dims=[(d.name, self.dims[d.name]) for d in self.program.dims],
            inputs=self.input_arrays(),
            states=[{"c": self.cstate(s.name), "buf": self.local("buf", self.cstate(s.name)),
                     "size": self.size(s.shape)} for s in self.program.states],
            outputs=self.output_arrays(),
            passes=passes, step=step, scratch=scratch, step_work=work,
            step_parallel_threshold=STEP_PARALLEL_THRESHOLD, **self.entry_points())
