"""Export a model batchgen loads with its KV cache as explicit inputs and outputs (ONNX for
onnxruntime and onnxruntime-genai; a static-shape AOTInductor package), verified against the
engine:

    import engine
    engine.export("smollm2", "out/smollm2-onnx", verify=True)     # the module is callable
    from engine.export import export                               # the same function

Files: kv_forward.py (the forward an artifact runs, from engine/models' own layers),
onnx_writer.py (torch.onnx, onnxruntime), pt2.py (torch.export, AOTInductor), verify.py (the
greedy loop against the engine), artifacts.py (tokenizer, genai_config.json,
batchgen_export.json), exporter.py (`export`: options, the temporary directory, the rename).
onnx, onnxruntime and AOTInductor are imported only while an export runs.
"""
import sys
import types

from engine.export.errors import ExportError, VerificationError


def export(*args, **kwargs):
    """engine/export/exporter.py `export` (imported when called: it loads torch)."""
    from engine.export.exporter import export as _export

    return _export(*args, **kwargs)


class _CallableModule(types.ModuleType):
    """`engine.export(...)` is `engine.export.export(...)`: the issue's and the README's spelling,
    without a function shadowing this package."""

    def __call__(self, *args, **kwargs):
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["export", "ExportError", "VerificationError"]
