"""A checkpoint's weight files read one tensor at a time (a weights swap's bounded memory).

    files = TensorFiles([Path("ckpt/model.safetensors")])
    files.meta()            # {name: tensor on the meta device}: names, shapes, dtypes; no data read
    for name, t in files:   # one tensor in memory at a time
        ...

safetensors files are opened with `safe_open` (memory-mapped; a tensor is copied out when
read); torch files (pytorch_model.bin, nanochat's model_<step>.pt) are loaded with
`mmap=True` (their storages stay in the file's pages until touched) and `weights_only=True`
(no pickled code runs); a torch file of the legacy, non-zip format cannot be memory-mapped
and is read whole.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from engine.loading.errors import CheckpointError

# safetensors dtype names -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def read_file(f: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of one weight file, on CPU in its stored dtype. mmap: torch files stay
    memory-mapped (safetensors files are always read whole here). Raises CheckpointError
    naming the file for an unreadable file or one that is not a state dict."""
    try:
        if f.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            part = load_file(str(f), device="cpu")
        else:
            try:
                part = torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                part = torch.load(f, map_location="cpu", weights_only=True)  # legacy format: no mmap
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt/truncated file of either format
        raise CheckpointError(f"{f}: cannot read weights ({type(e).__name__}: {e})") from None
    if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
        raise CheckpointError(f"{f}: expected a state dict (name -> tensor), got {type(part).__name__}")
    return part


class TensorFiles:
    """The tensors of `files` (see the module docstring), names as stored."""

    def __init__(self, files: list[Path]):
        self.files = [Path(f) for f in files]

    def meta(self) -> dict[str, torch.Tensor]:
        """name -> an empty tensor on the meta device with the stored shape and dtype, from the
        files' headers (safetensors) or their memory-mapped storages (torch): nothing is read
        but the headers. Raises CheckpointError naming an unreadable file."""
        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            if f.name.endswith(".safetensors"):
                try:
                    from safetensors import safe_open

                    with safe_open(str(f), framework="pt", device="cpu") as h:
                        for k in h.keys():
                            sl = h.get_slice(k)
                            dt = _ST_DTYPES.get(sl.get_dtype())
                            if dt is None:
                                raise CheckpointError(f"{f}: tensor {k} has dtype {sl.get_dtype()}, which torch "
                                                      f"cannot hold")
                            out[k] = torch.empty(sl.get_shape(), dtype=dt, device="meta")
                except CheckpointError:
                    raise
                except Exception as e:  # noqa: BLE001 - a corrupt/truncated header
                    raise CheckpointError(f"{f}: cannot read weights ({type(e).__name__}: {e})") from None
            else:
                part = read_file(f, mmap=True)
                out.update({k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in part.items()})
                del part
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor on CPU in its stored dtype), file by file, one tensor copied out of a
        safetensors file at a time (torch files: views of their memory-mapped storages)."""
        for f in self.files:
            if f.name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(f), framework="pt", device="cpu") as h:
                    for k in h.keys():
                        yield k, h.get_tensor(k)
            else:
                part = read_file(f, mmap=True)
                while part:
                    yield part.popitem()
                del part


__all__ = ["TensorFiles", "read_file"]
