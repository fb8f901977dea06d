"""Reading a Hugging Face checkpoint directory: config.json, generation_config.json and the
weights (model.safetensors, pytorch_model.bin, or either sharded with a *.index.json), as
transformers' save_pretrained writes them. Shared by the GPT-2 and Llama-family loaders.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.loading.errors import CheckpointError


def read_json(path: Path, required: bool = True) -> dict | None:
    """The JSON object in `path`; None when the file is absent and not `required`.

    Raises FileNotFoundError (required and absent), CheckpointError naming the file for
    invalid JSON or a value that is not an object.
    """
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} does not exist (a Hugging Face checkpoint directory needs it)")
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def weight_files(directory: Path) -> tuple[list[Path], str]:
    """The weight files of a checkpoint directory, and a description of them for error
    messages: model.safetensors, else the files a shard index (model.safetensors.index.json
    or pytorch_model.bin.index.json: its weight_map) names, else pytorch_model.bin.
    Raises FileNotFoundError for no weights or a missing shard, CheckpointError naming an
    unreadable index."""
    st, pt = directory / "model.safetensors", directory / "pytorch_model.bin"
    st_idx, pt_idx = directory / "model.safetensors.index.json", directory / "pytorch_model.bin.index.json"
    if st.is_file():
        files = [st]
    elif st_idx.is_file() or pt_idx.is_file():
        idx = st_idx if st_idx.is_file() else pt_idx
        # read_json names the file for bytes that are not UTF-8 JSON; an empty or malformed
        # weight_map is refused here, so that no shard list is empty (`where` names files[0])
        weight_map = read_json(idx).get("weight_map")
        if (not isinstance(weight_map, dict) or not weight_map
                or not all(isinstance(f, str) and f for f in weight_map.values())):
            raise CheckpointError(f"{idx}: not a shard index: weight_map must be a non-empty object of tensor "
                                  f"name -> shard file name, got {str(weight_map)[:100]!r}")
        files = [directory / f for f in sorted(set(weight_map.values()))]
    elif pt.is_file():
        files = [pt]
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin (or a *.index.json) "
                                f"beside config.json")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} (listed in the shard index) does not exist")
    where = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"
    return files, where


def read_state_dict(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a checkpoint directory (`weight_files`), on CPU in their stored dtype,
    and a description of the file(s) they came from, for error messages. pytorch_model.bin
    is read with weights_only=True: no pickled code runs.
    Raises FileNotFoundError for no weights or a missing shard, CheckpointError naming the
    file for an unreadable file or index.
    """
    from engine.loading.tensor_files import read_file

    files, where = weight_files(directory)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(read_file(f, mmap=True))
    return sd, where
