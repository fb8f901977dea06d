"""nanochat's GPT (github.com/karpathy/nanochat, nanochat/gpt.py) for inference, with parity.

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

Features without a key (rules below in `_detect_features`, each with its commit):
- padded vocabulary (f1bf69d): wte has ceil(vocab_size / 64) * 64 rows; logits are cropped.
- window_pattern (fbc1484): from meta's model_config, missing => "L" (nanochat's
  _patch_missing_config_keys); the short window changed over time (L//2, then ceil(L/3/128)*128
  in 6ed7d1d, then ceil(L/4/128)*128 in a825e63).
- rotary base 100000 and rotary tables in the compute dtype (6ed7d1d / 1076f97; before them
  base 10000 and tables rounded to bfloat16 even in an fp32 model).
- q, k *= 1.2 after QK norm (a825e63).

dtype: float32 reproduces nanochat with COMPUTE_DTYPE=float32 (its CPU path) exactly;
bfloat16 reproduces COMPUTE_DTYPE=bfloat16 (Linear weights, embeddings and activations in
bf16, per-layer scalars kept fp32 and applied as 0-dim tensors, logits in fp32). Checkpoints
from the autocast era (before 1076f97) in bf16 are approximate, as autocast's choices differ.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.errors import CheckpointError, check_keys
from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM, ModelInfo, invariant_sigmoid, reference_numerics

SOFTCAP = 15.0  # nanochat's logit softcap (see _detect_features for the one exception)
SMEAR_CHANNELS = 24  # a825e63: smear_gate reads the first 24 channels (also its weight's width)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """nanochat's parameter-free RMSNorm (F.rms_norm, default eps)."""
    return F.rms_norm(x, (x.size(-1),))


def _has_ve(layer: int, n_layer: int) -> bool:
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
    qk_scale: float | None = None  # 1.2 from a825e63, None = no scaling
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
            ve = c.value_embeds and _has_ve(i, c.n_layer)
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

    def _smear_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Mix each token's predecessor embedding into it within the chunk (position 0 unchanged)."""
        if x.shape[1] < 2:
            return x
        gate = self._smear_gate(x[:, 1:])
        return torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)

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
        self._check_positions(T - 1 if batch.prefill else batch.kv_len - 1)  # host ints: no device sync
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # (B, T, 1, D/2), per-row positions
        x = self._embed(tokens)
        rows = torch.arange(B, device=tokens.device)
        if self.smear_gate is not None:
            state = kv.state["smear"]
            if batch.prefill:
                # what the next decode step smears in: the normed embedding of the last real token
                current = x[rows, batch.last_index]
                x = self._smear_sequence(x)
            else:
                current = x[:, 0]
                x = x + self._smear_gate(x) * state[batch.slots][:, None, :]
            state[batch.slots] = current

        def attend(i, q, k, v):
            return kv.attend(i, q, k, v, batch, self.windows[i])

        x = self._trunk(x, tokens, cos, sin, attend)
        return self._logits(x if batch.all_logits else x[rows, batch.last_index])


# ----- loading -----

_MODEL_RE = re.compile(r"model_(\d+)\.pt")
_META_RE = re.compile(r"meta_(\d+)\.json")
_CONFIG_REQUIRED = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
_CONFIG_OPTIONAL = ("window_pattern",)


def _pad64(n: int) -> int:
    return (n + 63) // 64 * 64


def find_files(directory: Path, step: int | None) -> tuple[Path, Path]:
    """The model and meta files for `step` (highest step when None)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"nanochat checkpoint directory {str(directory)!r} does not exist")

    def by_step(pattern: re.Pattern) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for f in sorted(directory.iterdir()):
            m = pattern.fullmatch(f.name)
            if m:
                s = int(m.group(1))
                if s in found:
                    raise CheckpointError(f"{directory}: two files for step {s}: {found[s].name} and {f.name}")
                found[s] = f
        return found

    models, metas = by_step(_MODEL_RE), by_step(_META_RE)
    if not models:
        raise CheckpointError(f"{directory}: no model_<step>.pt file (not a nanochat checkpoint directory)")
    if step is None:
        step = max(models)
    elif step not in models:
        raise CheckpointError(f"{directory}: no model file for step {step}; steps present: {sorted(models)}")
    if step not in metas:
        raise CheckpointError(f"{directory}: {models[step].name} has no meta_{step:06d}.json beside it "
                              f"(nanochat saves the model_config there; it is required)")
    return models[step], metas[step]


def _read_config(meta_path: Path) -> dict:
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: cannot read meta JSON: {e}") from e
    mc = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(mc, dict):
        raise CheckpointError(f"{meta_path}: no 'model_config' object")
    missing = [k for k in _CONFIG_REQUIRED if k not in mc]
    unknown = sorted(set(mc) - set(_CONFIG_REQUIRED) - set(_CONFIG_OPTIONAL))
    if missing or unknown:
        raise CheckpointError(f"{meta_path}: model_config " + "; ".join(
            ([f"is missing {missing}"] if missing else []) + ([f"has unknown keys {unknown}"] if unknown else [])))
    cfg = {k: mc[k] for k in _CONFIG_REQUIRED}
    if not all(isinstance(v, int) and v > 0 for v in cfg.values()):
        raise CheckpointError(f"{meta_path}: model_config values must be positive integers: {cfg}")
    # nanochat's _patch_missing_config_keys: old models were trained with full context
    cfg["window_pattern"] = mc.get("window_pattern", "L")
    wp = cfg["window_pattern"]
    if not isinstance(wp, str) or not wp or any(ch not in "SL" for ch in wp.upper()):
        raise CheckpointError(f"{meta_path}: window_pattern {wp!r} must be a non-empty string of S and L")
    if cfg["n_embd"] % cfg["n_head"] or cfg["n_head"] % cfg["n_kv_head"] or (cfg["n_embd"] // cfg["n_head"]) % 2:
        raise CheckpointError(f"{meta_path}: inconsistent attention shape n_embd={cfg['n_embd']} "
                              f"n_head={cfg['n_head']} n_kv_head={cfg['n_kv_head']}")
    return cfg


def _detect_features(cfg: dict, sd: dict[str, torch.Tensor], model_path: Path) -> NanochatConfig:
    """Work out the architecture from the state dict's keys and shapes; validate them all."""
    L, C, V = cfg["n_layer"], cfg["n_embd"], cfg["vocab_size"]
    D = C // cfg["n_head"]
    kv_dim = cfg["n_kv_head"] * D
    keys = set(sd)

    # Padded vocabulary (f1bf69d): wte/lm_head have ceil(V/64)*64 rows, logits are cropped to V.
    # Before it, wte has exactly V rows. Evidence: wte's row count against meta's vocab_size.
    wte = sd.get("transformer.wte.weight")
    Vp = wte.shape[0] if wte is not None and wte.ndim == 2 else V
    if Vp not in (V, _pad64(V)):
        raise CheckpointError(f"{model_path}: transformer.wte.weight has {Vp} rows; expected vocab_size {V} "
                              f"or {V} padded to a multiple of 64 ({_pad64(V)})")

    expected: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (Vp, C), "lm_head.weight": (Vp, C)}
    for i in range(L):
        p = f"transformer.h.{i}."
        expected.update({p + "attn.c_q.weight": (C, C), p + "attn.c_k.weight": (kv_dim, C),
                         p + "attn.c_v.weight": (kv_dim, C), p + "attn.c_proj.weight": (C, C),
                         p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_proj.weight": (C, 4 * C)})

    # resid_lambdas / x0_lambdas (aa530cd); one missing is patched by nanochat to ones / zeros.
    has_lambdas = bool(keys & {"resid_lambdas", "x0_lambdas"})
    for k in ("resid_lambdas", "x0_lambdas"):
        if k in keys:
            expected[k] = (L,)

    # Value embeddings with per-layer ve_gate (e85db6b's alternating design, last layer always).
    ve_layers = [i for i in range(L) if _has_ve(i, L)]
    has_ve = any(k.startswith("value_embeds.") or k.endswith(".attn.ve_gate.weight") for k in keys)
    gate_width = 12
    if has_ve:
        g = sd.get(f"transformer.h.{L - 1}.attn.ve_gate.weight")
        if g is not None and g.ndim == 2 and 0 < g.shape[1] <= C:
            gate_width = g.shape[1]
        for i in ve_layers:
            expected[f"value_embeds.{i}.weight"] = (Vp, kv_dim)
            expected[f"transformer.h.{i}.attn.ve_gate.weight"] = (cfg["n_kv_head"], gate_width)

    # Smear (smear_gate + smear_lambda) and backout (backout_lambda): a825e63.
    has_smear = bool(keys & {"smear_gate.weight", "smear_lambda"})
    if has_smear:
        expected["smear_gate.weight"] = (1, SMEAR_CHANNELS)
        expected["smear_lambda"] = (1,)
    has_backout = "backout_lambda" in keys
    if has_backout:
        expected["backout_lambda"] = (1,)

    check_keys(keys, expected, str(model_path), f"for a nanochat GPT with n_layer={L}")
    bad = [f"{k} {tuple(sd[k].shape)} (expected {shape})" for k, shape in expected.items()
           if tuple(sd[k].shape) != shape]
    if bad:
        raise CheckpointError(f"{model_path}: tensor shapes do not match meta's model_config: " + ", ".join(bad))
    if not all(t.is_floating_point() for t in sd.values()):
        raise CheckpointError(f"{model_path}: non-float tensors: "
                              f"{sorted(k for k, t in sd.items() if not t.is_floating_point())}")

    # Era evidence for the features that have no key of their own:
    # - a825e63 added smear_gate/smear_lambda/backout_lambda AND q,k *= 1.2 AND the quarter short
    #   window ceil(L/4/128)*128.
    # - 6ed7d1d changed ve_gate's width 32 -> 12 and its scale 2 -> 3 AND the rotary base
    #   10000 -> 100000 AND the short window L//2 -> ceil(L/3/128)*128.
    # - 1076f97 (5 days before 6ed7d1d) made the rotary tables the compute dtype instead of bf16.
    #   It has no evidence of its own; we tie it to 6ed7d1d's, so a checkpoint trained between
    #   1076f97 and 6ed7d1d (32-wide ve_gate) runs with bf16-rounded tables in fp32 (off by
    #   bf16 rounding of cos/sin; identical in bf16).
    # - aba30cb..6ed7d1d trained with softcap 20 (32-wide ve_gate too, but so were e85db6b..aba30cb
    #   with 15): no evidence tells them apart, so softcap is always nanochat's 15.
    post_a825e63 = has_smear or has_backout
    post_6ed7d1d = post_a825e63 or (has_ve and gate_width != 32)
    if post_a825e63:
        short_rule = "quarter128"
    elif post_6ed7d1d:
        short_rule = "third128"
    else:
        short_rule = "half"  # fbc1484 (windows) .. 6ed7d1d; before fbc1484 the pattern is "L" anyway
    return NanochatConfig(
        sequence_len=cfg["sequence_len"], vocab_size=V, padded_vocab_size=Vp, n_layer=L, n_head=cfg["n_head"],
        n_kv_head=cfg["n_kv_head"], n_embd=C, window_pattern=cfg["window_pattern"], short_window_rule=short_rule,
        resid_lambdas=has_lambdas, value_embeds=has_ve, ve_gate_channels=gate_width,
        ve_gate_scale=3 if post_6ed7d1d else 2, smear=has_smear, backout=has_backout,
        qk_scale=1.2 if post_a825e63 else None, rotary_base=100000 if post_6ed7d1d else 10000,
        rotary_bf16_tables=not post_6ed7d1d)


def load_nanochat_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype,
                             step: int | None = None) -> CausalLM:
    """Load a nanochat checkpoint directory (model_<step>.pt + meta_<step>.json), highest step by default."""
    directory = Path(directory)
    model_path, meta_path = find_files(directory, step)
    cfg = _read_config(meta_path)
    try:
        raw = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"{model_path}: cannot load the state dict: {e}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise CheckpointError(f"{model_path}: expected a state dict (name -> tensor)")
    # torch.compile'd models save their keys as _orig_mod.<name> (nanochat strips it the same way)
    sd = {str(k).removeprefix("_orig_mod."): v for k, v in raw.items()}
    if len(sd) != len(raw):
        raise CheckpointError(f"{model_path}: keys present both with and without the _orig_mod. prefix")
    config = _detect_features(cfg, sd, model_path)
    n_params = sum(t.numel() for t in sd.values())
    desc = (f"nanochat d{config.n_layer} n_embd={config.n_embd} ({n_params / 1e6:.1f}M params; "
            f"{', '.join(config.features())}) from {model_path}")
    return NanochatGPT(config, sd, torch.device(device), dtype, desc).eval()


def build_tiny_random_model(vocab_size: int, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A small untrained nanochat (2026 architecture, every feature on) with deterministic random weights.

    Weights come from a fixed-seed CPU torch.Generator, so every machine and process builds the
    same model. Scales follow nanochat's init_weights in spirit, but the projections and lm_head
    are non-zero and larger so that the output distribution is not uniform.
    """
    L, C, H, KV, seq = 4, 128, 4, 2, 1024
    Vp = _pad64(vocab_size)
    D = C // H
    g = torch.Generator().manual_seed(20260703)
    s = 3 ** 0.5 * C ** -0.5  # nanochat: uniform bound with std 1/sqrt(n_embd)

    def uniform(shape, bound):
        return torch.empty(shape).uniform_(-bound, bound, generator=g)

    def normal(shape, std):
        return torch.empty(shape).normal_(0.0, std, generator=g)

    w = {"transformer.wte.weight": normal((Vp, C), 0.8), "lm_head.weight": normal((Vp, C), 0.25)}
    for i in range(L):
        p = f"transformer.h.{i}."
        w[p + "attn.c_q.weight"] = uniform((C, C), s)
        w[p + "attn.c_k.weight"] = uniform((KV * D, C), s)
        w[p + "attn.c_v.weight"] = uniform((KV * D, C), s)
        w[p + "attn.c_proj.weight"] = uniform((C, C), 0.5 * s)
        w[p + "mlp.c_fc.weight"] = uniform((4 * C, C), s)
        w[p + "mlp.c_proj.weight"] = uniform((C, 4 * C), 0.25 * s)
        if _has_ve(i, L):
            w[p + "attn.ve_gate.weight"] = uniform((KV, 12), 0.5)
            w[f"value_embeds.{i}.weight"] = uniform((Vp, KV * D), s)
    w["resid_lambdas"] = torch.tensor([1.15 - 0.10 * i / (L - 1) for i in range(L)])
    w["x0_lambdas"] = torch.tensor([0.20 - 0.15 * i / (L - 1) for i in range(L)])
    w["smear_gate.weight"] = uniform((1, SMEAR_CHANNELS), 0.5)
    w["smear_lambda"] = torch.tensor([0.3])
    w["backout_lambda"] = torch.tensor([0.2])
    cfg = {"sequence_len": seq, "vocab_size": vocab_size, "n_layer": L, "n_head": H, "n_kv_head": KV,
           "n_embd": C, "window_pattern": "SSSL"}
    config = _detect_features(cfg, w, Path("<tiny-random>"))
    desc = (f"tiny-random: untrained nanochat d{L} n_embd={C} with random weights (text is noise); "
            f"{', '.join(config.features())}")
    return NanochatGPT(config, w, torch.device(device), dtype, desc).eval()
