"""The identifiers of one generated file: user names first, then every name the generator makes.

A Namespace binds every DSL name of the program to an identifier before the generator asks for a name of its
own: a user name keeps its spelling unless it is not a plain ASCII identifier or is one of the file's fixed
words (keywords, the helpers it imports, its functions' parameters, …), and a generated name (`S_writes`,
`r0`, the C row pointer `in_q_t`, …) is handed out by fresh(), which gives its wanted spelling unless a user
name or an earlier generated name holds it, else a numbered variant (`S_writes_1`). So a colliding user name
never changes meaning, and a program whose names collide with nothing generates the spellings it always had.
"""
from __future__ import annotations

import keyword
import re
from typing import Hashable, Iterable

from .builtins import BUILTINS

_C_KEYWORDS = set("""auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void
volatile while main""".split())
# `__debug__ = …` is a SyntaxError (though not a keyword)
_PYTHON_FIXED = {"__debug__"}
# Names the generated code uses as they are, in any module: a user name is renamed away from them.
INTERNAL = {"np", "rt", "t", "h", "batch", "tokens", "heads", "inputs", "params", "initial_state", "dims",
            "dtype", "outputs", "final_state", "forward", "default_params", "math", "chunk_size", "first", "given",
            "i", "j", "b", "n", "c", "start", "stop", "size", "np_", "abs", "sum", "min", "max", "len", "range",
            "float", "slice"}
# The helpers generated NumPy code imports (linrec.numpy.runtime, scan and attention; linrec.c.attention,
# linrec.c.scan), and the locals of the attention forms' loops.
INTERNAL |= {"sigmoid", "logsigmoid", "softplus", "relu", "elu", "elu_plus_one", "silu", "l2norm", "groupnorm",
             "rmsnorm", "matvec", "vecmat", "diag_matrix", "random_features", "per_token", "log_decay",
             "parallel_scan", "chunkwise_scan", "recurrent_scan", "running_max", "scale_decay", "rescale",
             "running_signs", "with_signs", "signed_state", "signed_reads", "signed_grads",
             "with_value_signs", "value_signed_reads", "value_signed_state", "value_signed_grads",
             "visible_positions", "mask", "masked_softmax", "masked_mean", "masked_rmsnorm", "masked_groupnorm",
             "softmax", "online_softmax_step", "attention",
             "lsh_attention_dense", "lsh_attention_bucketed", "causal", "visible", "keys", "queries", "block",
             "scores", "key_start", "acc", "l", "m"}
# The backward modules' (linrec.numpy.adjoint): their function's parameters, and the vector–Jacobian products of
# the builtins they import from linrec.numpy.vjp.
INTERNAL |= {"backward", "grad_outputs", "grad_final_state", "derived_params", "grads", "unbroadcast", "outer_sum",
             "own_array", "in_place", "negated",
             "vjp_pow", "vjp_pow_exponent", "decay_scan", "decay_scan_backward", "adjoint_checkpoints", "adjoint_recurrent",
             "chunk_checkpoints", "adjoint_chunkwise", "flash_attention", "flash_attention_backward", "parallel_attention",
             "parallel_attention_backward", "pad_to",
             "vjp_lsh_attention", "vjp_lsh_attention_bucketed", "fused_forward", "common_segment", "scaled", "normalized",
             "factored_decay", "chain_rows", "locals", "globals"}
INTERNAL |= {f"vjp_{name}" for name in BUILTINS}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _spelled(name: str) -> str:
    """`u_` and the name's characters one by one, `_` between: an ASCII letter or digit as it is, any other by its
    code point in hex (two digits or more, so that the spelling reads back one way: σ → u_3c3)."""
    return "u_" + "_".join(f"{ord(ch):x}" if not ch.isascii() or not ch.isalnum() else ch for ch in name)


def safe_identifier(name: str, taken: Iterable[str] = frozenset(), reserved: Iterable[str] = INTERNAL) -> str:
    """`name` as an ASCII identifier that is no keyword and not in `reserved` or `taken`: non-ASCII characters
    spelled by their code points (σ → u_3c3), then `_` appended until it is free."""
    if not _IDENT.match(name):
        name = _spelled(name)
    reserved, taken = set(reserved), set(taken)
    while _fixed_word(name) or name in reserved or name in taken:
        name += "_"
    return name


def _fixed_word(name: str) -> bool:
    """A keyword of Python or C, or a word either fixes (`__debug__`, `main`): no generated name may be one."""
    return keyword.iskeyword(name) or name in _C_KEYWORDS or name in _PYTHON_FIXED


class Namespace:
    """The identifiers of one generated file (see the module's docstring).

    user(name, prefix) is a DSL name's identifier, prefix + its stem (the C backend gives each role a prefix:
    in_q, st_S); every DSL name of the program is bound before the first fresh(). fresh(wanted, key) hands out
    a generated name; the same key gets the same name again (a name several parts of the generator use)."""

    def __init__(self, reserved: Iterable[str] = INTERNAL):
        self._reserved = frozenset(reserved)
        self._stems: dict[str, str] = {}             # DSL name → its stem
        self._users: dict[tuple[str, str], str] = {}  # (DSL name, prefix) → its identifier
        self._taken: set[str] = set(self._reserved)  # every identifier handed out, and the reserved words
        self._keyed: dict[Hashable, str] = {}
        self._generating = False                     # (from the first fresh() on, no user name may come)

    def bind(self, names: Iterable[str], prefix: str = "") -> None:
        for name in names:
            self.user(name, prefix)

    def user(self, name: str, prefix: str = "") -> str:
        ident = self._users.get((name, prefix))
        if ident is None:
            if self._generating:  # (a bug of the generator, not of the program)
                raise RuntimeError(f"internal error: the user name '{prefix}{name}' was not bound before the "
                                   f"generated names (it might take one of theirs)")
            if name not in self._stems:
                self._stems[name] = safe_identifier(name, self._stems.values(), self._reserved)
            ident = self._users[(name, prefix)] = prefix + self._stems[name]
            self._taken.add(ident)
        return ident

    def fresh(self, wanted: str, key: Hashable = None) -> str:
        if key is not None and key in self._keyed:
            return self._keyed[key]
        self._generating = True
        name, n = wanted, 0
        while name in self._taken:
            n += 1
            name = f"{wanted}_{n}"
        self._taken.add(name)
        if key is not None:
            self._keyed[key] = name
        return name


def user_names(program) -> list[str]:
    """Every name a program (ir.Program) defines, in the order its generated code first meets them: inputs,
    dimensions, params, states, named values, outputs."""
    return ([x.name for x in program.inputs] + [d.name for d in program.dims] + [p.name for p in program.params]
            + [s.name for s in program.states] + list(program.lets) + [o.name for o in program.outputs])


def exported_identifier(name: str, reserved: Iterable[str] = frozenset()) -> str:
    """A program's name as the prefix of the names other files link against (c.standalone: NAME.h, NAME_prefill_f32):
    the name itself where it is an ASCII identifier that is no keyword, not in `reserved` and does not begin with
    `u_`, else spelled (_spelled: γ → u_3b3, u_3b3 → u_u_5f_3_b_3, int → u_i_n_t). One program's names are kept
    apart by `taken` (safe_identifier); across programs, which an engine links together, only a prefix no other
    name can have does it: the spelled names all begin with `u_`, and the spelling reads back one way."""
    plain = _IDENT.match(name) and not name.startswith("u_") and not _fixed_word(name) and name not in set(reserved)
    return name if plain else _spelled(name)
