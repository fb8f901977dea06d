"""A nanochat checkpoint directory (model_<step>.pt + meta_<step>.json) -> a `NanochatGPT`
(engine/models/nanochat.py), and the built-in `tiny-random` model.

What a checkpoint uses is read from the checkpoint itself, feature by feature
(`_detect_features`): the features with keys of their own from the state dict's keys, the
others from the evidence of the era those keys date the checkpoint to (each rule with its
nanochat commit; the model's module docstring lists the features).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loading.errors import CheckpointError, check_keys
from engine.loading.weight_map import Target, WeightMap
from engine.models.base import CausalLM
from engine.models.nanochat import SMEAR_CHANNELS, NanochatConfig, NanochatGPT, has_value_embeds

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


@dataclass(frozen=True)
class _KeyedFeatures:
    """The features a state dict turns on by having their keys (the first list of
    engine/models/nanochat.py's docstring)."""

    lambdas: tuple[str, ...]  # which of resid_lambdas, x0_lambdas the state dict holds
    value_embeds: bool
    ve_gate_channels: int
    smear: bool
    backout: bool


def _detect_features(cfg: dict, sd: dict[str, torch.Tensor], model_path: Path) -> NanochatConfig:
    """Work out the architecture from the state dict's keys and shapes; validate them all."""
    Vp = _padded_vocab(cfg, sd, model_path)
    keyed = _keyed_features(cfg, sd)
    expected = _expected_shapes(cfg, Vp, keyed)
    _check_tensors(sd, expected, model_path, cfg["n_layer"])
    return _with_era_features(cfg, Vp, keyed)


def _padded_vocab(cfg: dict, sd: dict[str, torch.Tensor], model_path: Path) -> int:
    """Padded vocabulary (f1bf69d): wte/lm_head have ceil(V/64)*64 rows, logits are cropped to V.
    Before it, wte has exactly V rows. Evidence: wte's row count against meta's vocab_size."""
    V = cfg["vocab_size"]
    wte = sd.get("transformer.wte.weight")
    Vp = wte.shape[0] if wte is not None and wte.ndim == 2 else V
    if Vp not in (V, _pad64(V)):
        raise CheckpointError(f"{model_path}: transformer.wte.weight has {Vp} rows; expected vocab_size {V} "
                              f"or {V} padded to a multiple of 64 ({_pad64(V)})")
    return Vp


def _keyed_features(cfg: dict, sd: dict[str, torch.Tensor]) -> _KeyedFeatures:
    keys = set(sd)
    L, C = cfg["n_layer"], cfg["n_embd"]
    # Value embeddings with per-layer ve_gate (e85db6b's alternating design, last layer always).
    has_ve = any(k.startswith("value_embeds.") or k.endswith(".attn.ve_gate.weight") for k in keys)
    gate_width = 12
    if has_ve:
        g = sd.get(f"transformer.h.{L - 1}.attn.ve_gate.weight")
        if g is not None and g.ndim == 2 and 0 < g.shape[1] <= C:
            gate_width = g.shape[1]
    # resid_lambdas / x0_lambdas (aa530cd); smear (smear_gate + smear_lambda) and backout
    # (backout_lambda): a825e63.
    return _KeyedFeatures(lambdas=tuple(k for k in ("resid_lambdas", "x0_lambdas") if k in keys),
                          value_embeds=has_ve, ve_gate_channels=gate_width,
                          smear=bool(keys & {"smear_gate.weight", "smear_lambda"}), backout="backout_lambda" in keys)


def _expected_shapes(cfg: dict, Vp: int, keyed: _KeyedFeatures) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, name -> shape."""
    L, C = cfg["n_layer"], cfg["n_embd"]
    kv_dim = cfg["n_kv_head"] * (C // cfg["n_head"])
    expected: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (Vp, C), "lm_head.weight": (Vp, C)}
    for i in range(L):
        p = f"transformer.h.{i}."
        expected.update({p + "attn.c_q.weight": (C, C), p + "attn.c_k.weight": (kv_dim, C),
                         p + "attn.c_v.weight": (kv_dim, C), p + "attn.c_proj.weight": (C, C),
                         p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_proj.weight": (C, 4 * C)})
    for k in keyed.lambdas:  # one missing is patched by nanochat to ones / zeros
        expected[k] = (L,)
    if keyed.value_embeds:
        for i in range(L):
            if has_value_embeds(i, L):
                expected[f"value_embeds.{i}.weight"] = (Vp, kv_dim)
                expected[f"transformer.h.{i}.attn.ve_gate.weight"] = (cfg["n_kv_head"], keyed.ve_gate_channels)
    if keyed.smear:
        expected["smear_gate.weight"] = (1, SMEAR_CHANNELS)
        expected["smear_lambda"] = (1,)
    if keyed.backout:
        expected["backout_lambda"] = (1,)
    return expected


def _check_tensors(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], model_path: Path,
                   L: int) -> None:
    check_keys(set(sd), expected, str(model_path), f"for a nanochat GPT with n_layer={L}")
    bad = [f"{k} {tuple(sd[k].shape)} (expected {shape})" for k, shape in expected.items()
           if tuple(sd[k].shape) != shape]
    if bad:
        raise CheckpointError(f"{model_path}: tensor shapes do not match meta's model_config: " + ", ".join(bad))
    if not all(t.is_floating_point() for t in sd.values()):
        raise CheckpointError(f"{model_path}: non-float tensors: "
                              f"{sorted(k for k, t in sd.items() if not t.is_floating_point())}")


def _with_era_features(cfg: dict, Vp: int, keyed: _KeyedFeatures) -> NanochatConfig:
    """The config, with the features that have no key of their own read from era evidence:
    - a825e63 added smear_gate/smear_lambda/backout_lambda AND q,k *= 1.2 (was 1.15) AND the
      quarter short window ceil(L/4/128)*128.
    - 6ed7d1d changed ve_gate's width 32 -> 12 and its scale 2 -> 3 AND the rotary base
      10000 -> 100000 AND the short window L//2 -> ceil(L/3/128)*128 AND added q,k *= 1.15
      after QK norm.
    - 1076f97 (5 days before 6ed7d1d) made the rotary tables the compute dtype instead of bf16.
      It has no evidence of its own; we tie it to 6ed7d1d's, so a checkpoint trained between
      1076f97 and 6ed7d1d (32-wide ve_gate) runs with bf16-rounded tables in fp32 (off by
      bf16 rounding of cos/sin; identical in bf16).
    - aba30cb..6ed7d1d trained with softcap 20 (32-wide ve_gate too, but so were e85db6b..aba30cb
      with 15): no evidence tells them apart, so softcap is always nanochat's 15.
    """
    post_a825e63 = keyed.smear or keyed.backout
    post_6ed7d1d = post_a825e63 or (keyed.value_embeds and keyed.ve_gate_channels != 32)
    if post_a825e63:
        short_rule = "quarter128"
    elif post_6ed7d1d:
        short_rule = "third128"
    else:
        short_rule = "half"  # fbc1484 (windows) .. 6ed7d1d; before fbc1484 the pattern is "L" anyway
    return NanochatConfig(
        sequence_len=cfg["sequence_len"], vocab_size=cfg["vocab_size"], padded_vocab_size=Vp, n_layer=cfg["n_layer"],
        n_head=cfg["n_head"], n_kv_head=cfg["n_kv_head"], n_embd=cfg["n_embd"], window_pattern=cfg["window_pattern"],
        short_window_rule=short_rule, resid_lambdas=bool(keyed.lambdas), value_embeds=keyed.value_embeds,
        ve_gate_channels=keyed.ve_gate_channels, ve_gate_scale=3 if post_6ed7d1d else 2, smear=keyed.smear,
        backout=keyed.backout, qk_scale=1.2 if post_a825e63 else 1.15 if post_6ed7d1d else None,
        rotary_base=100000 if post_6ed7d1d else 10000,
        rotary_bf16_tables=not post_6ed7d1d)


def load_nanochat_checkpoint(directory: Path, device: torch.device, dtype: torch.dtype,
                             step: int | None = None, *, weights: dict[str, torch.Tensor] | None = None) -> CausalLM:
    """Load a nanochat checkpoint directory (model_<step>.pt + meta_<step>.json), highest step
    by default. weights: model_<step>.pt's state dict already read (meta tensors for a
    weights swap's check); None: read it."""
    directory = Path(directory)
    model_path, meta_path = find_files(directory, step)
    cfg = _read_config(meta_path)
    raw = weights
    if raw is None:
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
        if has_value_embeds(i, L):
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


# nanochat's block names -> _Block's parameters
_BLOCK_TARGETS = {"attn.c_q.weight": "c_q", "attn.c_k.weight": "c_k", "attn.c_v.weight": "c_v",
                  "attn.c_proj.weight": "c_proj", "mlp.c_fc.weight": "c_fc", "mlp.c_proj.weight": "mlp_proj",
                  "attn.ve_gate.weight": "ve_gate"}
_TOP_TARGETS = {"transformer.wte.weight": "wte", "lm_head.weight": "lm_head", "smear_gate.weight": "smear_gate"}


def weight_map(model: NanochatGPT) -> WeightMap:
    """Where each tensor of nanochat's own state dict (names as its GPT saves them, with or
    without torch.compile's "_orig_mod." prefix) goes in `model`: the same names as the
    checkpoint's `_expected_shapes`, one parameter each; resid_lambdas or x0_lambdas may be
    left out, as the loader allows, and the parameter gets the loader's ones / zeros."""
    c = model.config
    keyed = _KeyedFeatures(lambdas=("resid_lambdas", "x0_lambdas") if c.resid_lambdas else (),
                           value_embeds=c.value_embeds, ve_gate_channels=c.ve_gate_channels, smear=c.smear,
                           backout=c.backout)
    cfg = {"n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "n_kv_head": c.n_kv_head}
    targets: dict[str, Target | None] = {}
    for name in _expected_shapes(cfg, c.padded_vocab_size, keyed):
        if name.startswith("transformer.h."):
            i, rest = name[len("transformer.h."):].split(".", 1)
            targets[name] = Target(f"blocks.{i}.{_BLOCK_TARGETS[rest]}")
        elif name.startswith("value_embeds."):
            targets[name] = Target(f"blocks.{name.split('.')[1]}.ve")
        else:
            targets[name] = Target(_TOP_TARGETS.get(name, name))
    # the loader takes one of resid_lambdas / x0_lambdas alone and patches the other (NanochatGPT)
    defaults = {"resid_lambdas": 1.0, "x0_lambdas": 0.0} if c.resid_lambdas else {}
    return WeightMap(targets, strip_prefixes=("_orig_mod.",), defaults=defaults)
