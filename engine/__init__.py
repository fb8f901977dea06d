"""batchgen's inference engine: prefill once, sample many, on token ids.

    from engine import load_engine, SamplingParams
    eng = load_engine("smollm2")                   # or a checkpoint directory, a .gguf file, "tiny-random"
    results = eng.generate([[1, 2, 3]], SamplingParams(num_samples=4, max_tokens=32))
    results[0][0].tokens, results[0][0].mask, results[0][0].logprobs

Single-process and framework-free: no Ray, no Parquet (those live in cluster/ and jobs/).
"""
from engine.params import RequestOutput, Sample, SamplingParams, ToolCall, error_output

__all__ = ["Engine", "load_engine", "SamplingParams", "Sample", "ToolCall", "RequestOutput", "error_output",
           "Tokenizer"]


def __getattr__(name: str):
    # Engine and load_engine import torch; loading them lazily keeps `import engine.params`
    # (used by jobs/ for the config rules and result types) light for the CLI's status/verify/prepare.
    if name in ("Engine", "load_engine"):
        from engine import engine as _engine

        return getattr(_engine, name)
    if name == "export":  # engine.export(...): engine/export/, a callable package (imports torch when called)
        import importlib

        return importlib.import_module("engine.export")
    if name == "Tokenizer":  # the interface (engine/tokenizers/base.py): Tokenizer.load(path)
        from engine.tokenizers.base import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
