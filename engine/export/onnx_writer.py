"""The ONNX file of a `KVExplicitForward`, and an onnxruntime session that runs it.

The exporter is torch.onnx's TorchScript-based one (`dynamo=False`): it names the dynamic axes
("batch", "seq", "past", "total") and exports SmolLM2 in seconds. The dynamo exporter
(`dynamo=True`, onnxscript) gives the same graph numerically but takes 25x longer on a tiny
model and names the axes s0, s1, ... (measured with torch 2.13, onnxscript 0.7).
onnx and onnxruntime are imported here only, when an export runs: engine/ does not need them.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from engine.export.kv_forward import KVExplicitForward

OPSET = 17


def example_inputs(fwd: KVExplicitForward, batch: int = 2, seq: int = 3, past: int = 4) -> tuple[torch.Tensor, ...]:
    """Inputs of the shapes one decode-with-past step has (past and seq above 1, so no axis
    is specialised to a size of 0 or 1 while tracing). Static: the step's positions within the
    N buffer positions (seq at most N, past at most N - seq; an N of 1 to 6 indexed past the
    buffer and failed the trace with an IndexError)."""
    info, dtype = fwd.model.info, fwd.model.kv_dtype
    static = fwd.static_max_len is not None
    if static:  # no past axis here: past only places the step's tokens (cache_position)
        seq = min(seq, fwd.static_max_len)
        past = min(past, fwd.static_max_len - seq)
    total = fwd.static_max_len if static else past + seq
    ids = torch.zeros(batch, seq, dtype=torch.long)
    mask = torch.ones(batch, total, dtype=torch.long)
    pos = torch.arange(past, past + seq).expand(batch, seq).contiguous()
    kv_len = fwd.static_max_len if static else past
    kv = [torch.zeros(batch, info.n_kv_head, kv_len, info.head_dim, dtype=dtype) for _ in range(2 * info.n_layer)]
    extra = [torch.arange(past, past + seq)] if static else []
    smear = [torch.zeros(batch, info.state_dims["smear"], dtype=fwd.model.act_dtype or dtype)] if fwd.has_smear else []
    return (ids, mask, pos, *extra, *kv, *smear)


def dynamic_axes(fwd: KVExplicitForward) -> dict[str, dict[int, str]]:
    """Which axes of each input and output are dynamic, by name."""
    static = fwd.static_max_len is not None
    axes = {"input_ids": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch"} if static else {0: "batch", 1: "total"},
            "logits": {0: "batch", 1: "seq"}}
    if static:
        axes["cache_position"] = {0: "seq"}
    for name in fwd.input_names():
        if name.startswith("past_key_values."):
            axes[name] = {0: "batch"} if static else {0: "batch", 2: "past"}
    for name in fwd.output_names():
        if name.startswith("present."):
            axes[name] = {0: "batch"} if static else {0: "batch", 2: "total"}
    if fwd.has_smear:
        axes["past_smear"] = axes["present_smear"] = {0: "batch"}
    return axes


def _rms_norm_symbolic(g, x, normalized_shape, weight, eps):
    """aten::rms_norm (nanochat's F.rms_norm), which the TorchScript exporter has no ONNX
    form for below opset 23: x / sqrt(mean(x^2, -1) + eps) (* weight), eps defaulting to the
    dtype's machine epsilon as torch's does."""
    from torch.onnx import symbolic_helper as sh

    eps_value = sh._maybe_get_const(eps, "f")
    if eps_value is None or sh._is_none(eps):
        eps_value = torch.finfo(torch.float32).eps
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=[-1], keepdims_i=1)
    eps_c = g.op("Constant", value_t=torch.tensor(eps_value, dtype=torch.float32))
    y = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, g.op("CastLike", eps_c, x))))
    return y if sh._is_none(weight) else g.op("Mul", y, weight)


def write_onnx(fwd: KVExplicitForward, path: Path) -> None:
    """Export `fwd` to `path` (model.onnx; weights inside the file below 2 GB, beside it above)."""
    torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, OPSET)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings about Python ints of shapes, which are traced as shapes
        torch.onnx.export(fwd.eval(), example_inputs(fwd), str(path), dynamo=False, opset_version=OPSET,
                          input_names=fwd.input_names(), output_names=fwd.output_names(),
                          dynamic_axes=dynamic_axes(fwd), do_constant_folding=True)


def onnx_runner(path: Path, threads: int | None = None):
    """An onnxruntime session (CPU provider) on `path` as a verify runner: {input name: array}
    -> {output name: array}; inputs the graph does not take are ignored."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    in_names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(out_names, sess.run(out_names, {n: feed[n] for n in in_names})))

    run.session = sess
    return run
