"""Small stand-ins for engine tests: a tiny random transformer and a byte-level tokenizer.

They implement the same contracts as the real models and tokenizers (engine/models/base.py,
engine/tokenizers/base.py), small enough that engine tests run in milliseconds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM, ModelInfo, reference_numerics

SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
            "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; nanochat's special tokens follow."""

    def __init__(self):
        self.specials = {name: 256 + i for i, name in enumerate(SPECIALS)}
        self.vocab_size = 256 + len(SPECIALS)
        self.bos_token_id = self.specials["<|bos|>"]
        self.default_stop_token_ids = (self.specials["<|assistant_end|>"], self.bos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        inv = {v: k for k, v in self.specials.items()}
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
            else:
                out.append(buf.decode("utf-8", "replace")); buf = bytearray(); out.append(inv[t])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def decode_token_bytes(self, token: int) -> bytes:
        if 0 <= token < 256:
            return bytes([token])
        inv = {v: k for k, v in self.specials.items()}
        if token not in inv:
            raise ValueError(f"token id {token} is not in the vocabulary")
        return inv[token].encode()

    def special(self, name):
        return self.specials.get(name)


class ToyLM(CausalLM):
    """A 2-layer pre-norm transformer with learned positions and GQA; random weights.

    Its step projections go through `CausalLM.linear`, as the real models' do, so a row's
    logits do not depend on the other rows of a step (the cache-free forward uses F.linear).
    """

    def __init__(self, vocab_size=265, n_embd=32, n_head=4, n_kv_head=2, n_layer=2, context_len=64, seed=0,
                 window=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        hd = n_embd // n_head
        self.n_head, self.n_kv_head, self.hd, self.window = n_head, n_kv_head, hd, window
        self.info = ModelInfo("toy", vocab_size, context_len, n_layer, n_kv_head, hd)
        r = lambda *s: nn.Parameter(torch.randn(*s, generator=g) * 0.5)
        self.wte, self.wpe = r(vocab_size, n_embd), r(context_len, n_embd)
        self.qkv = nn.ParameterList([r((n_head + 2 * n_kv_head) * hd, n_embd) for _ in range(n_layer)])
        self.proj = nn.ParameterList([r(n_embd, n_embd) for _ in range(n_layer)])
        self.head = r(vocab_size, n_embd)

    def _trunk(self, tokens, positions, attend):
        x = self.wte[tokens] + self.wpe[positions]
        B, T, _ = x.shape
        for l in range(len(self.qkv)):
            h = F.rms_norm(x, (x.shape[-1],))
            q, k, v = self.linear(h, self.qkv[l]).split([self.n_head * self.hd, self.n_kv_head * self.hd,
                                                      self.n_kv_head * self.hd], dim=-1)
            q = q.view(B, T, self.n_head, self.hd).transpose(1, 2)
            k = k.view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
            v = v.view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
            y = attend(l, q, k, v)
            x = x + self.linear(y.transpose(1, 2).reshape(B, T, -1), self.proj[l])
        return F.rms_norm(x, (x.shape[-1],))

    @reference_numerics
    def forward(self, tokens):
        T = tokens.shape[1]
        pos = torch.arange(T)[None].expand_as(tokens)

        def attend(l, q, k, v):
            i = torch.arange(T)
            d = i[:, None] - i[None, :]
            m = d >= 0 if self.window is None else (d >= 0) & (d <= self.window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

        return self.linear(self._trunk(tokens, pos, attend), self.head).float()

    def forward_step(self, tokens, batch: StepBatch, kv: KVCache):
        x = self._trunk(tokens, batch.positions, lambda l, q, k, v: kv.attend(l, q, k, v, batch, self.window))
        x = x[torch.arange(x.shape[0]), batch.last_index]
        return self.linear(x, self.head).float()


class ScriptedLM(CausalLM):
    """Emits a fixed script: at position p it puts all mass on script[p + 1].

    `script` is the whole expected sequence (prompt, then generated and forced tokens), so a
    test can make the model "write" calculator calls and check what the engine forces.
    """

    def __init__(self, script: list[int], vocab_size: int, context_len: int = 512):
        super().__init__()
        self.script = script
        self.dummy = nn.Parameter(torch.zeros(1))
        self.info = ModelInfo("scripted", vocab_size, context_len, 1, 1, 4)

    def _logits(self, pos):
        out = torch.full((len(pos), self.info.vocab_size), -30.0)
        for i, p in enumerate(pos):
            nxt = self.script[p + 1] if p + 1 < len(self.script) else 0
            out[i, nxt] = 30.0
        return out

    @reference_numerics
    def forward(self, tokens):
        T = tokens.shape[1]
        return torch.stack([self._logits(list(range(T))) for _ in range(tokens.shape[0])])

    def forward_step(self, tokens, batch, kv):
        pos = batch.positions[torch.arange(tokens.shape[0]), batch.last_index].tolist()
        return self._logits(pos)
