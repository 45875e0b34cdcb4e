"""examples/train_recall.py: a few training steps on a tiny MQAR config lower the loss; the trained model's
decode step (recurrent states; a softmax layer's KV cache) gives the full forward's logits; the projections
map onto each input's declared range; the memory figures follow the declarations. Skipped without torch."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linrec  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_recall.py"
spec = importlib.util.spec_from_file_location("train_recall", SCRIPT)
train_recall = importlib.util.module_from_spec(spec)
sys.modules["train_recall"] = train_recall  # (its dataclass looks its module up there)
spec.loader.exec_module(train_recall)

TINY = dict(vocab=16, tokens=16, pairs=3)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(paths, d_model=16, heads=1, dk=4, seed=0):
    torch.manual_seed(seed)
    return train_recall.Model(paths, TINY["vocab"], d_model, heads, {"dk": dk, "dv": dk}, TINY["tokens"],
                              backend="numpy")  # (the C kernels are the same computation, and cost a build each)


def test_the_task():
    x, y = train_recall.Task(**TINY).batch(4, np.random.default_rng(0))
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        keys, values = row_x[0:6:2], row_x[1:6:2]
        asked = np.flatnonzero(row_y != -100)
        assert sorted(row_x[asked]) == sorted(keys)  # every key is asked once, after the context
        for place in asked:  # its target is its value, which follows it
            assert row_y[place] == values[list(keys).index(row_x[place])] == row_x[place + 1]


def test_training_lowers_the_loss():
    model = tiny_model(["examples/gla.lin", "examples/softmax.lin"])
    result = train_recall.train(model, train_recall.Task(**TINY), steps=30, batch=16, lr=1e-2, seed=0, show=False)
    first, last = np.mean(result["losses"][:5]), np.mean(result["losses"][-5:])
    assert last < first - 0.1, (first, last)
    assert all(p.grad is not None for p in model.parameters())  # (every parameter trained, the programs' too)


@pytest.mark.parametrize("paths", [["examples/gated_deltanet.lin", "examples/softmax.lin"],
                                   ["examples/mamba2.lin"], ["examples/retnet.lin"]])
def test_decode_equals_the_forward(paths):
    model = tiny_model(paths).double()  # (float64: only the order of the sums differs)
    x, _ = train_recall.Task(**TINY).batch(2, np.random.default_rng(1))
    assert train_recall.decode_difference(model, x) <= 1e-10


def test_projections_follow_the_declared_ranges():
    declared = {x.name: x for x in linrec.load("examples/gated_deltanet.lin").program.inputs}
    declared |= {x.name: x for x in linrec.load("examples/mamba2.lin").program.inputs}
    t = torch.linspace(-40, 40, 101)
    beta = train_recall.input_map(declared["beta"])(t)      # in (0, 1)
    g = train_recall.input_map(declared["g"])(t)            # <= 0
    dt = train_recall.input_map(declared["dt"])(t)          # > 0
    assert bool((beta > 0).all() and (beta < 1).all() and (g <= 0).all() and (dt > 0).all())
    assert torch.equal(train_recall.input_map(declared["q"])(t), t)  # no range: as it is


def test_memory_follows_the_declarations():
    model = tiny_model(["examples/linear_transformer.lin", "examples/softmax.lin"], heads=2, dk=4)
    linear, attention = (block.mixer.layer for block in model.blocks)
    assert train_recall.layer_memory(linear, 32768) == 2 * (4 * 4 + 4) * 4  # S [dk, dv] and z [dk], float32
    assert train_recall.layer_memory(attention, 32768) == 32768 * 2 * (4 + 4) * 4  # k and v at every token
    assert train_recall.cached_inputs(attention.rec.program) == {"k", "v"}


def test_the_command_line(capsys):
    results = train_recall.main(["examples/retnet.lin,examples/softmax.lin", "--steps", "3", "--d-model", "16",
                                 "--heads", "1", "--dk", "4", "--vocab", "16", "--tokens", "16", "--pairs", "3",
                                 "--batch", "4", "--backend", "numpy"])
    out = capsys.readouterr().out
    assert "| retnet + softmax | 2 |" in out and "decode step vs forward" in out
    assert results[0]["decode"] <= 1e-4
    with pytest.raises(SystemExit, match="no such program file 'nope.lin'"):
        train_recall.main(["examples/gla.lin,nope.lin"])


def test_any_number_of_steps_has_a_schedule(capsys):
    """The learning-rate cycle of a run of any length ≥ 1 (OneCycleLR's warm-up, at 10 steps of a tenth, was 0
    steps long and divided by zero): every step's rate finite, above 0 and at most --lr. Fewer than 1 step:
    argparse's error."""
    for steps in (1, 2, 3, 10, 14, 15, 300):
        optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-2)
        schedule = train_recall.one_cycle(optimizer, 1e-2, steps)
        rates = []
        for _ in range(steps):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        assert all(0 < r <= 1e-2 for r in rates) and np.isfinite(rates).all(), (steps, rates)
        if steps >= 10:  # (the warm-up reaches --lr, then the rate falls)
            assert max(rates) > 0.9e-2 and rates[-1] < 1e-3, (steps, rates)
    for given, said in (("0", "argument --steps: 0 steps: give at least 1"),
                        ("ten", "argument --steps: 'ten' is not a whole number of steps")):
        with pytest.raises(SystemExit) as done:
            train_recall.main(["examples/gla.lin", "--steps", given])
        assert done.value.code == 2 and said in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as done:
        train_recall.main(["--help"])
    assert done.value.code == 0 and "LAYERS" in capsys.readouterr().out


def test_a_non_causal_program_is_refused_before_training(capsys):
    """Linformer reads the whole sequence: trained on recall it would see the answers, and it has no decode
    step. The script refuses it up front (it used to train for every step and fail at the decode)."""
    examples = SCRIPT.parent
    with pytest.raises(SystemExit, match="linformer.lin is non-causal: its outputs read the whole sequence"):
        train_recall.main([str(examples / "linformer.lin"), "--steps", "1"])
    assert "parameters" not in capsys.readouterr().out  # (no model was built)
