"""The mpc package on the digits MLP (tests/models/digits_mlp.onnx, tests/data/digits.safetensors):
steps from a Python loop, the numbers read lazily, the rate set from the host, evaluation, the
state as numpy arrays and back, checkpoints, export, and errors as exceptions with mpc's lines."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import mpc

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "models" / "digits_mlp.onnx"
DATA = ROOT / "tests" / "data" / "digits.safetensors"


def read_safetensors(path):
    """The tensors of a safetensors file (numpy only)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.float32, "I64": np.int64, "F16": np.float16, "F64": np.float64, "I32": np.int32}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


@pytest.fixture(scope="module")
def digits():
    d = read_safetensors(DATA)
    return d["images"], d["labels"]


def batches(digits, size=64, count=20, start=0):
    x, y = digits
    for k in range(count):
        s = start + k * size
        yield {"images": x[s : s + size], "labels": y[s : s + size]}


def test_a_python_loop_trains_and_reads_the_loss_lazily(digits):
    trainer = mpc.compile(MODEL, policy="mixed", optimizer="adam", lr=3e-3)
    steps = [trainer.step(**b) for b in batches(digits, count=20)]  # no wait inside the loop
    losses = [s.loss for s in steps]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert steps[0].loss_scale == 65536.0 and not steps[0].skipped
    assert sorted(trainer.inputs) == ["images", "labels"]
    held_out = trainer.evaluate(images=digits[0][1500:], labels=digits[1][1500:])
    assert held_out["counted"] == 297 and held_out["accuracy"] > 0.5, held_out


def test_the_rate_is_set_from_the_host(digits):
    trainer = mpc.compile(MODEL, policy="fp32", optimizer="sgd", lr=0.1)
    b = next(batches(digits))
    assert trainer.step(**b).lr == pytest.approx(0.1)
    before = trainer.state_dict()["fc1.weight"]
    trainer.lr = 0.0
    assert trainer.lr == 0.0
    step = trainer.step(**b)
    assert step.lr == 0.0
    np.testing.assert_array_equal(trainer.state_dict()["fc1.weight"], before)


def test_the_state_round_trips_through_numpy_and_checkpoints(digits, tmp_path):
    a = mpc.compile(MODEL, policy="mixed", lr=1e-3)
    for b in batches(digits, count=3):
        a.step(**b).loss
    state = a.state_dict()
    assert "fc1.weight" in state and "mpc.adam_m.fc1.weight" in state and "mpc.step" in state
    assert state["fc1.weight"].dtype == np.float32 and state["mpc.step"][()] == 3
    # Another trainer given the state steps as the first does.
    b = mpc.compile(MODEL, next(batches(digits)), policy="mixed", lr=1e-3)
    b.load_state_dict(state)
    nxt = next(batches(digits, start=3 * 64))
    assert a.step(**nxt).loss == b.step(**nxt).loss
    # The CLI's checkpoint, both ways.
    a.save(tmp_path / "checkpoint.safetensors", steps=4)
    c = mpc.compile(MODEL, next(batches(digits)), policy="mixed", lr=1e-3)
    assert c.load(tmp_path / "checkpoint.safetensors") == 4
    for name, t in a.state_dict().items():
        np.testing.assert_array_equal(c.state_dict()[name], t, err_msg=name)
    a.export(tmp_path / "trained.onnx")
    assert (tmp_path / "trained.onnx").stat().st_size > 0


def test_errors_are_exceptions_with_mpcs_lines(digits, tmp_path):
    with pytest.raises(mpc.InputError, match="unknown training option `learning_rate`"):
        mpc.compile(MODEL, learning_rate=0.1)
    trainer = mpc.compile(MODEL, policy="fp32")
    with pytest.raises(mpc.InputError, match="images"):
        trainer.step(images=digits[0][:8, :32], labels=digits[1][:8])
    with pytest.raises(mpc.InputError, match="optimizer `lion`"):
        mpc.compile(MODEL, next(batches(digits)), optimizer="lion")
    missing = tmp_path / "none.onnx"
    with pytest.raises(mpc.Error, match="none.onnx"):
        mpc.compile(missing, next(batches(digits)))
    with pytest.raises(mpc.InputError, match="lr -1"):
        trained = mpc.compile(MODEL, next(batches(digits)))
        trained.lr = -1.0


def test_devices_names_the_cpu():
    lines = mpc.devices()
    assert lines[0].startswith("cpu:")


def test_long_calls_let_other_python_threads_run(digits):
    """An evaluation of 30 copies of the digits (53,910 samples, some hundred milliseconds) and
    the first step (which compiles the training step) release the GIL: a Python thread ticking
    every millisecond ticks while each call runs, where a call holding the GIL would stop it
    until the call returned."""
    import threading
    import time

    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    images, labels = np.tile(digits[0], (30, 1)), np.tile(digits[1], 30)
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        trainer = mpc.compile(MODEL, policy="mixed", optimizer="adam", lr=3e-3)
        spans = []
        for call in (lambda: trainer.step(**next(batches(digits))),
                     lambda: trainer.evaluate(images=images, labels=labels)):
            t0 = time.perf_counter()
            call()
            spans.append((t0, time.perf_counter()))
    finally:
        stop.set()
        ticker.join()
    (s0, s1), (e0, e1) = spans
    assert e1 - e0 > 0.05, f"the evaluation took {1e3 * (e1 - e0):.0f} ms: too short to tell"
    for t0, t1 in spans:
        middle = [t for t in ticks if t0 + 0.25 * (t1 - t0) < t < t1 - 0.25 * (t1 - t0)]
        # The first step tells only where it is long against the ticker's period.
        if t1 - t0 > 0.05:
            assert middle, f"no tick during a call of {1e3 * (t1 - t0):.0f} ms"
