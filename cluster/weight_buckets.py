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
them; Ray is imported only where a new worker fetches a live worker's weights
(`load_pool_weights`, from `export_bucket`: after an update from memory, the live workers
are the only holders of the pool's weights, so nothing is kept for later).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True, slots=True)
class PoolWeights:
    """The weights a pool's workers hold, for a worker started now: the checkpoint of the
    last load_weights (path, step; None: the task's), whether an update_weights came since
    (`from_memory`: then a new worker copies the weights from a live one, `peers`, which
    the dispatcher fills in as it starts the worker), and the pool's count of swaps."""

    version: int
    path: str | None = None
    step: int | None = None
    from_memory: bool = False
    peers: tuple = ()


def tensor_index(pairs: list[tuple[str, Any]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of each (name, tensor), as the workers check them. Raises
    TypeError naming an entry that is not (str, torch.Tensor), or a tensor without data to
    send (on the meta device, sparse): refused here, before any worker is asked, not when
    its bucket is packed (which failed the driver in the middle and replaced every worker)."""
    from engine.loading.weight_swap import tensor_pairs

    return [_entry(*item) for item in tensor_pairs(pairs)]


def _entry(name: str, t: Any) -> tuple[str, str, tuple[int, ...]]:
    """(name, dtype name, shape) of one tensor: a bucket index's entry."""
    return name, str(t.dtype).replace("torch.", ""), tuple(t.shape)


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
        index.append(_entry(name, t))
        data.append(t.reshape(-1).view(torch.uint8).numpy())
    return index, data


def copy_bucket(engine: Any, bucket: tuple[list, list], *, own_names: bool = False, wmap: Any = None) -> int:
    """Copy a bucket's tensors (`pack_buckets`) into `engine`'s model in place, straight from
    its bytes (read-only views of the object store's copy); how many were copied.
    own_names: the bucket holds the model's own state-dict names (`export_bucket`), not a
    trainer's. wmap: the update's weight map, one for all its buckets
    (engine.loading.checkpoint.copy_tensors)."""
    import torch

    from engine.loading.weight_swap import copy_tensors

    index, data = bucket

    def tensors():
        for (name, dtype, shape), raw in zip(index, data):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only read here
                flat = torch.from_numpy(raw)
            yield name, flat.view(getattr(torch, dtype)).view(shape)

    if not own_names:
        return copy_tensors(engine.model, tensors(), wmap)
    params = engine.model.state_dict(keep_vars=True)
    with torch.no_grad():
        n = 0
        for name, t in tensors():
            params[name].copy_(t)
            n += 1
    return n


def export_bucket(engine: Any, number: int, bucket_bytes: int) -> tuple[list, list] | None:
    """Bucket `number` (0, 1, ...) of `engine`'s model as it is now, under the model's own
    state-dict names (a tied tensor once), for a new worker to copy (`load_pool_weights`);
    None past the last. Views of the parameters, no copy: Ray copies them into the store."""
    seen: set[int] = set()
    pairs = []
    for name, t in engine.model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            pairs.append((name, t))
    for i, bucket in enumerate(pack_buckets(pairs, bucket_bytes)):
        if i == number:
            return bucket
    return None


PEER_BUCKET_BYTES = 256 << 20  # bucket size when a new worker copies a live one's weights


def load_pool_weights(engine: Any, weights: PoolWeights | tuple) -> dict:
    """Bring a freshly loaded engine to a pool's weights: the checkpoint, then (after an
    update from memory) a live worker's weights, bucket by bucket through the object store
    (the first of `weights.peers` that answers), then the pool's weight_version. Returns
    the engine's swap record ({"path", "step", "description", "weight_version"}). Raises
    RuntimeError when no peer could send its weights."""
    if isinstance(weights, tuple):  # (path, step), as before PoolWeights
        weights = PoolWeights(version=1, path=weights[0], step=weights[1])
    out: dict = {}
    if weights.path is not None:
        out = engine.load_weights(weights.path, step=weights.step)
    if weights.from_memory:
        import ray  # only in a worker that Ray started

        from engine.loading.weight_swap import MEMORY

        errors = []
        for peer in weights.peers:
            try:
                number = 0
                while (bucket := ray.get(peer.export_weights.remote(number, PEER_BUCKET_BYTES))) is not None:
                    copy_bucket(engine, bucket, own_names=True)
                    number += 1
                break
            except Exception as exc:  # noqa: BLE001 - a peer gone meanwhile: the next one sends everything
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        else:
            raise RuntimeError(f"no live worker could send the pool's weights (update {weights.version}): "
                               + ("; ".join(errors) or "no peer"))
        engine.model.weights_changed()
        out = {"path": MEMORY, "step": None, "description": engine.model.info.description}
    return engine.weights_swapped(out.get("path"), out.get("step"), out.get("description"), weights.version)


__all__ = ["PoolWeights", "copy_bucket", "export_bucket", "load_pool_weights", "pack_buckets", "tensor_index"]
