"""Replacing a loaded model's weights in place: with another checkpoint's (an RL loop's
reload), or with a trainer's tensors from memory.

    staged = stage_weights(engine.model, "ckpt/step-200", dtype=engine.dtype)  # check; nothing changes
    apply_weights(engine.model, staged)                                          # copy in place, file by file
    pairs = tensor_pairs(named_tensors)                                          # raises for a tensor without data
    check_tensors(engine.model, [(name, "float32", shape), ...])                 # a trainer's index; raises
    copy_tensors(engine.model, pairs)                                            # copy in place

Why in place: the engine keeps its model object, its KV cache and everything sized from
them; the parameters keep their storage (a copy_ into each), so nothing is reallocated on
the device.

A checkpoint is checked before anything is read but its headers: the model it would load is
built on the meta device by the ordinary loaders (engine/loading/checkpoint.py
`model_skeleton`) and compared with the loaded one (`differences`), and its tensor names
and shapes with the loaded model's weight map (engine/loading/weight_map.py). Then
`apply_weights` reads it tensor by tensor (safetensors and torch files memory-mapped,
engine/loading/tensor_files.py) and copies each into its place through the weight map: host
memory above the model is one tensor, never a staged copy. A GGUF file (dequantized whole)
and the built-in names are still loaded into a staging model on the CPU and copied from it.
The weight map casts and places each tensor as the loaders do, so the result equals loading
the checkpoint afresh, bit for bit.

What must match (else WeightsMismatch naming each difference, and nothing changes): the
model class, `ModelInfo` (vocabulary, context, layers, KV heads, head_dim, per-slot state,
stop tokens; the description may differ), `architecture()` (the config outside the tensors:
norm eps, rope, windows, activation, ...), and the state dict: the same names, shapes and
dtypes, and the same tied tensors; for tensors from memory (no config comes with them), the
names, shapes and floating-point dtypes of the weight map. Buffers computed from the config
and not saved (rotary tables) are left as they are: the configs are equal, so they are too.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import torch

from engine.loading.checkpoint import copy_tensors, load_model, model_skeleton, nanochat_step, weight_map
from engine.loading.errors import CheckpointError
from engine.loading.weight_map import index_differences, listed
from engine.models.base import CausalLM

MEMORY = "<memory>"  # the `path` of weights that came from memory


class WeightsMismatch(CheckpointError):
    """Weights whose model is not the loaded model's architecture and shapes; the message
    names the checkpoint (or "weights from memory") and every kind of difference (at most 8
    of each)."""


@dataclass(slots=True, eq=False)
class StagedWeights:
    """A checkpoint checked against a model, ready for `apply_weights`.

    path: the checkpoint as given; step: the nanochat step it loads (None for other
    formats); description: its ModelInfo description; files: its tensors, read by
    `apply_weights` one at a time (engine.loading.tensor_files.TensorFiles), or model: a
    staging model on the CPU (GGUF files, built-in names), the other None.
    """

    path: str
    step: int | None
    description: str
    model: CausalLM | None
    files: Any = None


def stage_weights(model: CausalLM, path: str | Path, *, dtype: torch.dtype, step: int | None = None) -> StagedWeights:
    """Check that checkpoint `path` can replace `model`'s weights, reading only its headers
    (a GGUF file or built-in name: loading it into a staging model on the CPU). `model` is
    only read (its class, info, config and tensor shapes), so this may run while another
    thread steps an engine on it.

    step: for a nanochat directory, the step to load (default: its highest, resolved now, so
    the same file is loaded again later when a directory gains newer steps).
    Raises FileNotFoundError / CheckpointError as the loaders do, and WeightsMismatch
    (a CheckpointError) naming what differs.
    """
    step = nanochat_step(path, step)
    device = next(model.parameters()).device
    skeleton = model_skeleton(path, device, dtype, step=step)
    if skeleton is None:
        new, files = load_model(path, device="cpu", dtype=dtype, step=step, vocab_size=model.info.vocab_size), None
    else:
        new, files = skeleton
    diffs = differences(model, new)
    if files is not None and not diffs:
        diffs = index_differences(model, weight_map(model),
                                  [(k, _dtype(t), tuple(t.shape)) for k, t in files.meta().items()])
    if diffs:
        raise WeightsMismatch(f"{path}: its model is not the loaded model's architecture and shapes: "
                              + "; ".join(diffs))
    return StagedWeights(path=str(path), step=step, description=new.info.description,
                         model=new if files is None else None, files=files)


def apply_weights(model: CausalLM, staged: StagedWeights) -> None:
    """Copy the staged checkpoint's weights into `model`'s parameters and saved buffers, in
    place (no tensor is reallocated), file by file, then drop what `model` derived from its
    old weights. Call with no forward running on `model`. Raises RuntimeError or OSError
    (leaving `model` partly updated) only if a copy or a read fails, e.g. the device is out
    of memory or lost, or a file changed since `stage_weights`."""
    if staged.model is not None:
        src = staged.model.state_dict()
        with torch.no_grad():
            for name, t in model.state_dict(keep_vars=True).items():
                t.copy_(src[name])
        staged.model = None  # the staging copy is not needed any more
    else:
        copy_tensors(model, staged.files)
    model.weights_changed()
    model.info.description = staged.description


def tensor_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """A trainer's tensors (a mapping, or an iterable of (name, tensor)) as a list of pairs,
    each checked to hold data a swap can copy: a torch.Tensor, strided (not sparse), not on
    the meta device. Raises TypeError naming the first entry that is not, before anything
    is copied (a copy failing there would leave the model half updated)."""
    pairs = []
    for i, item in enumerate(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors):
        pair = isinstance(item, (tuple, list)) and len(item) == 2
        if not (pair and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            what = (f"a {type(item).__name__}" if not pair else f"its name {item[0]!r} is not a str"
                    if not isinstance(item[0], str) else f"{item[0]} is a {type(item[1]).__name__}")
            raise TypeError(f"named_tensors[{i}] is not a (name, torch.Tensor) pair: {what}")
        name, t = item
        if t.device.type == "meta" or t.layout != torch.strided:
            where = "on the meta device (it has no data)" if t.device.type == "meta" else f"{t.layout}, not strided"
            raise TypeError(f"named_tensors[{i}]: tensor {name} is {where}")
        pairs.append((name, t))
    return pairs


def check_tensors(model: CausalLM, index: Iterable[tuple[str, str, tuple[int, ...]]]) -> None:
    """Check a trainer's tensors, given as (name, dtype name, shape) each, against `model`'s
    weight map (engine/loading/weight_map.py): every tensor of the model named once, in its
    shape, floating point. Raises WeightsMismatch naming every difference, TypeError for a
    model family without a weight map."""
    diffs = index_differences(model, weight_map(model), index)
    if diffs:
        raise WeightsMismatch("weights from memory do not fit the loaded model: " + "; ".join(diffs))


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
    sa, sb = old.state_dict(keep_vars=True), new.state_dict(keep_vars=True)
    missing, unknown = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if missing:
        out.append(f"tensors missing: {_listed(missing)}")
    if unknown:
        out.append(f"tensors the loaded model does not have: {_listed(unknown)}")
    shapes = [f"{k} {tuple(sb[k].shape)} {_dtype(sb[k])} (loaded: {tuple(sa[k].shape)} {_dtype(sa[k])})"
              for k in sa if k in sb and (sa[k].shape != sb[k].shape or sa[k].dtype != sb[k].dtype)]
    if shapes:
        out.append(f"tensor shapes or dtypes differ: {_listed(shapes)}")
    if not missing and not unknown and _tied(old) != _tied(new):
        out.append(f"tied tensors differ: {sorted(_tied(new))} (loaded: {sorted(_tied(old))})")
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _tied(model: torch.nn.Module) -> set[tuple[str, ...]]:
    """Groups of state-dict names that are one tensor (a head tied to the embedding), by the
    tensor object: on the meta device, where every data pointer is 0, too."""
    groups: dict[int, list[str]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(k)
    return {tuple(sorted(g)) for g in groups.values() if len(g) > 1}


_listed = listed


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


__all__ = ["MEMORY", "StagedWeights", "WeightsMismatch", "apply_weights", "check_tensors", "copy_tensors",
           "differences", "stage_weights", "tensor_pairs"]
