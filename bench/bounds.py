"""How fast a generation run could possibly be on this machine: a measured upper bound.

A speed target stated as a multiple of a baseline is only reachable if it is below what the
hardware allows. This module bounds a finished engine run from below in time (so from above
in tokens/s) by the two costs no implementation of the same computation avoids:
- the matrix multiplies: every projection and the head, for every generated token, timed
  alone at the run's batch size through the engine's own kernel (`CausalLM.linear`: the
  compiled GEMM on CPU), plus the prefill's multiplies at the GEMM peak;
- reading the KV cache once per decode step: each prompt's keys and values once per step
  while any of its samples runs (shared-prefix attention), and each sample's own, at the
  machine's measured read bandwidth.
Attention arithmetic, sampling, norms, activations and everything else count as free, so
the bound is generous. Used by bench_engine.py and bench_smollm2.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Bound:
    gemm_flops_per_token: float
    read_bytes_per_s: float    # measured read bandwidth (bytes/s)
    prefill_s: float           # prefill multiplies at the GEMM peak (seconds)
    kv_read_s: float           # the run's KV bytes / bandwidth (seconds)
    decode_gemm_s: float       # generated tokens x gemm_s_per_token (seconds)
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.prefill_s + self.decode_gemm_s + self.kv_read_s)

    def describe(self) -> str:
        return (f"{self.tokens_per_s:.1f} tokens/s at most: {self.decode_gemm_s:.1f} s of decode GEMMs "
                f"({self.gemm_flops_per_token * self.tokens / self.decode_gemm_s / 1e9:.0f} GFLOP/s, the engine's "
                f"kernel at the run's batch size) + {self.prefill_s:.1f} s of prefill GEMMs at peak + "
                f"{self.kv_read_s:.1f} s reading the KV cache at {self.read_bytes_per_s / 1e9:.1f} GB/s; "
                f"attention arithmetic, sampling, norms and all else taken as free")


def best_seconds(fn, reps: int) -> float:
    """The shortest of `reps` timed calls of fn, after one untimed (warm-up) call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(threads: int, n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best rate over `reps` n x n x n products with `threads` threads (FLOP/s) through the
    engine's GEMM (the compiled kernel, weights in `dtype`, float32 activations as a step
    has them); torch.matmul in float32 where the compiled kernels are unavailable."""
    from engine.kernels.native import native_kernels

    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    kernels = native_kernels()
    if kernels is None:
        b = torch.randn(n, n)
        return 2 * n**3 / best_seconds(lambda: torch.matmul(a, b), reps)
    w = kernels.pack(torch.randn(n, n).to(dtype))
    return 2 * n**3 / best_seconds(lambda: kernels.gemm(a, w, torch.float32, threads), reps)


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 3) -> float:
    """Best read rate (bytes/s) of a float32 sum over an `nbytes` buffer (far larger than cache)."""
    x = torch.ones(nbytes // 4)
    return nbytes / best_seconds(x.sum, reps)


def step_gemms(model) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor]:
    """The (weight (N, C), bias) of every `linear` call of one token's forward, and the head's
    weight, recorded from the model's cache-free forward."""
    calls, head = [], []
    linear, project_head = model.linear, model.project_head
    model.linear = lambda x, w, b=None: (calls.append((w, b)), linear(x, w, b))[1]
    model.project_head = lambda x, w: (head.append(w), project_head(x, w))[1]
    try:
        model.forward(torch.zeros(1, 1, dtype=torch.long))
    finally:
        del model.linear, model.project_head  # the class's methods again
    return calls, head[0]


def run_bound(model, rows: int, peak_flops: float, prompt_lengths: list[int], sample_lengths: list[list[int]],
              reps: int = 5) -> Bound:
    """The bound for a finished run.

    model: the engine's CausalLM; rows: samples decoded together (the batch a step runs);
    peak_flops: the machine's GEMM peak (FLOP/s); prompt_lengths[i]: tokens of prompt i;
    sample_lengths[i]: generated tokens of each sample of prompt i.
    """
    calls, head = step_gemms(model)
    with torch.no_grad():
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in calls + [(head, None)]}
        gemm_s = sum(best_seconds(lambda w=w, b=b: model.linear(xs[w.shape[1]], w, b), reps) for w, b in calls)
        gemm_s += best_seconds(lambda: model.project_head(xs[head.shape[1]], head), reps)
    body = sum(w.numel() for w, _ in calls)  # multiply-adds per token outside the head
    info = model.info
    kv_token = 2 * info.n_layer * info.n_kv_head * info.head_dim * torch.empty((), dtype=model.kv_dtype).element_size()
    kv_bytes = 0
    for p, lens in zip(prompt_lengths, sample_lengths):
        kv_bytes += p * max(lens, default=0)               # the prompt, once per step of its cohort
        kv_bytes += sum(n * (n - 1) // 2 for n in lens)    # each sample's own tokens, every step
    tokens, bw = sum(map(sum, sample_lengths)), read_bandwidth()
    return Bound(gemm_flops_per_token=2 * (body + head.numel()),
                 read_bytes_per_s=bw, tokens=tokens,
                 prefill_s=(2 * body * sum(prompt_lengths) + 2 * head.numel() * len(prompt_lengths)) / peak_flops,
                 kv_read_s=kv_bytes * kv_token / bw, decode_gemm_s=tokens * gemm_s / rows)
