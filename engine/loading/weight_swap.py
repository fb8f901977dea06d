"""Replacing a loaded model's weights in place with another checkpoint's (an RL loop's reload).

    staged = stage_weights(engine.model, "ckpt/step-200", dtype=engine.dtype)  # load + check; nothing changes
    apply_weights(engine.model, staged)                                          # copy in place

Why in place: the engine keeps its model object, its KV cache and everything sized from
them; the parameters keep their storage (a copy_ into each), so nothing is reallocated on
the device. The new checkpoint is read with the ordinary loaders (engine/loading/checkpoint.py
`load_model`) into a staging model on the CPU, in the engine's dtype, and copied from there:
the device never holds two copies of the weights (the host holds the staging copy until
`apply_weights` is done). The loaders' casts and concatenations give the same values on
the CPU as on the device, so the result equals loading the checkpoint afresh, bit for bit.

What must match (else WeightsMismatch naming each difference, and nothing changes): the
model class, `ModelInfo` (vocabulary, context, layers, KV heads, head_dim, per-slot state,
stop tokens; the description may differ), `architecture()` (the config outside the tensors:
norm eps, rope, windows, activation, ...), and the state dict: the same names, shapes and
dtypes, and the same tied tensors. Buffers computed from the config and not saved (rotary
tables) are left as they are: the configs are equal, so they are too.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from engine.loading.checkpoint import load_model, nanochat_step
from engine.loading.errors import CheckpointError
from engine.models.base import CausalLM

MAX_LISTED = 8  # differences of one kind named in a WeightsMismatch message


class WeightsMismatch(CheckpointError):
    """A checkpoint whose model is not the loaded model's architecture and shapes; the
    message names the checkpoint and every kind of difference (at most 8 of each)."""


@dataclass(slots=True, eq=False)
class StagedWeights:
    """A checkpoint loaded and checked against a model, ready for `apply_weights`.

    path: the checkpoint as given; step: the nanochat step it loaded (None for other
    formats); description: its ModelInfo description; model: the staging model (CPU).
    """

    path: str
    step: int | None
    description: str
    model: CausalLM


def stage_weights(model: CausalLM, path: str | Path, *, dtype: torch.dtype, step: int | None = None) -> StagedWeights:
    """Load checkpoint `path` (only its model, on the CPU in `dtype`) and check that it can
    replace `model`'s weights. `model` is only read (its class, info, config and tensor
    shapes), so this may run while another thread steps an engine on it.

    step: for a nanochat directory, the step to load (default: its highest, resolved now, so
    the same file is loaded again later when a directory gains newer steps).
    Raises FileNotFoundError / CheckpointError as the loaders do, and WeightsMismatch
    (a CheckpointError) naming what differs.
    """
    step = nanochat_step(path, step)
    new = load_model(path, device="cpu", dtype=dtype, step=step, vocab_size=model.info.vocab_size)
    diffs = differences(model, new)
    if diffs:
        raise WeightsMismatch(f"{path}: its model is not the loaded model's architecture and shapes: "
                              + "; ".join(diffs))
    return StagedWeights(path=str(path), step=step, description=new.info.description, model=new)


def apply_weights(model: CausalLM, staged: StagedWeights) -> None:
    """Copy the staged weights into `model`'s parameters and saved buffers, in place (no
    tensor is reallocated), then drop what `model` derived from its old weights. Call with
    no forward running on `model`. Raises RuntimeError (leaving `model` partly updated)
    only if a copy fails, e.g. the device is out of memory or lost."""
    src = staged.model.state_dict()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(src[name])
    model.weights_changed()
    model.info.description = staged.description
    staged.model = None  # type: ignore[assignment]  # the staging copy is not needed any more


def differences(old: CausalLM, new: CausalLM) -> list[str]:
    """What keeps `new`'s weights from replacing `old`'s (empty: they can), one phrase per
    kind of difference, each naming the setting or tensors and both values."""
    if type(old) is not type(new):
        return [f"the checkpoint is a {type(new).__name__} ({new.info.arch}), the loaded model a "
                f"{type(old).__name__} ({old.info.arch})"]
    out = []
    for f in fields(old.info):
        if f.name != "description" and getattr(old.info, f.name) != getattr(new.info, f.name):
            out.append(f"{f.name} {getattr(new.info, f.name)!r} (loaded: {getattr(old.info, f.name)!r})")
    a, b = _flatten(old.architecture()), _flatten(new.architecture())
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k} {b.get(k)!r} (loaded: {a.get(k)!r})")
    sa, sb = old.state_dict(), new.state_dict()
    missing, unknown = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if missing:
        out.append(f"tensors missing: {_listed(missing)}")
    if unknown:
        out.append(f"tensors the loaded model does not have: {_listed(unknown)}")
    shapes = [f"{k} {tuple(sb[k].shape)} {_dtype(sb[k])} (loaded: {tuple(sa[k].shape)} {_dtype(sa[k])})"
              for k in sa if k in sb and (sa[k].shape != sb[k].shape or sa[k].dtype != sb[k].dtype)]
    if shapes:
        out.append(f"tensor shapes or dtypes differ: {_listed(shapes)}")
    if not missing and not unknown and _tied(sa) != _tied(sb):
        out.append(f"tied tensors differ: {sorted(_tied(sb))} (loaded: {sorted(_tied(sa))})")
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _tied(sd: dict[str, torch.Tensor]) -> set[tuple[str, ...]]:
    """Groups of state-dict names that share one tensor (a head tied to the embedding)."""
    groups: dict[int, list[str]] = {}
    for k, t in sd.items():
        groups.setdefault(t.data_ptr(), []).append(k)
    return {tuple(sorted(g)) for g in groups.values() if len(g) > 1}


def _listed(items: list[str]) -> str:
    return ", ".join(items[:MAX_LISTED]) + (f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


__all__ = ["StagedWeights", "WeightsMismatch", "apply_weights", "differences", "stage_weights"]
