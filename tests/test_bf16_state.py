"""The bfloat16 state (state_dtype="bfloat16", docs/serving.md#a-bfloat16-state): the conversion on NumPy
and in C, bit for bit (AVX-512 BF16 and the portable integer path); the decode steps of both backends; a
64-token decode within tolerance of the float32 one; the slot pool; the errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import linrec
from linrec import arrays
from linrec.c import build as c_build
from linrec.c.backend import recurrent_source
from linrec.c.kernel_source import Target, common_context
from linrec.cli import main as cli_main
from linrec.templating import environment
from linrec.verify import TOLERANCE_BF16_STATE

to_bits, from_bits = arrays.to_bfloat16, arrays.from_bfloat16
DIMS = 16          # dk = dv: small kernels, built once per session (the bfloat16 step is a kernel of its own)
HEADS, BATCH = 2, 3
EXAMPLES = ["gla", "gated_deltanet", "mamba2"]


def u32(*words) -> np.ndarray:
    return np.array(words, np.uint32).view(np.float32)


@pytest.fixture(scope="module")
def programs():
    return {name: linrec.load(f"examples/{name}.lin") for name in EXAMPLES}


def tokens_of(rec, steps: int, seed: int):
    """[B, steps, H, *] float32 inputs of realistic scale, and the first step's token [B, H, *]."""
    return rec.random_inputs(BATCH, steps, HEADS, dims={"dk": DIMS, "dv": DIMS}, dtype=np.float32, seed=seed)


def token(x: dict, t: int) -> dict:
    return {k: v[:, t].copy() for k, v in x.items()}  # (a copy, never a view of x: it is refilled)


def random_state(shape, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.5).astype(np.float32)


# ---- the conversion ----

def test_rounding_is_to_nearest_even_and_keeps_nan_inf_and_flushes_subnormals():
    one = 0x3F800000
    x = u32(one, one + 0x8000, one + 0x18000, one + 0x8001, one + 0x7FFF,  # 1, ties (to even: down, up), above, below
            0x7F7FFFFF,                    # the largest float32: rounds up to +inf
            0x7F800000, 0xFF800000,        # ±inf
            0x7FC00000, 0x7F800001, 0xFFA12345,  # NaNs: quiet, signalling, negative with a payload
            0x00000001, 0x807FFFFF,        # subnormals: ±0
            0x00800000, 0x00000000, 0x80000000)  # the smallest normal, ±0
    got = to_bits(x)
    assert got.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0x7F80, 0xFF80, 0x7FC0, 0x7FC0, 0xFFE1,
                            0x0000, 0x8000, 0x0080, 0x0000, 0x8000]
    assert np.isnan(from_bits(got[8:11])).all()


@pytest.mark.parametrize("value, message", [
    ({"S": np.ones((1, 2, 4, 4), np.float32)}, r"got a dict; convert each state: \{name: linrec\.to_bfloat16"),
    (None, "real numbers .*got dtype object"),
    ("1.5", "real numbers .*got dtype <U3"),
    (np.array([1 + 2j], np.complex64), "real numbers .*got dtype complex64"),
])
def test_to_bfloat16_refuses_what_is_not_an_array_of_real_numbers(value, message):
    """A dict of states (what prefill returns), None, text or complex values: a clear error, where NumPy's own
    raised from inside linrec, None became a NaN and complex values lost their imaginary part (a probe's
    finding)."""
    with pytest.raises(linrec.LinrecError, match=message):
        linrec.to_bfloat16(value)
    assert arrays.from_bfloat16(linrec.to_bfloat16(np.arange(3, dtype=np.int64))).tolist() == [0.0, 1.0, 2.0]


def test_every_bfloat16_round_trips_except_subnormals_and_signalling_nans():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = to_bits(from_bits(bits))
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    subnormal, nan = (exponent == 0) & (mantissa != 0), (exponent == 0xFF) & (mantissa != 0)
    plain = ~subnormal & ~nan
    assert np.array_equal(back[plain], bits[plain])
    assert np.array_equal(back[subnormal], bits[subnormal] & 0x8000)  # (±0, as vcvtneps2bf16 gives)
    assert np.array_equal(back[nan], bits[nan] | 0x40)                # NaN stays NaN, quieted
    assert from_bits(bits[plain]).dtype == np.float32


@pytest.fixture(scope="module", params=sorted({c_build.vector_bytes(), 32}, reverse=True))
def c_conversion(request):
    """c_common.h.j2's bfloat16 helpers for this machine's target: the store (AVX-512 BF16 where the CPU
    has it), the portable store and the load, each over an array, and the same a register at a time (the
    decode step's passes), for this machine's register width and for 32-byte registers (AVX2)."""
    common = environment("linrec.c").get_template("c_common.h.j2").render(
        **common_context(Target("float", request.param)), block_tokens=16, inputs=[], checks_inputs=False,
        state_is_bf16=True)
    calls = ("void store(const float *x, uint16_t *y, int n) { lr_bf16_store(y, x, n); }\n"
             "void store_portable(const float *x, uint16_t *y, int n) { lr_bf16_store_portable(y, x, n); }\n"
             "void load(const uint16_t *x, float *y, int n) { lr_bf16_load(y, x, n); }\n"
             "int native(void) { return LR_BF16_NATIVE; }\n"
             # the decode step's passes: a register at a time (n a multiple of VW)
             "void store_vec(const float *x, uint16_t *y, int n)"
             " { for (int i = 0; i < n; i += VW) lr_bf16_store_vec(y + i, lr_load(x + i)); }\n"
             "void store_vec_portable(const float *x, uint16_t *y, int n)"
             " { for (int i = 0; i < n; i += VW) lr_bf16_store_vec_portable(y + i, lr_load(x + i)); }\n"
             "void load_vec(const uint16_t *x, float *y, int n)"
             " { for (int i = 0; i < n; i += VW) lr_store(y + i, lr_bf16_load_vec(x + i)); }\n")
    cdef = ("void store(float *x, uint16_t *y, int n);\nvoid store_portable(float *x, uint16_t *y, int n);\n"
            "void load(uint16_t *x, float *y, int n);\nint native(void);\n"
            "void store_vec(float *x, uint16_t *y, int n);\nvoid store_vec_portable(float *x, uint16_t *y, int n);\n"
            "void load_vec(uint16_t *x, float *y, int n);\n")
    return c_build.build(common + calls, cdef, f"bf16_conversion_{request.param}")


def test_c_conversion_is_numpys_bit_for_bit_on_both_paths(c_conversion):
    ffi, lib = c_conversion.ffi, c_conversion.lib
    if "avx512_bf16" in c_build._cpu_flags() and c_build.vector_bytes() == 64:  # (either register width)
        assert lib.native() == 1  # (the instruction is what is tested here, not only the integer path)
    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32),
                            np.arange(1 << 16, dtype=np.uint32) << 16,           # every bfloat16, exact
                            (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000,  # every tie
                            np.arange(0, 1 << 16, dtype=np.uint32)])             # subnormals, near zero
    x = words.view(np.float32)
    want = to_bits(x)
    for store in (lib.store, lib.store_portable, lib.store_vec, lib.store_vec_portable):
        got = np.zeros(x.size, np.uint16)
        store(ffi.from_buffer("float[]", x), ffi.from_buffer("uint16_t[]", got), x.size)
        assert np.array_equal(got, want), store
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for load in (lib.load, lib.load_vec):
        wide = np.zeros(bits.size, np.float32)
        load(ffi.from_buffer("uint16_t[]", bits), ffi.from_buffer("float[]", wide), bits.size)
        assert np.array_equal(wide.view(np.uint32), from_bits(bits).view(np.uint32)), load


# ---- the decode steps ----

@pytest.mark.parametrize("name", EXAMPLES)
def test_c_and_numpy_bf16_steps_agree_within_one_ulp(programs, name):
    """One step from the same bfloat16 state: both round a float32 state computed in a different order (C's
    fused multiply-adds), so the bits agree except where the two float32 values fall on either side of a
    rounding boundary — there by one ulp."""
    rec = programs[name]
    x = tokens_of(rec, 1, seed=1)
    state = {"S": to_bits(random_state((BATCH, HEADS, DIMS, DIMS)))}
    got = {}
    for backend in ("numpy", "c"):
        out, new = rec.step(token(x, 0), {"S": state["S"].copy()}, backend=backend, state_dtype="bfloat16")
        assert new["S"].dtype == np.uint16
        got[backend] = (out, new["S"])
    c_bits, np_bits = got["c"][1].astype(np.int32), got["numpy"][1].astype(np.int32)
    assert np.abs(c_bits - np_bits).max() <= 1
    assert (c_bits == np_bits).mean() > 0.99
    for o in got["c"][0]:
        ref = got["numpy"][0][o]
        assert np.abs(got["c"][0][o] - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1.0)


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_64_step_bf16_decode_stays_within_tolerance_of_the_float32_one(programs, name):
    rec = programs[name]
    steps = 64
    x = tokens_of(rec, steps, seed=2)
    S0 = random_state((BATCH, HEADS, DIMS, DIMS), seed=3)
    ref = rec.run(x, form="recurrent", initial_state={"S": S0})  # float32 throughout
    out_name = rec.program.outputs[0].name
    for backend in ("c", "numpy"):
        state = {"S": to_bits(S0)}
        buffer = token(x, 0)
        step = rec.bind_step(buffer, state, backend=backend, state_dtype="bfloat16")
        outputs = []
        for t in range(steps):
            for k, v in x.items():
                buffer[k][...] = v[:, t]
            outputs.append(step()[out_name].copy())
        outputs = np.stack(outputs, axis=1)
        out_err = np.abs(outputs - ref.outputs[out_name]).max() / np.abs(ref.outputs[out_name]).max()
        final = from_bits(state["S"])
        state_err = np.abs(final - ref.final_state["S"]).max() / np.abs(ref.final_state["S"]).max()
        assert 0 < state_err <= TOLERANCE_BF16_STATE, (backend, state_err)  # (rounded: not the float32 path)
        assert out_err <= TOLERANCE_BF16_STATE, (backend, out_err)


def bf16_step_is_the_rounded_float32_step(rec, dims: dict, seed: int, output_ulps: int = 0) -> str:
    """One C step with a bfloat16 state against the float32 C step from the widened state, rounded after:
    the bits of the states equal, and those of the outputs (the same float32 arithmetic, one rounding at the
    end), or they differ by at most `output_ulps` units in the last place of the largest output (float32's
    eps times it: an output near 0 is a difference of larger terms). Returns how the bfloat16 step's kernel
    holds the state (its generated source tells)."""
    x = rec.random_inputs(BATCH, 1, HEADS, dims=dims, dtype=np.float32, seed=seed)
    S = (np.random.default_rng(seed).standard_normal((BATCH, HEADS, dims["dk"], dims["dv"])) * 0.5)
    bits = to_bits(S.astype(np.float32))
    out, new = rec.step(token(x, 0), {"S": bits.copy()}, backend="c", state_dtype="bfloat16")
    want_out, want = rec.step(token(x, 0), {"S": from_bits(bits)}, backend="c")
    assert np.array_equal(new["S"], to_bits(want["S"]))
    for o in out:
        if not output_ulps:
            assert np.array_equal(out[o].view(np.uint32), want_out[o].view(np.uint32)), o
        else:
            scale = np.finfo(np.float32).eps * np.abs(want_out[o]).max()
            assert np.abs(out[o] - want_out[o]).max() <= output_ulps * scale, o
    source = recurrent_source(rec.compiled, dims, Target("float", c_build.vector_bytes()), True).source()
    return "in the passes" if "lr_bf16_load_vec(row" in source else "widened into a scratch"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_bf16_step_reads_and_writes_the_bits_in_its_passes_and_equals_the_float32_step(programs, name):
    """Rows of whole registers: the step's passes widen each register of the bits as they load it and round
    it as they store it (no float32 copy of the state), bit for bit the float32 step rounded once."""
    assert bf16_step_is_the_rounded_float32_step(programs[name], {"dk": DIMS, "dv": DIMS}, seed=11) == "in the passes"


@pytest.mark.parametrize("name, output_ulps", [("gated_deltanet", 0), ("deltanet", 1)])
def test_a_bf16_state_with_a_column_tail_is_widened_and_equals_the_float32_step(programs, name, output_ulps):
    """dv = 20, not a whole number of registers: the step widens the head into a float32 scratch (the
    columns past the last register run the float32 step's own loop): the states bit for bit the float32
    step's. The same source built as another kernel, gcc may fuse a multiply and an add of the per-token
    values where the float32 kernel does not (-ffp-contract=fast): deltanet's outputs, read from the
    unrounded state, come out apart by up to an ulp of the largest one (docs/serving.md says so)."""
    rec = programs[name] if name in programs else linrec.load(f"examples/{name}.lin")
    got = bf16_step_is_the_rounded_float32_step(rec, {"dk": 20, "dv": 20}, seed=5, output_ulps=output_ulps)
    assert got == "widened into a scratch"


def test_a_bf16_pool_step_moves_only_its_slots_and_equals_the_plain_step(programs):
    rec = programs["gated_deltanet"]
    P, slots = 7, np.array([5, 0, 3])
    pool0 = to_bits(random_state((P, HEADS, DIMS, DIMS), seed=4))
    tok = token(tokens_of(rec, 1, seed=5), 0)
    for backend in ("c", "numpy"):
        pool = {"S": pool0.copy()}
        out, pool = rec.step(tok, pool, slots=slots, backend=backend, state_dtype="bfloat16")
        others = [s for s in range(P) if s not in slots]
        assert np.array_equal(pool["S"][others], pool0[others])
        plain_out, plain = rec.step(tok, {"S": pool0[slots]}, backend=backend, state_dtype="bfloat16")
        assert np.array_equal(pool["S"][slots], plain["S"])
        assert np.array_equal(out["o"], plain_out["o"])


def test_prefill_returns_bits_and_resumes_from_them(programs):
    rec = programs["gla"]
    x = tokens_of(rec, 12, seed=6)
    res = rec.prefill(x, backend="c", state_dtype="bfloat16", state_every=4)
    full = rec.prefill(x, backend="c")
    assert res.final_state["S"].dtype == np.uint16 and res.checkpoints["S"].dtype == np.uint16
    assert np.array_equal(res.final_state["S"], to_bits(full.final_state["S"]))  # (converted at the exit only)
    rest = rec.run({k: v[:, 8:] for k, v in x.items()}, backend="c", state_dtype="bfloat16",
                   initial_state={"S": res.checkpoints["S"][:, 1]})
    err = np.abs(from_bits(rest.final_state["S"]) - full.final_state["S"]).max()
    assert err <= 2 ** -7 * np.abs(full.final_state["S"]).max()


def test_a_refused_token_leaves_the_bf16_state_as_it_was(programs):
    rec = programs["gla"]
    tok = token(tokens_of(rec, 1, seed=7), 0)
    state = {"S": to_bits(random_state((BATCH, HEADS, DIMS, DIMS)))}
    before = state["S"].copy()
    step = rec.bind_step(tok, state, backend="c", state_dtype="bfloat16")
    tok["g"][1, 0, 3] = 1.0  # g is declared <= 0
    with pytest.raises(linrec.RuntimeInputError, match="'g'"):
        step()
    assert np.array_equal(state["S"], before)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_an_output_sharing_memory_with_the_bf16_state_is_refused(programs, backend):
    """A float32 `out` viewing the uint16 bits of the state (or a token) would be written over the state the
    step updates: refused before anything is written, by step and bind_step, on both backends."""
    rec = programs["gla"]
    tok = token(tokens_of(rec, 1, seed=10), 0)
    state = {"S": to_bits(random_state((BATCH, HEADS, DIMS, DIMS)))}
    before = state["S"].copy()
    shape = (BATCH, HEADS, DIMS)
    alias = state["S"].reshape(-1)[:2 * BATCH * HEADS * DIMS].view(np.float32).reshape(shape)
    for out, message in (({"o": alias}, r"out\['o'\] shares memory with state 'S'"),
                         ({"o": tok["v"]}, r"out\['o'\] shares memory with input 'v'")):
        with pytest.raises(linrec.RuntimeInputError, match=message + ".*pass a separate array"):
            rec.step(tok, state, backend=backend, inplace=True, out=out, state_dtype="bfloat16")
        with pytest.raises(linrec.RuntimeInputError, match=message):
            rec.bind_step(tok, state, backend=backend, out=out, state_dtype="bfloat16")
        assert np.array_equal(state["S"], before)


# ---- errors ----

@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_errors_name_the_argument_and_the_fix(programs, backend):
    rec = programs["gla"]
    tok = token(tokens_of(rec, 1, seed=8), 0)
    bits = to_bits(random_state((BATCH, HEADS, DIMS, DIMS)))
    floats = from_bits(bits)
    cases = [
        (dict(state={"S": bits}, state_dtype="bf16"), "unknown state_dtype 'bf16'.*'bfloat16'"),
        (dict(tokens={k: v.astype(np.float64) for k, v in tok.items()}, state={"S": bits}, state_dtype="bfloat16"),
         "needs float32 inputs"),
        (dict(state={"S": floats}, state_dtype="bfloat16"), "uint16|bfloat16 bits"),
        (dict(state={"S": bits}, state_dtype=None), "uint16 state holding bfloat16 bits needs state_dtype='bfloat16'"),
        (dict(state={"S": bits}, state_dtype="float64"), "state_dtype='float64' with float32 inputs"),
        (dict(pool={"S": np.zeros((4, HEADS, DIMS, DIMS), np.float32)}, state_dtype="bfloat16"),
         r"pool\['S'\] must be a writeable uint16 array"),
        (dict(pool={"S": np.zeros((4, HEADS, DIMS, DIMS), np.uint16)}, state_dtype=None),
         r"pool\['S'\].*needs state_dtype='bfloat16'"),
    ]
    for case, message in cases:
        given = case.get("tokens", tok)
        with pytest.raises(linrec.RuntimeInputError, match=message):
            if "pool" in case:
                rec.step(given, case["pool"], slots=np.arange(BATCH), backend=backend, state_dtype=case["state_dtype"])
            else:
                rec.step(given, case["state"], backend=backend, inplace=True, state_dtype=case["state_dtype"])
    with pytest.raises(linrec.RuntimeInputError, match="needs state_dtype='bfloat16'"):
        rec.run(tokens_of(rec, 2, seed=9), initial_state={"S": bits}, backend=backend)


def test_a_uint16_state_without_state_dtype_gets_the_hint_on_every_backend(programs):
    """A step that is not in place takes the state as a float array to copy: bfloat16 bits (uint16) without
    state_dtype are refused on both backends with the same words, the hint to pass state_dtype included
    (C said only 'pass float32 or float64')."""
    rec = programs["gla"]
    tok = token(tokens_of(rec, 1, seed=8), 0)
    bits = to_bits(random_state((BATCH, HEADS, DIMS, DIMS)))
    words = set()
    for backend in ("numpy", "c"):
        with pytest.raises(linrec.RuntimeInputError) as info:
            rec.step(tok, {"S": bits}, backend=backend)
        words.add(str(info.value))
    assert words == {"error: state 'S' has dtype uint16; pass float32 or float64 (a uint16 state holding bfloat16 "
                     "bits needs state_dtype='bfloat16')"}


def test_the_cli_runs_the_decode_with_a_bf16_state(tmp_path, capsys):
    out = tmp_path / "bf16.npz"
    assert cli_main(["run", "examples/gla.lin", "--backend", "c", "--form", "step", "--state-dtype", "bfloat16",
                     "--dim", f"dk={DIMS}", "--dim", f"dv={DIMS}", "--tokens", "4", "--batch", f"{BATCH}",
                     "--heads", f"{HEADS}", "--out", str(out)]) == 0
    assert "bfloat16 state" in capsys.readouterr().out
    saved = np.load(out)
    assert saved["S"].dtype == np.uint16 and saved["o"].dtype == np.float32


def test_verify_checks_the_bf16_state_decode_at_its_tolerance(capsys):
    assert cli_main(["verify", "examples/mamba2.lin", "--form", "step", "--state-dtype", "bfloat16", "--quick",
                     "--backend", "numpy", "--dtype", "float32", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if r["dtype"] == "float32+bf16"]
    assert rows and all(r["passed"] and r["tolerance"] == TOLERANCE_BF16_STATE for r in rows)
    assert all(0 < r["max_rel"] for r in rows)  # (rounded: not the float32 step)


def test_a_kv_cache_is_never_said_to_be_bfloat16(capsys):
    """A program that reads the sequence decodes over a KV cache of its inputs, kept in their dtype: step(),
    decode.run_by_steps and `linrec run --form step` all refuse state_dtype="bfloat16" (the last two took it,
    and the command's header said "bfloat16 state" over a float32 cache)."""
    from linrec import decode
    softmax = linrec.load("examples/softmax.lin")
    x = softmax.random_inputs(1, 4, 2, dtype=np.float32)
    with pytest.raises(linrec.RuntimeInputError, match="KV cache of the inputs, not a state to keep in bfloat16"):
        softmax.step({k: v[:, 0] for k, v in x.items()}, None, state_dtype="bfloat16")
    with pytest.raises(linrec.RuntimeInputError, match="KV cache of the inputs, not a state to keep in bfloat16"):
        decode.run_by_steps(softmax, x, backend="c", state_dtype="bfloat16")
    code = cli_main(["run", "examples/softmax.lin", "--form", "step", "--state-dtype", "bfloat16", "--dtype", "float32",
                     "--tokens", "4"])
    assert code == 1 and "not a state to keep in bfloat16" in capsys.readouterr().err
    # run() on a form over the sequence took it and returned what it returns without (a probe's finding): it
    # refuses it as step() does, on every backend and through the command line
    for backend in ("numpy", "c"):
        for form in ("parallel", "chunkwise"):
            with pytest.raises(linrec.RuntimeInputError, match="'softmax' has no state: .*leave state_dtype out"):
                softmax.run(x, form=form, backend=backend, state_dtype="bfloat16")
    code = cli_main(["run", "examples/softmax.lin", "--state-dtype", "bfloat16", "--dtype", "float32", "--tokens", "4"])
    assert code == 1 and "has no state: there is nothing to keep in bfloat16" in capsys.readouterr().err
