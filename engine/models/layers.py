"""What the Llama family (Llama, Mistral, Qwen2, Qwen3) shares: RMSNorm, rotary position
embeddings with their scaling types, and the SwiGLU MLP.

The numerics follow transformers (models/llama/modeling_llama.py, modeling_rope_utils.py):
the same float32 operations in the same order, so that logits agree to float rounding.

In a CPU float32 step each operation has a fused version in the compiled library
(engine/kernels/csrc/layer_ops.cpp, `kernels` below: a `NativeKernels`, or None for torch's ops):
one pass per row instead of 3-10 torch kernels, batch-invariant, within about 1e-7 of torch's.
The reference forward passes None, so it computes what transformers computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.native import NativeKernels
from engine.models.base import CausalLM, invariant_silu

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim (Zhang & Sennrich 2019; transformers' LlamaRMSNorm):
    weight * (x / sqrt(mean(x^2) + eps)), computed in float32 and cast back to x's dtype
    before the weight multiplies it. x (..., C), weight (C,) -> (..., C)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 kernels: NativeKernels | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (x + delta, rms_norm(x + delta)), or (x,
    rms_norm(x)) when delta is None. x, delta (..., C), weight (C,)."""
    if kernels is None:
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)
    return kernels.add_rms_norm(x.contiguous(), None if delta is None else delta.contiguous(), weight, eps,
                                torch.get_num_threads())


# ---------------------------------------------------------------------- rotary embeddings
@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary embedding parameters, as transformers 5's `rope_parameters` holds them.

    rope_type: "default" (RoFormer, Su et al. 2021), "linear" (position interpolation,
        Chen et al. 2023), "llama3" (Meta's Llama 3.1 frequency smoothing) or "yarn"
        (Peng et al. 2023, arXiv:2309.00071).
    rope_theta: the base wavelength. factor: the context extension ratio (linear, llama3,
        yarn). original_max_position_embeddings: the pre-extension context (llama3, yarn).
    low_freq_factor, high_freq_factor: llama3's band edges. attention_factor, beta_fast,
        beta_slow, mscale, mscale_all_dim, truncate: yarn's (None = transformers' default).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def inv_freq(self, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies (head_dim/2,) float32 on CPU, attention scaling), where the
        scaling multiplies cos and sin (yarn's mscale; 1.0 for the others). The same float32
        operations as transformers' _compute_*_parameters, so the tables agree bit for bit."""
        dim, base = head_dim, self.rope_theta
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        if self.rope_type == "yarn":
            return self._yarn(dim, exponents, max_position_embeddings)
        inv_freq = 1.0 / (base ** exponents)
        if self.rope_type == "linear":
            inv_freq /= self.factor
        elif self.rope_type == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq, 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Wavelengths longer than original_max / low_freq_factor are slowed down by `factor`,
        # shorter than original_max / high_freq_factor kept; in between, a linear blend.
        factor, lo, hi = self.factor, self.low_freq_factor, self.high_freq_factor
        old_len = self.original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn(self, dim: int, exponents: torch.Tensor, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        # YaRN: interpolate the low frequencies by `factor`, keep (extrapolate) the high ones,
        # with a linear ramp between the dimensions that rotate beta_fast and beta_slow times
        # over the original context; cos and sin are scaled by the attention factor (mscale).
        base, orig = self.rope_theta, self.original_max_position_embeddings
        factor = self.factor if self.factor is not None else max_position_embeddings / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = float(mscale(factor, self.mscale) / mscale(factor, self.mscale_all_dim))
            else:
                attention = mscale(factor)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** exponents
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extra_weight = 1 - ramp
        return interpolation * (1 - extra_weight) + extrapolation * extra_weight, attention


class RotaryTables:
    """cos and sin of position * inv_freq, (positions, head_dim/2) in the compute dtype, times
    the attention scaling (yarn), as transformers' LlamaRotaryEmbedding computes them.

    Built lazily in chunks of CHUNK positions up to max_positions, each chunk once: a
    position's value never depends on how far the table has grown (batch invariance).
    """

    CHUNK = 1024

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scaling, self.max_positions, self.dtype = scaling, max_positions, dtype
        half = inv_freq.shape[0]
        self.cos = torch.empty(0, half, dtype=dtype, device=device)
        self.sin = torch.empty(0, half, dtype=dtype, device=device)

    def ensure(self, n: int) -> None:
        """Make positions [0, n) available. Raises ValueError past max_positions."""
        if n > self.max_positions:
            raise ValueError(f"position {n - 1} is beyond the model's context of {self.max_positions} tokens")
        while self.cos.shape[0] < n:
            start = self.cos.shape[0]
            pos = torch.arange(start, min(start + self.CHUNK, self.max_positions), device=self.inv_freq.device)
            freqs = pos[:, None].float() * self.inv_freq[None, :]
            self.cos = torch.cat([self.cos, (freqs.cos() * self.scaling).to(self.dtype)])
            self.sin = torch.cat([self.sin, (freqs.sin() * self.scaling).to(self.dtype)])

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions` (B, T) int64 -> each (B, T, 1, head_dim/2), broadcasting over
        heads of a (B, T, H, D) tensor. max_position: the largest of `positions`, as a host int
        (no device sync)."""
        self.ensure(max_position + 1)
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


class RotaryStep:
    """The rotary embedding of one forward's positions, for every layer of it.

    tables: the model's RotaryTables; positions (B, T) int64; max_position: their largest
    value as a host int (no device sync; checked against the positions when the compiled
    kernel will index the tables with them). kernels: the compiled library (the tables are
    indexed in the kernel) or None (cos and sin are gathered once here, as transformers does).
    Raises ValueError past the model's context.
    """

    def __init__(self, tables: RotaryTables, positions: torch.Tensor, max_position: int,
                 kernels: NativeKernels | None):
        tables.ensure(max_position + 1)
        self.tables, self.kernels = tables, kernels
        if kernels is None:
            self.cos, self.sin = tables.lookup(positions, max_position)
        else:
            self.positions = positions.reshape(-1).contiguous()
            if self.positions.numel() and not 0 <= int(self.positions.min()) <= int(self.positions.max()) <= max_position:
                raise ValueError(f"RotaryStep: positions outside [0, {max_position}]")
            self.threads = torch.get_num_threads()

    def rotate(self, x: torch.Tensor, heads: int, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The first `heads` heads of x (B, T, H, D), each RMS-normed with norm_weight (heads,
        D) first when given (Qwen3's q/k norm), then rotated: (B, T, heads, D). With the
        compiled kernel x is rotated in place (its last two dims contiguous) and the result
        is a view of it."""
        if self.kernels is None:
            qk = x[:, :, :heads]
            if norm_weight is not None:
                qk = rms_norm(qk, norm_weight, eps)
            return apply_rotary(qk, self.cos, self.sin)
        B, T, H, D = x.shape
        self.kernels.rotary(x.view(B * T, H, D), heads, self.tables.cos, self.tables.sin, self.positions,
                            norm_weight, eps, self.threads)
        return x[:, :, :heads]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., D) in transformers' half-split convention (`rotate_half`): the pairs are
    (x[i], x[i + D/2]). cos, sin (..., D/2) broadcast against x[..., :D/2].

    x * cat(cos, cos) + rotate_half(x) * cat(sin, sin) in transformers; the same products and
    sums here (a + (-b) equals a - b exactly), without building the doubled tables.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


# ---------------------------------------------------------------------- MLP
def swiglu(model: CausalLM, x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None,
           down: torch.Tensor, down_bias: torch.Tensor | None, kernels: NativeKernels | None = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer"), with
    gate and up fused in one projection: x (..., C), gate_up (2I, C) = cat(gate, up),
    down (C, I) -> (..., C). Projections through `model.linear`; silu(gate) * up in one
    compiled pass with `kernels`, else silu through `model.pointwise` (length-invariant in a
    CPU step: models/base.py)."""
    gu = model.linear(x, gate_up, gate_up_bias)
    if kernels is not None:
        return model.linear(kernels.silu_mul(gu.contiguous(), torch.get_num_threads()), down, down_bias)
    gate, up = gu.chunk(2, dim=-1)
    return model.linear(model.pointwise(F.silu, invariant_silu, gate) * up, down, down_bias)
