"""Checkpoints for the weight-swap tests: tiny nanochat directories in nanochat's own layout
(model_<step>.pt + meta_<step>.json, from tests/fixtures/nanochat) and a byte-level
tokenizer.pkl; all load in milliseconds.

- base:        the 2026 fixture (92d63d4: windows, value embeddings, smear, backout), with tokenizer.pkl
- trained:     the same architecture, every weight moved (as a trainer's next checkpoint would be),
               written without a tokenizer (a trainer saves weights)
- other_config: base's weights, but meta's window_pattern "L" instead of "SSSL": same tensor shapes,
               another architecture
- other_shapes: another fixture (aa530cd: no windows, value embeddings or smear; other tensors)
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "nanochat"
BASE = FIXTURES / "nanochat_2026jul_92d63d4"
OTHER = FIXTURES / "nanochat_2026jan_aa530cd"
STEP = 650


def byte_tokenizer(path: Path) -> Path:
    """A tokenizer.pkl with 256 byte tokens and nanochat's specials (vocab 265 <= the fixtures' 300)."""
    import tiktoken

    from toy import SPECIALS

    enc = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={s: 256 + i for i, s in enumerate(SPECIALS)})
    with open(path, "wb") as f:
        pickle.dump(enc, f)
    return path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.startswith(("model_", "meta_")):
            shutil.copy(f, dst / f.name)
    return dst


def moved(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor times (1 + 0.3 N(0, 1)), in its own dtype."""
    g = torch.Generator().manual_seed(seed)
    return {k: (t.float() * (1 + 0.3 * torch.randn(t.shape, generator=g))).to(t.dtype) for k, t in sd.items()}


def build(root: Path) -> dict[str, Path]:
    """The four checkpoints under `root`, and "tokenizer": the tokenizer.pkl inside base."""
    base = _copy(BASE, root / "base")
    tok = byte_tokenizer(base / "tokenizer.pkl")
    trained = _copy(BASE, root / "trained")
    model = trained / f"model_{STEP:06d}.pt"
    torch.save(moved(torch.load(model, weights_only=True), seed=1), model)
    other_config = _copy(BASE, root / "other_config")
    meta = other_config / f"meta_{STEP:06d}.json"
    m = json.loads(meta.read_text())
    m["model_config"]["window_pattern"] = "L"
    meta.write_text(json.dumps(m))
    other_shapes = _copy(OTHER, root / "other_shapes")
    return {"base": base, "trained": trained, "other_config": other_config, "other_shapes": other_shapes,
            "tokenizer": tok}
