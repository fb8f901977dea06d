"""Weights from memory as buckets: a trainer's tensors grouped into a few large buffers for
Ray's object store, and applied to an engine straight from them.

    index = tensor_index(pairs)                      # [(name, dtype, shape), ...]: what workers check first
    for bucket in pack_buckets(pairs, 512 << 20):    # (index, a flat uint8 view per tensor), one at a time
        ref = ray.put(bucket)                        # one buffer in the store; every worker on a node reads it
    copy_bucket(engine, ray.get(ref))                # in a worker: each tensor into its place, in place

The layout follows slime's flattened-bucket weight updates: a bucket is one contiguous
buffer in the object store (Ray writes numpy buffers out of band, one after another) and a
small index of name, dtype and shape, so it is one object (no per-tensor overhead), written
once straight from the trainer's tensors (no packing copy in the driver) and read by the
workers without a copy. cluster/weight_sync.py moves the buckets, cluster/worker.py applies
them; Ray is imported only where a worker fetches a pool's kept buckets (`load_pool_weights`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator


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


def pack_buckets(pairs: list[tuple[str, Any]], bucket_bytes: int) -> Iterator[tuple[list, list]]:
    """The tensors of `pairs` in buckets of about `bucket_bytes` (a larger tensor has one of
    its own): each (index, data), index [(name, dtype name, shape), ...] and data the
    tensors' bytes, one flat uint8 numpy view per tensor (no copy of a contiguous CPU
    tensor). `ray.put` of a bucket writes all its views, out of band, into one contiguous
    buffer of the object store (one copy, 64-byte aligned each), which a worker reads back
    as views again. One bucket is made at a time, when the caller asks for it; a tensor on
    a device (or not contiguous) is copied to the host as its bucket is made."""
    group: list[tuple[str, Any]] = []
    size = 0
    for name, t in pairs:
        n = t.numel() * t.element_size()
        if group and size + n > bucket_bytes:
            yield _bucket(group)
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield _bucket(group)


def _bucket(group: list[tuple[str, Any]]) -> tuple[list, list]:
    import torch

    index, data = [], []
    for name, t in group:
        t = t.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
        index.append((name, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        data.append(t.reshape(-1).view(torch.uint8).numpy())
    return index, data


def copy_bucket(engine: Any, bucket: tuple[list, list]) -> int:
    """Copy a bucket's tensors (`pack_buckets`) into `engine`'s model in place, straight from
    its bytes (read-only views of the object store's copy); how many were copied."""
    import torch

    from engine.loading.weight_swap import copy_tensors

    index, data = bucket

    def tensors():
        for (name, dtype, shape), raw in zip(index, data):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
                flat = torch.from_numpy(raw)
            yield name, flat.view(getattr(torch, dtype)).view(shape)

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


__all__ = ["PoolWeights", "copy_bucket", "load_pool_weights", "pack_buckets", "tensor_index"]
