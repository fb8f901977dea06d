"""Weights from memory as buckets: a trainer's tensors packed into a few large byte buffers
for Ray's object store, and applied to an engine straight from them.

    index = tensor_index(pairs)                      # [(name, dtype, shape), ...]: what workers check first
    for bucket in pack_buckets(pairs, 512 << 20):    # (index, uint8 numpy array), one at a time
        ref = ray.put(bucket)                        # once; every worker on a node reads the same copy
    copy_bucket(engine, ray.get(ref))                # in a worker: each tensor into its place, in place

The layout follows slime's flattened-bucket weight updates: one contiguous buffer per bucket
and a small index of name, dtype, shape and offset, so a bucket is one object in the store
(no per-tensor overhead) and numpy's buffer is read by the workers without a copy. No Ray
here: cluster/weight_sync.py moves the buckets, cluster/worker.py applies them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

ALIGN = 64  # byte alignment of each tensor in a bucket (any dtype's view needs its own size)


@dataclass(frozen=True, slots=True)
class PoolWeights:
    """The weights a pool's workers hold, for a worker started now: the checkpoint of the
    last load_weights (path, step; None: the task's), then the buckets of the last
    update_weights since (ObjectRefs; empty: none), and the pool's count of swaps."""

    version: int
    path: str | None = None
    step: int | None = None
    buckets: tuple = ()


def tensor_index(pairs: list[tuple[str, Any]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of each (name, tensor), as the workers check them. Raises
    TypeError naming an entry that is not (str, torch.Tensor)."""
    import torch

    out = []
    for i, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"named_tensors[{i}] is not a (name, torch.Tensor) pair: {type(item).__name__}")
        out.append((item[0], str(item[1].dtype).replace("torch.", ""), tuple(item[1].shape)))
    return out


def pack_buckets(pairs: list[tuple[str, Any]], bucket_bytes: int) -> Iterator[tuple[list, Any]]:
    """The tensors of `pairs` in buckets of about `bucket_bytes` (a larger tensor has one of
    its own): each (index, data), data one uint8 numpy array holding the tensors' bytes one
    after another (each at an offset aligned to 64 bytes), index [(name, dtype name, shape,
    offset, nbytes), ...]. One bucket exists at a time: the next is packed when the caller
    asks for it. Tensors on a device are copied to the host first, one at a time."""
    import numpy as np
    import torch

    group: list[tuple[str, Any]] = []
    size = 0
    for name, t in pairs + [("", None)]:
        n = 0 if t is None else t.numel() * t.element_size()
        if group and (t is None or size + n > bucket_bytes):
            index, off = [], 0
            for gname, g in group:
                index.append((gname, str(g.dtype).replace("torch.", ""), tuple(g.shape), off,
                              g.numel() * g.element_size()))
                off += -(-(g.numel() * g.element_size()) // ALIGN) * ALIGN
            data = np.empty(off, dtype=np.uint8)
            flat = torch.from_numpy(data)
            for (gname, g), (_, _, _, o, nb) in zip(group, index):
                if nb:
                    flat[o:o + nb].copy_(g.detach().contiguous().reshape(-1).view(torch.uint8))
            yield index, data
            del flat, data
            group, size = [], 0
        if t is not None:
            group.append((name, t))
            size += -(-n // ALIGN) * ALIGN


def copy_bucket(engine: Any, bucket: tuple[list, Any]) -> int:
    """Copy a bucket's tensors (`pack_buckets`) into `engine`'s model in place, straight from
    its bytes (a read-only view of the object store's copy); how many were copied."""
    import torch

    from engine.loading.weight_swap import copy_tensors

    index, data = bucket
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
        flat = torch.from_numpy(data)

    def tensors():
        for name, dtype, shape, off, nb in index:
            yield name, flat[off:off + nb].view(getattr(torch, dtype)).view(shape)

    return copy_tensors(engine.model, tensors())


def load_pool_weights(engine: Any, weights: PoolWeights | tuple) -> dict:
    """Bring a freshly loaded engine to a pool's weights: the checkpoint, then the buckets
    (fetched from the object store one at a time), then the pool's weight_version. Returns
    the engine's swap record ({"path", "step", "description", "weight_version"})."""
    if isinstance(weights, tuple):  # (path, step), as before PoolWeights
        weights = PoolWeights(version=1, path=weights[0], step=weights[1])
    out: dict = {}
    if weights.path is not None:
        out = engine.load_weights(weights.path, step=weights.step)
    if weights.buckets:
        import ray  # only in a worker that Ray started

        from engine.loading.weight_swap import MEMORY

        for ref in weights.buckets:
            copy_bucket(engine, ray.get(ref))
        engine.model.weights_changed()
        out = {"path": MEMORY, "step": None, "description": engine.model.info.description}
    return engine.weights_swapped(out.get("path"), out.get("step"), out.get("description"), weights.version)


__all__ = ["ALIGN", "PoolWeights", "copy_bucket", "load_pool_weights", "pack_buckets", "tensor_index"]
