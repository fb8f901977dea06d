"""nanochat's GPT (github.com/karpathy/nanochat, nanochat/gpt.py) for inference, with parity:
the forward pass (engine/loading/nanochat.py reads a checkpoint and detects its features).

One implementation covers the architecture generations from late 2025 (16788ee) to mid 2026
(92d63d4). What a checkpoint uses is read from the checkpoint itself, feature by feature,
never from a two-way "old/new" switch:

Features with keys of their own (their presence in the state dict turns them on):
- resid_lambdas / x0_lambdas (aa530cd): x = resid_lambdas[i] * x + x0_lambdas[i] * x0 before
  each block. A missing one is patched to 1 / 0 as nanochat's _patch_missing_keys does; that
  makes the expression exactly x, so it is skipped.
- value_embeds.<i> + h.<i>.attn.ve_gate (e85db6b, alternating layers, last layer always):
  v += gate_scale * sigmoid(ve_gate(x[..., :C])) * value_embed(tokens). C is the width of
  ve_gate's weight (32 in e85db6b, 12 from 6ed7d1d); gate_scale is 2 in e85db6b's design and
  3 from 6ed7d1d (same commit as the 32 -> 12 change, so tied to the same evidence).
- smear_gate / smear_lambda and backout_lambda (a825e63).

Features without a key (rules in engine/loading/nanochat.py, each with its commit):
- padded vocabulary (f1bf69d): wte has ceil(vocab_size / 64) * 64 rows; logits are cropped.
- window_pattern (fbc1484): from meta's model_config, missing => "L" (nanochat's
  _patch_missing_config_keys); the short window changed over time (L//2, then ceil(L/3/128)*128
  in 6ed7d1d, then ceil(L/4/128)*128 in a825e63).
- rotary base 100000 and rotary tables in the compute dtype (6ed7d1d / 1076f97; before them
  base 10000 and tables rounded to bfloat16 even in an fp32 model).
- q, k *= 1.15 after QK norm (6ed7d1d), *= 1.2 from a825e63.

dtype: float32 reproduces nanochat with COMPUTE_DTYPE=float32 (its CPU path) exactly;
bfloat16 reproduces COMPUTE_DTYPE=bfloat16 (Linear weights, embeddings and activations in
bf16, per-layer scalars kept fp32 and applied as 0-dim tensors, logits in fp32). Checkpoints
from the autocast era (before 1076f97) in bf16 are approximate, as autocast's choices differ.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM, ModelInfo, invariant_sigmoid, reference_numerics

SOFTCAP = 15.0  # nanochat's logit softcap (engine/loading/nanochat.py: the one exception)
SMEAR_CHANNELS = 24  # a825e63: smear_gate reads the first 24 channels (also its weight's width)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """nanochat's parameter-free RMSNorm (F.rms_norm, default eps)."""
    return F.rms_norm(x, (x.size(-1),))


def has_value_embeds(layer: int, n_layer: int) -> bool:
    """Value-embedding layers (e85db6b): alternating, the last layer always included."""
    return layer % 2 == (n_layer - 1) % 2


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, T, H, D) in nanochat's half-split convention (rotates by -theta).

    cos/sin broadcast as (B or 1, T, 1, D/2) and may be bf16 tables for an fp32 x (the 2025
    models): the products then promote to x's dtype, as in nanochat, and the result is cast back.
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    first = a * cos + b * sin
    second = a * (-sin) + b * cos
    return torch.cat([first, second], 3).to(x.dtype)


@dataclass(frozen=True)
class NanochatConfig:
    """Shape (meta's model_config) plus the detected features of one checkpoint."""

    sequence_len: int
    vocab_size: int
    padded_vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    window_pattern: str = "L"
    short_window_rule: str = "quarter128"  # "half" (fbc1484), "third128" (6ed7d1d), "quarter128" (a825e63)
    resid_lambdas: bool = False
    value_embeds: bool = False
    ve_gate_channels: int = 12
    ve_gate_scale: int = 3
    smear: bool = False
    backout: bool = False
    qk_scale: float | None = None  # 1.15 from 6ed7d1d, 1.2 from a825e63, None = no scaling
    rotary_base: int = 10000
    rotary_bf16_tables: bool = True
    softcap: float = SOFTCAP

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def window_sizes(self) -> list[int | None]:
        """Per-layer left window (None = full context), as nanochat's _compute_window_sizes.

        Long layers get None: nanochat gives them sequence_len, which never limits a sequence
        the model accepts (positions < sequence_len), so it is plain causal attention.
        """
        L = self.sequence_len
        if self.short_window_rule == "half":
            short = L // 2
        elif self.short_window_rule == "third128":
            short = -(-L // 3 // 128) * 128
        else:
            short = -(-L // 4 // 128) * 128
        pattern = self.window_pattern.upper()
        sizes: list[int | None] = [short if pattern[i % len(pattern)] == "S" else None for i in range(self.n_layer)]
        sizes[-1] = None  # the final layer always has full context
        return [None if (w is not None and w >= L) else w for w in sizes]

    def features(self) -> list[str]:
        out = []
        if self.padded_vocab_size != self.vocab_size:
            out.append(f"vocab padded to {self.padded_vocab_size}")
        if self.resid_lambdas:
            out.append("resid/x0 lambdas")
        if any(w is not None for w in self.window_sizes()):
            out.append(f"windows {self.window_pattern}")
        if self.value_embeds:
            out.append(f"value embeds (gate {self.ve_gate_channels}ch x{self.ve_gate_scale})")
        if self.smear:
            out.append("smear")
        if self.backout:
            out.append("backout")
        if self.qk_scale is not None:
            out.append(f"qk x{self.qk_scale}")
        out.append(f"rope {self.rotary_base}{' bf16 tables' if self.rotary_bf16_tables else ''}")
        return out


class _Block(nn.Module):
    """One transformer block's weights (nanochat's Block: attention + relu^2 MLP)."""

    def __init__(self, w: dict[str, torch.Tensor], has_ve: bool):
        super().__init__()
        for name in ("c_q", "c_k", "c_v", "c_proj", "c_fc", "mlp_proj"):
            setattr(self, name, nn.Parameter(w[name], requires_grad=False))
        self.ve_gate = nn.Parameter(w["ve_gate"], requires_grad=False) if has_ve else None
        self.ve = nn.Parameter(w["ve"], requires_grad=False) if has_ve else None


class NanochatGPT(CausalLM):
    """nanochat GPT for inference (see the module docstring for the features it supports).

    Args:
        config: shape and features.
        weights: nanochat state-dict names (without "_orig_mod.") -> tensors, any float dtype.
        device, dtype: where and in which compute dtype to run.
        description: one line for ModelInfo.
    """

    def __init__(self, config: NanochatConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, description: str):
        super().__init__()
        self.config = c = config
        self.dtype = dtype
        cd = dict(device=device, dtype=dtype)  # Linear weights and embeddings: compute dtype
        f32 = dict(device=device, dtype=torch.float32)  # per-layer scalars stay fp32, as in nanochat

        def get(name: str, **to) -> torch.Tensor:
            return weights[name].to(torch.float32).to(**to).contiguous()

        self.wte = nn.Parameter(get("transformer.wte.weight", **cd), requires_grad=False)
        self.lm_head = nn.Parameter(get("lm_head.weight", **cd), requires_grad=False)
        blocks = []
        for i in range(c.n_layer):
            p = f"transformer.h.{i}."
            ve = c.value_embeds and has_value_embeds(i, c.n_layer)
            w = {"c_q": get(p + "attn.c_q.weight", **cd), "c_k": get(p + "attn.c_k.weight", **cd),
                 "c_v": get(p + "attn.c_v.weight", **cd), "c_proj": get(p + "attn.c_proj.weight", **cd),
                 "c_fc": get(p + "mlp.c_fc.weight", **cd), "mlp_proj": get(p + "mlp.c_proj.weight", **cd)}
            if ve:
                w["ve_gate"] = get(p + "attn.ve_gate.weight", **cd)
                w["ve"] = get(f"value_embeds.{i}.weight", **cd)
            blocks.append(_Block(w, ve))
        self.blocks = nn.ModuleList(blocks)
        self.resid_lambdas = self.x0_lambdas = None
        if c.resid_lambdas:
            # nanochat's _patch_missing_keys: a missing one of the pair is 1.0 / 0.0
            r = weights.get("resid_lambdas", torch.ones(c.n_layer))
            z = weights.get("x0_lambdas", torch.zeros(c.n_layer))
            self.resid_lambdas = nn.Parameter(r.to(torch.float32).to(**f32), requires_grad=False)
            self.x0_lambdas = nn.Parameter(z.to(torch.float32).to(**f32), requires_grad=False)
        self.smear_gate = self.smear_lambda = self.backout_lambda = None
        if c.smear:
            self.smear_gate = nn.Parameter(get("smear_gate.weight", **cd), requires_grad=False)
            self.smear_lambda = nn.Parameter(get("smear_lambda", **f32), requires_grad=False)
        if c.backout:
            self.backout_lambda = nn.Parameter(get("backout_lambda", **f32), requires_grad=False)
        self.windows = c.window_sizes()

        # Rotary tables, computed like nanochat's _precompute_rotary_embeddings on the model's
        # device; kept in bf16 for the 2025-era models, in the compute dtype from 6ed7d1d on.
        table_dtype = torch.bfloat16 if c.rotary_bf16_tables else dtype
        ch = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (c.rotary_base ** (ch / c.head_dim))
        t = torch.arange(c.sequence_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().to(table_dtype), persistent=False)  # (sequence_len, D/2)
        self.register_buffer("sin", freqs.sin().to(table_dtype), persistent=False)

        self.info = ModelInfo(arch="nanochat", vocab_size=c.vocab_size, context_len=c.sequence_len,
                              n_layer=c.n_layer, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
                              state_dims={"smear": c.n_embd} if c.smear else {}, description=description)

    def architecture(self) -> dict:
        """The shape and detected features (NanochatConfig) as a dict."""
        return asdict(self.config)

    # ----- pieces shared by both forwards -----

    def _check_positions(self, max_pos: int) -> None:
        if max_pos >= self.cos.shape[0]:
            raise ValueError(f"position {max_pos} is beyond the model's context of {self.cos.shape[0]} tokens")

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return _norm(F.embedding(tokens, self.wte).to(self.dtype))

    def _smear_gate(self, x: torch.Tensor) -> torch.Tensor:
        # .contiguous(): F.linear on a strided 3-D slice picks a different matmul path depending on
        # whether the weight requires grad (nanochat's do), a last-bit difference; a contiguous
        # input takes the same path either way.
        gate = self.linear(x[..., :SMEAR_CHANNELS].contiguous(), self.smear_gate)
        return self.smear_lambda.to(x.dtype) * self.pointwise(torch.sigmoid, invariant_sigmoid, gate)

    def _smear_sequence(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Mix each token's predecessor embedding into it within the chunk. The chunk's first
        token is unchanged at position 0; after a cached prefix (`prev`: (B,) the token before
        each row's chunk, -1 for a row at position 0) it mixes in that token's embedding, as
        the whole prompt's prefill would (the gate is a row-invariant projection, the mix
        elementwise: the same bits)."""
        if prev is None:
            if x.shape[1] < 2:
                return x
            gate = self._smear_gate(x[:, 1:])
            return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        before = torch.cat([self._embed(prev.clamp(min=0))[:, None], x[:, :-1]], dim=1)
        mixed = x + self._smear_gate(x) * before
        first = torch.where((prev >= 0)[:, None], mixed[:, 0], x[:, 0])
        return torch.cat([first[:, None], mixed[:, 1:]], dim=1)

    @property
    def resumes_prefill(self) -> bool:
        """True: the smear's only input from before a chunk is the previous token (prev_tokens)."""
        return True

    def _attention(self, i: int, x: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend) -> torch.Tensor:
        c, blk = self.config, self.blocks[i]
        B, T, C = x.shape
        q = self.linear(x, blk.c_q).view(B, T, c.n_head, c.head_dim)
        k = self.linear(x, blk.c_k).view(B, T, c.n_kv_head, c.head_dim)
        v = self.linear(x, blk.c_v).view(B, T, c.n_kv_head, c.head_dim)
        if blk.ve is not None:
            ve = F.embedding(tokens, blk.ve).to(x.dtype).view(B, T, c.n_kv_head, c.head_dim)
            g = self.linear(x[..., :c.ve_gate_channels].contiguous(), blk.ve_gate)
            gate = c.ve_gate_scale * self.pointwise(torch.sigmoid, invariant_sigmoid, g)
            v = v + gate.unsqueeze(-1) * ve
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k = _norm(q), _norm(k)
        if c.qk_scale is not None:
            q = q * c.qk_scale
            k = k * c.qk_scale
        y = attend(i, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.linear(y, blk.c_proj)

    def _trunk(self, x: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        x0 = x
        backout_layer = self.config.n_layer // 2
        x_backout = None
        for i, blk in enumerate(self.blocks):
            if self.resid_lambdas is not None:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = x + self._attention(i, _norm(x), tokens, cos, sin, attend)
            h = F.relu(self.linear(_norm(x), blk.c_fc)).square()
            x = x + self.linear(h, blk.mlp_proj)
            if i == backout_layer:
                x_backout = x
        if self.backout_lambda is not None:
            x = x - self.backout_lambda.to(x.dtype) * x_backout
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.project_head(_norm(x), self.lm_head)[..., :self.config.vocab_size].float()
        s = self.config.softcap
        # s * tanh(logits / s), in place: the same operations in the same order as nanochat,
        # without allocating three more vocabulary-sized tensors per step
        return logits.div_(s).tanh_().mul_(s)

    # ----- the two forwards -----

    @reference_numerics
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free forward, (B, T) -> (B, T, vocab) fp32: nanochat's GPT.forward(idx)."""
        B, T = tokens.shape
        self._check_positions(T - 1)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x = self._embed(tokens)
        if self.smear_gate is not None:
            x = self._smear_sequence(x)

        def attend(i, q, k, v):
            w = self.windows[i]
            gqa = q.shape[1] != k.shape[1]
            k, v = self.as_cached(k, v)
            if w is None or w >= T:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            r = torch.arange(T, device=q.device)
            d = r[:, None] - r[None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=(d >= 0) & (d <= w), enable_gqa=gqa)

        return self._logits(self._trunk(x, tokens, cos, sin, attend))

    def forward_step(self, tokens: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """One prefill or decode step over the KV cache, (B, T) -> (B, vocab) fp32 at last_index
        ((B, T, vocab) with batch.all_logits)."""
        B, T = tokens.shape
        pos = batch.positions
        self._check_positions(batch.last_position(T))  # host ints: no device sync
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # (B, T, 1, D/2), per-row positions
        x = self._embed(tokens)
        rows = torch.arange(B, device=tokens.device)
        if self.smear_gate is not None:
            state = kv.state["smear"]
            if batch.prefill:
                # what the next decode step smears in: the normed embedding of the last real token
                current = x[rows, batch.last_index]
                x = self._smear_sequence(x, batch.prev_tokens)
            else:
                current = x[:, 0]
                x = x + self._smear_gate(x) * state[batch.slots][:, None, :]
            state[batch.slots] = current

        def attend(i, q, k, v):
            return kv.attend(i, q, k, v, batch, self.windows[i])

        x = self._trunk(x, tokens, cos, sin, attend)
        return self._logits(x if batch.all_logits else x[rows, batch.last_index])
