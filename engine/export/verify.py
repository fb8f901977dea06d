"""`--verify`: a greedy generation loop in the exported artifact against batchgen's engine.

The prompts (a few of different lengths, token ids from a seeded generator) run left-padded in
one batch through the artifact's interface (engine/export/kv_forward.py): one prefill, then one
decode step per token, each step's `present.*` fed back as the next `past_key_values.*`. The
engine generates the same prompts greedily (`Engine.generate`, temperature 0, no stop tokens),
and scores each prompt with its generated tokens in one prefill through the model's own step
(`forward_step`, the compiled kernels, a real `KVCache`), which gives the logits at every
position and the KV the engine stores. The artifact's loop is fed the engine's tokens (teacher
forcing), so at every step both sides score the same prefix; where they agree, as a passing
artifact does at every step but a tie, that is the artifact's own greedy loop. Compared:
- tokens: the artifact's greedy choice equals the engine's, per prompt and step, but for a
  tie: a step whose logits pass and where the engine's own logits put the artifact's choice
  within the logit tolerance of their top (two correct programs rounding differently may break
  a tie either way: float16 nanochat e85db6b gives two tokens the same float16 logit). A tie is
  recorded (`Verification.ties`, the summary), never silent; any other difference fails;
- logits: each step's last-position logits against the engine's at the same position, at every
  step, ties included;
- KV: the final `present.{layer}.key/value` at each real position (the row's padding skipped)
  against the engine's cache.
The first difference beyond the tolerance is named by prompt, step, layer and position.

Tolerances (float32: 1e-4 for logits, 1e-5 for KV) are absolute for tensors whose largest
magnitude is at most 1 and scale with that magnitude above it (tol * max(1, max |reference|),
per step's logits and per layer's keys or values), and the KV's with the depth (x (layer + 1)):
two correct float32 programs summing in different orders differ in proportion to the values,
and each layer adds its rounding to the layers below. (SmolLM2, 30 layers, logits of about 20:
the engine's GEMM and onnxruntime's MLAS differ by 3.2e-4 in the logits and 1.1e-4 in the KV,
6e-5 already at layer 20, with identical tokens.) The tiny test models' 2-4 layers make the
KV bound 1e-5 to 4e-5.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from engine.export.errors import VerificationError
from engine.kv_cache import KVCache, StepBatch
from engine.kernels.kv_layout import KVLayout
from engine.models.base import CausalLM

Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # input name -> array, to output name -> array
PROMPT_LENGTHS = (5, 13, 2, 21)
LOGIT_TOL = {torch.float32: 1e-4, torch.float16: 5e-2}
KV_TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@dataclass
class Verification:
    """What `verify` measured: prompts (lengths), tokens per prompt, and the largest
    differences. passed is False when tokens differ or a difference exceeds its tolerance;
    first_difference then says where (else None)."""

    prompt_lengths: list[int]
    max_tokens: int
    tokens_identical: bool
    max_logit_diff: float
    max_kv_diff: float
    logit_tol: float
    kv_tol: float
    passed: bool
    first_difference: str | None = None
    tokens: list[list[int]] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)  # the steps accepted as ties (module docstring)

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        head = "passed" if self.passed else f"FAILED: {self.first_difference}"
        toks = ("identical" if self.tokens_identical else
                f"identical but for {len(self.ties)} tie(s) ({'; '.join(self.ties)})" if self.passed else "differ")
        return (f"verify {head}; {len(self.prompt_lengths)} prompts of {self.prompt_lengths} tokens x "
                f"{self.max_tokens} greedy tokens: tokens {toks}, "
                f"max logit diff {self.max_logit_diff:.3g} (tol {self.logit_tol:g} x max(1, |logits|)), "
                f"max KV diff {self.max_kv_diff:.3g} (tol {self.kv_tol:g} x max(1, |KV|) x (layer + 1))")


def verify_prompts(vocab_size: int, seed: int = 0, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Prompts of `lengths` token ids drawn uniformly from the vocabulary (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------- the artifact's loop
def greedy_loop(run: Runner, prompts: list[list[int]], max_tokens: int, *, n_layer: int, n_kv_head: int,
                head_dim: int, kv_dtype: np.dtype, smear_dim: int = 0, static_max_len: int | None = None,
                forced: list[list[int]] | None = None):
    """Greedy generation through an artifact's interface: (tokens (B, max_tokens), step logits
    (max_tokens, B, V) float32, the last step's presents {name: array}). Prompts left-padded
    with token 0; position_ids count real tokens from 0 (HF's cumsum(attention_mask) - 1).
    forced: per prompt, the tokens to feed back instead of the artifact's own choices (teacher
    forcing; max_tokens - 1 or more each); the tokens returned are still the artifact's."""
    B, P = len(prompts), max(map(len, prompts))
    ids = np.zeros((B, P), np.int64)
    mask = np.zeros((B, P), np.int64)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = p, 1
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    total = static_max_len if static_max_len is not None else 0
    feed = {f"past_key_values.{i}.{kv}": np.zeros((B, n_kv_head, total, head_dim), kv_dtype)
            for i in range(n_layer) for kv in ("key", "value")}
    if smear_dim:
        feed["past_smear"] = np.zeros((B, smear_dim), np.float32 if kv_dtype == np.float32 else kv_dtype)
    tokens, step_logits, out = [], [], {}
    for step in range(max_tokens):
        feed.update(input_ids=ids, position_ids=pos)
        if static_max_len is None:
            feed["attention_mask"] = mask
        else:  # fixed (B, N) mask; the step's tokens land at cache_position
            start = mask.shape[1] - ids.shape[1]
            full = np.zeros((B, static_max_len), np.int64)
            full[:, :mask.shape[1]] = mask
            feed["attention_mask"], feed["cache_position"] = full, np.arange(start, mask.shape[1], dtype=np.int64)
        out = run(feed)
        last = np.asarray(out["logits"][:, -1], np.float32)
        nxt = last.argmax(-1)
        tokens.append(nxt)
        step_logits.append(last)
        for name, value in out.items():
            if name.startswith("present."):
                feed["past_key_values." + name[len("present."):]] = value
        if smear_dim:
            feed["past_smear"] = out["present_smear"]
        if forced is not None and step + 1 < max_tokens:
            nxt = np.array([f[step] for f in forced])
        ids, pos = nxt[:, None].astype(np.int64), pos[:, -1:] + 1
        mask = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
    presents = {k: v for k, v in out.items() if k.startswith("present.")}
    return np.stack(tokens, 1), np.stack(step_logits), presents


# ---------------------------------------------------------------------- the engine's side
class _IdsTokenizer:
    """What the Engine needs for token ids alone: no specials (so no calculator tool forcing
    tokens), no default stop tokens."""

    vocab_size = 0
    default_stop_token_ids = ()

    def special(self, name):
        return None

    def decode(self, ids):
        return " ".join(map(str, ids))


def engine_reference(model: CausalLM, prompts: list[list[int]], max_tokens: int):
    """The engine's greedy tokens per prompt, and for each prompt with them, the logits at every
    position (L, V) and the stored KV ([layer] -> (k, v) each (L, KV, D)) of one prefill through
    the model's step."""
    from engine.engine import Engine
    from engine.params import SamplingParams

    longest = max(map(len, prompts)) + max_tokens
    eng = Engine(model, _IdsTokenizer(), max_num_seqs=len(prompts), max_seq_len=longest,
                 kv_cache_bytes=KVCache.bytes_per_position(model.info.n_layer, model.info.n_kv_head,
                                                           model.info.head_dim, model.kv_dtype)
                 * (len(prompts) * (2 * longest + 64) + 256))
    params = SamplingParams(num_samples=1, max_tokens=max_tokens, temperature=0.0, stop_token_ids=[])
    results = eng.generate(prompts, params, prompt_ids=[str(i) for i in range(len(prompts))])
    tokens = [r[0].tokens for r in results]
    scored = []
    info, dev = model.info, next(model.parameters()).device
    for p, t in zip(prompts, tokens):
        seq = p + t[:-1]
        L = len(seq)
        kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, 1, L, model.kv_dtype, dev, info.state_dims,
                     state_dtype=model.act_dtype)
        batch = StepBatch(slots=torch.zeros(1, dtype=torch.long), positions=torch.arange(L)[None],
                          last_index=torch.tensor([L - 1]), prefill=True,
                          layout=KVLayout.for_prefill([0], [L], dev), all_logits=True)
        with torch.no_grad():
            logits = model.owned_logits(model.forward_step(torch.tensor([seq]), batch, kv)[0].float())
        scored.append((logits, [(kv.k[i, :L].float(), kv.v[i, :L].float()) for i in range(info.n_layer)]))
    return tokens, scored


# ---------------------------------------------------------------------- comparison
def verify(run: Runner, model: CausalLM, *, max_tokens: int = 32, static_max_len: int | None = None,
           kv_dtype: torch.dtype = torch.float32, prompts: list[list[int]] | None = None) -> Verification:
    """Run the greedy loop in the artifact (`run`) and in the engine (`model`) and compare
    them (module docstring). Returns a `Verification`; never raises on a mismatch (the caller
    decides: `Verification.passed`)."""
    info = model.info
    prompts = prompts or verify_prompts(info.vocab_size)
    np_dtype = np.float16 if kv_dtype == torch.float16 else np.float32
    # the engine first: its tokens are what the artifact's loop is fed (module docstring)
    want_tokens, scored = engine_reference(model, prompts, max_tokens)
    got_tokens, got_logits, presents = greedy_loop(
        run, prompts, max_tokens, n_layer=info.n_layer, n_kv_head=info.n_kv_head, head_dim=info.head_dim,
        kv_dtype=np_dtype, smear_dim=info.state_dims.get("smear", 0), static_max_len=static_max_len,
        forced=want_tokens)
    logit_tol, kv_tol = LOGIT_TOL[kv_dtype], KV_TOL[kv_dtype]
    first: str | None = None
    identical = True
    ties: list[str] = []
    max_logit = max_kv = 0.0
    P = max(map(len, prompts))
    for b, (p, want) in enumerate(zip(prompts, want_tokens)):
        got = got_tokens[b].tolist()
        logits, kv = scored[b]
        for s in range(max_tokens):
            ref = logits[len(p) - 1 + s].numpy()
            tol = logit_tol * max(1.0, float(np.abs(ref).max()))
            d = float(np.abs(got_logits[s, b, :info.vocab_size] - ref).max())
            max_logit = max(max_logit, d)
            if got[s] != want[s]:
                identical = False
                gap = float(ref.max() - ref[got[s]])  # how far below the engine's top the artifact's choice is
                if d <= tol and gap <= tol:
                    ties.append(f"prompt {b} step {s}: token {got[s]}, the engine {want[s]}, "
                                f"{gap:.3g} below the engine's top logit")
                    continue
                first = first or (f"prompt {b} ({len(p)} tokens): step {s} gives token {got[s]}, the engine "
                                  f"{want[s]} (the artifact's token {gap:.3g} below the engine's top logit)")
            elif d > tol:
                first = first or f"prompt {b}: logits at step {s} (position {len(p) - 1 + s}) differ by {d:.3g}"
        n = len(p) + max_tokens - 1  # what was fed: the prompt, then the engine's tokens but the last
        pad = P - len(p)
        for i, (k, v) in enumerate(kv):
            for name, ref in (("key", k), ("value", v)):
                arr = presents[f"present.{i}.{name}"][b, :, pad:pad + n].astype(np.float32)  # (KV, n, D)
                want_kv = ref[:n].transpose(0, 1).numpy()
                diff = np.abs(arr - want_kv).max(axis=(0, 2))  # per position
                max_kv = max(max_kv, float(diff.max(initial=0.0)))
                bad = np.nonzero(diff > kv_tol * (i + 1) * max(1.0, float(np.abs(want_kv).max(initial=0.0))))[0]
                if len(bad) and first is None:
                    first = (f"prompt {b}: present.{i}.{name} (layer {i}) at position {int(bad[0])} differs "
                             f"by {float(diff[bad[0]]):.3g}")
    passed = first is None
    return Verification([len(p) for p in prompts], max_tokens, identical, max_logit, max_kv, logit_tol, kv_tol,
                        passed, first, [t.tolist() for t in got_tokens], ties)


def check(result: Verification) -> Verification:
    """Raise VerificationError (its summary, naming the first difference) unless it passed."""
    if not result.passed:
        raise VerificationError(result.summary())
    return result
