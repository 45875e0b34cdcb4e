"""The fused kernel's block of tokens holds at least a tiled pass's tile of registers (fused._block_buffer):
the tiled pass loads and stores a tile once per block and fetches the next tile one register a token, so a
shorter block leaves part of the next tile in L2. At dk = dv = 128 only 8 tokens' per-token values fit the
block budget; the tile (4 rows × 4 registers) makes it 16. Checked on the generated C (no build) and on one
run: 40 tokens cross two 16-token block ends and end in a partial block, with strong decays (slow tokens),
against the float64 NumPy recurrent form within 1e-10 (as test_c_backend.py). One kernel is built.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from test_c_backend import F64_RTOL, compare, random_state

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIMS = {"dk": 128, "dv": 128}


@pytest.fixture(scope="module")
def linrec(cache_dir):
    import linrec
    return linrec


def tile_registers(source: str) -> int:
    """Registers of the largest tile, from the tiled pass's comment `tiles of R rows × C columns`."""
    lanes = int(re.search(r"#define VW (\d+)", source)[1])
    tiles = re.findall(r"tiles of (\d+) rows × (\d+) columns", source)
    assert tiles, "the tiled pass is missing from the generated C"
    return max(int(r) * int(c) // lanes for r, c in tiles)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_holds_a_tile_of_registers(linrec, dtype):
    source = linrec.load(EXAMPLES / "gla.lin").module("recurrent", "c").source(dtype, DIMS)
    block = int(re.search(r"#define LR_BLOCK (\d+)", source)[1])
    assert block >= tile_registers(source) > 8  # (8: what the per-token values' budget alone allows here)


def test_block_of_a_tile_matches_the_recurrent_form(linrec):
    rec = linrec.load(EXAMPLES / "gla.lin")
    inputs = rec.random_inputs(batch=1, tokens=40, heads=2, dims=DIMS, seed=5, decay_scale=10.0)
    compare(rec, inputs, random_state(rec, 1, 2, DIMS, np.float64, 5), np.float64, F64_RTOL)
