"""mpc from Python: compile a model's whole mixed-precision training step ahead of time and train it
from your own loop.

    import mpc
    trainer = mpc.compile("model.onnx", policy="mixed", optimizer="adamw", lr=3e-4)
    for x, y in loader:
        out = trainer.step(input_ids=x, labels=y)   # returns at once
    print(out.loss)                                  # waits for the device only now

Arrays are numpy arrays or torch tensors (CPU); the Rust core (``mpc._mpc``) holds the library's
Trainer and no training logic of its own. Options are those of ``mpc train`` and the ``[train]``
table of a policy file, by the same names.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from . import _mpc
from ._mpc import Error, InputError, InternalError, ModelError

__all__ = [
    "Error",
    "InputError",
    "InternalError",
    "ModelError",
    "Step",
    "Trainer",
    "compile",
    "devices",
]

# The [train] table's keys: the options compile() passes on (any other is an error naming it).
_TRAIN_KEYS = (
    "loss", "labels", "optimizer", "lr", "schedule", "warmup", "lr_min", "total_steps",
    "weight_decay", "momentum", "beta1", "beta2", "epsilon", "clip_norm", "loss_scale",
    "init_scale", "growth_factor", "growth_interval", "backoff_factor", "min_scale",
    "max_scale", "freeze", "seed", "tie", "weight_copies", "no_decay", "accumulate",
)


def _array(x: Any) -> np.ndarray:
    """A C-contiguous numpy view of ``x`` (a torch tensor goes through ``.numpy()``)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, order="C")


def _wire(batch: Mapping[str, Any]) -> Dict[str, Tuple[str, list, bytes]]:
    out = {}
    for name, x in batch.items():
        a = _array(x)
        out[name] = (a.dtype.name, list(a.shape), a.tobytes())
    return out


def _unwire(t: Tuple[str, list, bytes]) -> np.ndarray:
    dtype, shape, data = t
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


class Step:
    """One step's numbers, staged to the host: each is read (and the device waited for) when
    first asked for."""

    def __init__(self, inner: Any):
        self._inner = inner

    @property
    def loss(self) -> float:
        return self._inner.loss

    @property
    def skipped(self) -> bool:
        return self._inner.skipped

    @property
    def lr(self) -> float:
        return self._inner.lr

    @property
    def loss_scale(self) -> Optional[float]:
        return self._inner.loss_scale

    def __repr__(self) -> str:
        return f"mpc.Step(loss={self.loss:.6g}, skipped={self.skipped}, lr={self.lr:.6g})"


class Trainer:
    """A model's training step compiled by mpc and kept on a device, its state resident.

    Made by :func:`compile`. The step is compiled when the first batch arrives (its sample dims,
    a sequence length, are bound from it); a batch of another sequence length compiles the step
    for it too, over the same state.
    """

    def __init__(self, model: str, policy: str, settings: Dict[str, Any], device: str):
        self._model = os.fspath(model)
        self._policy = policy
        self._settings = json.dumps(settings)
        self._device = device
        self._inner: Optional[Any] = None

    def _trainer(self, batch: Optional[Mapping[str, Any]] = None) -> Any:
        if self._inner is None:
            if batch is None:
                raise InputError(f"{self._model}: no step has run yet: give a batch first")
            self._inner = _mpc.Trainer(self._model, _wire(batch), self._policy, self._settings, self._device)
        return self._inner

    def step(self, **batch: Any) -> Step:
        """One training step on ``batch`` (the model's inputs and the labels, by name). Returns
        at once; the step's numbers are read when asked for."""
        return Step(self._trainer(batch).step(_wire(batch)))

    def evaluate(self, **batch: Any) -> Dict[str, Any]:
        """The batch's mean loss, and for a cross-entropy loss its accuracy: the share of labels
        (not ignored) whose class scores highest."""
        loss, correct, counted = self._trainer(batch).evaluate(_wire(batch))
        return {"loss": loss, "correct": correct, "counted": counted,
                "accuracy": correct / counted if counted else None}

    @property
    def lr(self) -> float:
        """The learning rate of the next steps (under a schedule, the peak it scales); set it
        from any host schedule (a torch scheduler's values)."""
        return self._trainer().lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._trainer().lr = float(value)

    @property
    def loss_scale(self) -> Optional[float]:
        return self._trainer().loss_scale

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Every state tensor by name: the trained weights under the model's initializer names,
        the optimizer's state and counters under ``mpc.``."""
        return {name: _unwire(t) for name, t in self._trainer().state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Writes ``state`` (as :meth:`state_dict` gives it) into the trainer, checked as a
        checkpoint is: every state tensor present and finite, counters not negative."""
        self._trainer().load_state(_wire(state))

    def save(self, path: str, steps: int = 0) -> None:
        """Writes the checkpoint ``mpc train --checkpoint`` writes (``steps``: batches done)."""
        self._trainer().save(os.fspath(path), int(steps))

    def load(self, path: str) -> int:
        """Loads such a checkpoint; returns its batches done."""
        return self._trainer().load(os.fspath(path))

    def export(self, path: str) -> None:
        """Writes the model with the trained weights as ONNX, for any ONNX runtime."""
        self._trainer().export(os.fspath(path))

    @property
    def inputs(self) -> list:
        """The names the step reads: the model's inputs and the labels."""
        return self._trainer().inputs()

    def stats(self) -> str:
        return self._trainer().stats()

    def __repr__(self) -> str:
        return f"mpc.Trainer({self._model!r}, policy={self._policy!r}, device={self._device!r})"


def compile(model: Any, example: Optional[Mapping[str, Any]] = None, *, policy: str = "mixed",
            device: str = "cpu", **options: Any) -> Trainer:
    """A trainer of ``model`` (a path to an ONNX or text-IR file) under ``policy`` (fp32, mixed,
    mixed-bf16, fp16) on ``device`` (cpu or cuda). ``options`` are the training options of
    ``mpc train`` by their ``[train]`` names (``loss``, ``labels``, ``optimizer``, ``lr``,
    ``schedule``, ``warmup``, ``weight_decay``, ``clip_norm``, ``accumulate``, ...). With
    ``example`` (a batch), the step is compiled now; else at the first step."""
    unknown = sorted(set(options) - set(_TRAIN_KEYS))
    if unknown:
        raise InputError(f"unknown training option `{unknown[0]}` (known: {', '.join(_TRAIN_KEYS)})")
    path = os.fspath(model)
    trainer = Trainer(path, policy, {k: v for k, v in options.items() if v is not None}, device)
    if example is not None:
        trainer._trainer(example)
    return trainer


def devices() -> list:
    """One line for the CPU and one for each GPU mpc can use (or why none can be)."""
    lines, problem = _mpc.devices()
    return lines + ([problem] if problem else [])
