"""Llama 3's rope scaling, recovered from the `rope_freqs.weight` tensor of a llama GGUF file.

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors) turns a
`llama3` rope_scaling {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
into one divisor per rotary frequency and stores only those (head_dim/2 float32 values);
llama.cpp divides frequency i, rope_theta^(-2i/head_dim), by entry i. transformers' `llama3`
rope (modeling_rope_utils._compute_llama3_parameters) computes the same quotients from the
four parameters. `llama3_rope_scaling` finds parameters that reproduce a file's divisors, so
a model built from the config rotates exactly as llama.cpp does.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from engine.loading.errors import CheckpointError

# What llama.cpp's converter assumes when a llama3 rope_scaling omits them (Llama 3.1's and
# 3.2's values).
ORIGINAL_CONTEXT = 8192
DEFAULT_FREQ_FACTORS = (1.0, 4.0)  # low_freq_factor, high_freq_factor
_RTOL = 1e-5  # the divisors are float32; a parameter set must reproduce them this closely


def llama3_factors(rope_theta: float, head_dim: int, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The (head_dim/2,) float64 divisors for a `llama3` rope scaling, as the converter computes
    them: 1 for wavelengths under original/high_freq_factor, `factor` over original/low_freq_factor,
    1 / ((1 - s)/factor + s) between, s = (original/wavelength - low) / (high - low)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor,
                   1.0 / ((1.0 - smooth) / factor + smooth))
    return np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0, out)


def llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int, where: Path | str = "") -> dict:
    """The `llama3` rope_scaling (transformers' dict) whose divisors equal `factors`.

    factors: the (head_dim/2,) rope_freqs.weight values. `factor` is their largest entry. In
    x = original / wavelength, each entry lies in the low band (x < low_freq_factor: `factor`),
    the high band (x > high_freq_factor: 1) or between, where s is linear in x; only the two
    band edges in x matter, so original_max_position_embeddings is pinned to 8192 and the
    edges are found as, in order: llama.cpp's defaults (1, 4); a line fitted through the
    blended entries (two or more); else edges placed inside the gaps the entries leave. The
    first set that reproduces every entry to 1e-5 relative is returned.
    Raises CheckpointError naming rope_freqs.weight when no set does (not a llama3 scaling).
    """
    n = head_dim // 2
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != n or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise CheckpointError(f"{where}: tensor rope_freqs.weight must hold {n} (head_dim / 2) positive "
                              f"factors, got {f.shape[0]}")
    factor = float(str(np.float32(f.max())))  # the float32 entry as its shortest decimal
    x = ORIGINAL_CONTEXT / (2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    high_band = np.abs(f - 1.0) <= _RTOL
    low_band = np.abs(f - factor) <= _RTOL * factor
    blended = ~high_band & ~low_band
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor) if factor > 1.0 else np.zeros_like(f)

    candidates = [DEFAULT_FREQ_FACTORS]
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(x[blended], s[blended], 1)  # s = (x - low) / (high - low)
        if slope > 0:
            low = -intercept / slope
            candidates += [(round(low, 4), round(low + 1.0 / slope, 4)), (low, low + 1.0 / slope)]
    lo = float(x[low_band & ~high_band].max(initial=0.0))  # low edge above every low-band x
    hi = float(x[high_band & ~low_band].min(initial=math.inf))  # high edge below every high-band x
    if blended.sum() == 1:
        xb, sb = float(x[blended][0]), float(s[blended][0])
        width = min((xb - lo) / sb if sb > 0 else math.inf, (hi - xb) / (1 - sb) if sb < 1 else math.inf)
        width = width / 2 if math.isfinite(width) else xb
        candidates.append((xb - sb * width, xb - sb * width + width))
    elif blended.sum() == 0:
        if math.isinf(hi):
            hi = 3 * lo if lo > 0 else 3.0
        candidates.append((lo + (hi - lo) / 3, lo + 2 * (hi - lo) / 3))

    for low, high in candidates:
        if not 0 < low < high:
            continue
        rebuilt = llama3_factors(rope_theta, head_dim, factor, low, high, ORIGINAL_CONTEXT)
        if np.all(np.abs(rebuilt - f) <= _RTOL * f):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                    "high_freq_factor": float(high), "original_max_position_embeddings": ORIGINAL_CONTEXT}
    raise CheckpointError(f"{where}: tensor rope_freqs.weight is not a llama3 rope scaling (no factor, "
                          f"low_freq_factor and high_freq_factor reproduce its {n} entries); other per-frequency "
                          f"rope factors are not supported")
