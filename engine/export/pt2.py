"""`--format pt2`: the static-shape variant as a `torch.export` program compiled and packaged by
AOTInductor (`torch._inductor.aoti_compile_and_package`): a .pt2 file that
`torch._inductor.aoti_load_package(path)` loads and runs without batchgen (C++ too, through
torch's AOTIModelPackageLoader).

The program is `KVExplicitForward` with `static_max_len` (engine/export/kv_forward.py): inputs
input_ids (batch, seq), attention_mask (batch, N), position_ids (batch, seq), cache_position
(seq,), the 2 x layers KV buffers (batch, num_kv_heads, N, head_dim) (and nanochat's past_smear);
outputs logits and the buffers with the step's keys and values written at cache_position.
batch and seq are dynamic (1 .. N); N is fixed, so one compiled kernel set serves every
position. Compiling runs a C++ compiler: about a minute for a tiny model on 2 cores.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.export.kv_forward import KVExplicitForward
from engine.export.onnx_writer import example_inputs


def write_pt2(fwd: KVExplicitForward, path: Path) -> None:
    """torch.export + AOTInductor package of `fwd` (a static KVExplicitForward) at `path`."""
    from torch.export import Dim

    N = fwd.static_max_len
    assert N is not None, "pt2 is the static variant"
    args = example_inputs(fwd, batch=2, seq=3, past=4)
    # an N of 1 has one step length (a Dim of min = max is refused: "inconsistent min=1, max=1")
    batch, seq = Dim("batch", min=1, max=1024), (Dim("seq", min=1, max=N) if N > 1 else Dim.STATIC)
    n_kv = 2 * fwd.model.info.n_layer + (1 if fwd.has_smear else 0)
    shapes = ({0: batch, 1: seq}, {0: batch}, {0: batch, 1: seq},
              tuple([{0: seq}] + [{0: batch}] * n_kv))
    with torch.no_grad():
        program = torch.export.export(fwd.eval(), args, dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def pt2_runner(path: Path, names: tuple[list[str], list[str]] | None = None, fwd: KVExplicitForward | None = None):
    """The package at `path` loaded with `aoti_load_package`, as a verify runner ({input name:
    array} -> {output name: array}); names: (input names, output names), else `fwd`'s."""
    loaded = torch._inductor.aoti_load_package(str(path))
    in_names, out_names = names if names is not None else (fwd.input_names(), fwd.output_names())

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            outs = loaded(*[torch.from_numpy(np.ascontiguousarray(feed[n])) for n in in_names])
        return {n: o.numpy() for n, o in zip(out_names, outs)}

    return run
