"""Turn DSL names into identifiers that are safe in generated Python and C.

User names never reach generated code unchecked: anything that is not a plain ASCII identifier, or that
collides with a keyword or a name the generated code uses itself, is renamed.
"""
from __future__ import annotations

import keyword
import re

_C_KEYWORDS = set("""auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void
volatile while main""".split())
# Names the generated code uses for its own purposes.
INTERNAL = {"np", "rt", "t", "h", "batch", "tokens", "heads", "inputs", "params", "initial_state", "dims",
            "dtype", "outputs", "final_state", "forward", "default_params", "math", "chunk_size", "i", "j",
            "b", "n", "c", "start", "stop", "size", "np_", "abs", "sum", "min", "max", "len", "range", "float"}
# The helpers generated NumPy code imports (linrec.numpy.runtime, linrec.numpy.scan).
INTERNAL |= {"sigmoid", "logsigmoid", "softplus", "relu", "elu", "elu_plus_one", "silu", "l2norm", "groupnorm",
             "rmsnorm", "diag_matrix", "per_token", "log_decay", "parallel_scan", "chunkwise_scan", "given",
             "visible_positions", "mask", "masked_softmax", "softmax", "online_softmax_step", "visible",
             "lsh_attention_dense", "lsh_attention_bucketed", "causal", "keys", "queries", "block", "scores",
             "key_start", "acc", "l", "m", "random_features", "recurrent_scan", "running_max"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def safe_identifier(name: str, taken: set[str] = frozenset()) -> str:
    if not _IDENT.match(name):
        name = "u_" + "_".join(f"{ord(ch):x}" if not ch.isascii() or not ch.isalnum() else ch for ch in name)
    while keyword.iskeyword(name) or name in _C_KEYWORDS or name in INTERNAL or name in taken \
            or name.startswith("__"):
        name += "_"
    return name


class Namer:
    """A consistent DSL-name → identifier mapping for one generated file."""

    def __init__(self):
        self._map: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self._map:
            self._map[name] = safe_identifier(name, set(self._map.values()))
        return self._map[name]
