"""Where a trainer's tensors go in a loaded model, one tensor at a time.

A trainer names its tensors as its model does (transformers' names for the Llama family and
GPT-2, nanochat's own for nanochat); the engine's models hold some of them fused or
transposed (engine/loading/llama.py: q/k/v in one `qkv`, gate/up in one `gate_up`;
gpt2.py: Conv1D weights as (out, in)). Each loader module says where each of its names goes
(`weight_map(model)`, next to the builder that makes the same fusions; weight_swap.py
`weight_map` picks the family's), as a `WeightMap` of `Target`s, and this module uses it to check a list of (name, dtype, shape) against a model
(`index_differences`) and to copy tensors into the model in place (`copy_tensor`), without
ever building a second model. Used for weights from memory (GenerationPool.update_weights)
and for checkpoint files read tensor by tensor (engine/loading/weight_swap.py).

Values: a tensor is cast to its parameter's dtype by `copy_` (round to nearest even), as the
loaders' `.to(dtype)` casts it, so the result equals the loader's bit for bit; float64 goes
through float32 first, as the loaders' float32 build does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

MAX_LISTED = 8  # names of one kind of difference listed in a message


@dataclass(frozen=True, slots=True)
class Target:
    """Where one trainer tensor goes: the engine model's state-dict name `param`, its rows
    [a, b) for a fused tensor (None: all of it), `transpose` for a tensor stored (in, out)
    (GPT-2's Conv1D) where the engine holds (out, in), and `broadcast` for one row repeated
    over `rows` (Qwen3's per-head q/k norm gain, (head_dim,) into (heads, head_dim))."""

    param: str
    rows: tuple[int, int] | None = None
    transpose: bool = False
    broadcast: bool = False

    def source_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the trainer's tensor must have, for a parameter of `param_shape`."""
        shape = tuple(param_shape) if self.rows is None else (self.rows[1] - self.rows[0],) + tuple(param_shape[1:])
        if self.broadcast:
            shape = shape[1:]
        return shape[::-1] if self.transpose else shape


@dataclass(slots=True)
class WeightMap:
    """A model family's trainer names -> Target (None: accepted and ignored, e.g. a tied
    head). strip_prefixes: prefixes a trainer may add (torch.compile's "_orig_mod.",
    GPT2LMHeadModel's "transformer."); ignored_suffixes: buffers old checkpoints carry that
    the loader skips too (a rotary inv_freq, GPT-2's causal-mask bias); defaults: names that
    may be left out as long as one of them is given (nanochat's resid_lambdas / x0_lambdas,
    which its loader accepts alone, patching the other to ones / zeros), each with the value
    its parameter takes when it is left out: `copy_tensor` writes them all before the first
    of them is copied, once per map (checkpoint.copy_tensors makes a map for each swap; a pool
    worker's buckets of one update share one, cluster/worker.py), so the tensors given then
    overwrite their defaults, in any order."""

    targets: dict[str, Target | None]
    strip_prefixes: tuple[str, ...] = ()
    ignored_suffixes: tuple[str, ...] = field(default=())
    defaults: dict[str, float] = field(default_factory=dict)
    defaults_written: bool = False

    def canonical(self, name: str) -> str:
        for p in self.strip_prefixes:
            if name.startswith(p) and name[len(p):] in self.targets:
                return name[len(p):]
        return name

    def ignored(self, name: str) -> bool:
        return name.endswith(self.ignored_suffixes) if self.ignored_suffixes else False


def index_differences(model: torch.nn.Module, wmap: WeightMap,
                      index: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[str]:
    """Why tensors named and shaped as `index` ((name, dtype name, shape) each: "float32",
    "bfloat16", ...) cannot replace `model`'s weights: one phrase per kind of difference
    (names given twice, unknown names, missing names, shapes, dtypes that are not floating
    point), each listing the tensors; empty when they can. The whole model must be covered:
    every name of the map that is not ignored, but for those with a default when another of
    them is given."""
    params = {k: tuple(t.shape) for k, t in model.state_dict(keep_vars=True).items()}
    seen: dict[str, str] = {}
    twice, unknown, shapes, dtypes = [], [], [], []
    for name, dtype, shape in index:
        key = wmap.canonical(name)
        if key in seen:
            twice.append(f"{name} (and {seen[key]})")
            continue
        seen[key] = name
        if key not in wmap.targets:
            if not wmap.ignored(key):
                unknown.append(name)
            continue
        t = wmap.targets[key]
        if not str(dtype).startswith(("float", "bfloat")):
            dtypes.append(f"{name} {dtype}")
        if t is not None and tuple(shape) != t.source_shape(params[t.param]):
            shapes.append(f"{name} {tuple(shape)} (expected {t.source_shape(params[t.param])})")
    defaulted = set(wmap.defaults) if seen.keys() & wmap.defaults.keys() else set()
    missing = [k for k, t in wmap.targets.items() if t is not None and k not in seen and k not in defaulted]
    out = []
    for what, items in (("tensors given twice", twice), ("tensors missing", missing),
                        ("tensors the loaded model does not have", unknown), ("tensor shapes differ", shapes),
                        ("tensors that are not floating point", dtypes)):
        if items:
            out.append(f"{what}: {listed(items)}")
    return out


def copy_tensor(params: dict[str, torch.Tensor], wmap: WeightMap, name: str, tensor: torch.Tensor) -> bool:
    """Copy trainer tensor `name` into its place among `params` (the model's
    `state_dict(keep_vars=True)`), in place, cast to the parameter's dtype; False for a name
    the map ignores. The first of the map's `defaults` copied writes them all first. Call
    under torch.no_grad() with the names checked (index_differences):
    raises KeyError for an unknown name and RuntimeError for a shape that does not fit."""
    key = wmap.canonical(name)
    if key not in wmap.targets and wmap.ignored(key):
        return False
    t = wmap.targets[key]
    if t is None:
        return False
    if key in wmap.defaults and not wmap.defaults_written:  # those not given keep these (index_differences)
        for k, value in wmap.defaults.items():
            params[wmap.targets[k].param].fill_(value)
        wmap.defaults_written = True
    dst = params[t.param]
    if t.rows is not None:
        dst = dst[t.rows[0]:t.rows[1]]
    if tuple(tensor.shape) != t.source_shape(tuple(params[t.param].shape)):
        raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} does not fit {t.param}")
    src = tensor.t() if t.transpose else tensor
    dst.copy_(src.float() if src.dtype == torch.float64 else src)
    return True


def listed(items: list[str]) -> str:
    return ", ".join(items[:MAX_LISTED]) + (f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")


__all__ = ["Target", "WeightMap", "copy_tensor", "index_differences", "listed"]
