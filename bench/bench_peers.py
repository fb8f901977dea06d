"""batchgen against two peer CPU inference engines, llama.cpp and CTranslate2, on the workloads
of bench_smollm2.py and bench_rl.py, the same weights and the same token ids.

Systems (--systems picks a subset):
- batchgen: `load_engine("smollm2", device="cpu", dtype=--dtype)` and `eng.generate`, as the
  other benches run it; it runs before the peers and again after them (reloaded), and its rate
  is the mean of the two (the machine's speed drifts over the minutes the peers run);
- llama-q4_1: llama.cpp (through llama-cpp-python's low-level API) on the SmolLM2 GGUF file
  itself (Q4_1, token embedding Q8_0);
- llama-f32: llama.cpp on an F32 GGUF written from that file (every tensor dequantized, the
  metadata and llama.cpp's tensor layout kept);
- ct2-f32 and ct2-int8: CTranslate2's Generator on the same weights (transformers loads the GGUF
  file, saves a Hugging Face directory, CTranslate2's converter converts it, to float32 and to
  int8).
llama.cpp runs through llama-cpp-python's bindings of llama.h (see LlamaBatched): each prompt
prefilled once into one sequence, its KV copied to its samples' sequences (`llama_memory_seq_cp`),
a prompt that begins like an earlier one taking that prompt's KV for their common prefix and
prefilling only the rest (as batchgen's prefix caching does; --llama-no-prefix-reuse prefills
every prompt whole), then one token per live sample per `llama_decode` call, all 128 samples of a workload in one
batch, each sample with its own sampler chain (top-k, temperature, seeded dist), 2 threads for
prefill and decode. CTranslate2 gets `generate_batch(num_hypotheses=num_samples)`, which
forwards each prompt once and repeats its state for the hypotheses, over all prompts at once or
in length-sorted batches of --ct2-batch prompts.

Workloads (--workload):
- smollm2: the first 32 GSM8K test questions (jobs/data/gsm8k_demo.jsonl) rendered with the
  model's chat template, num_samples=4, max_tokens=128, temperature 1, top_k 50;
- rl: 8 GSM8K test questions behind the 8-shot prefix of bench_rl.py (needs ../shared/data),
  num_samples=16, max_tokens=256, temperature 1, the full vocabulary (no top-k / top-p).
The prompts are batchgen's token ids; no peer re-tokenizes anything (CTranslate2 takes token
strings, mapped one to one from those ids and checked against its vocabulary). Every system
counts generated tokens up to and including the first stop token (<|im_end|>, batchgen's
default stop ids) and stops a sample there; tokens/s = generated tokens / wall seconds of the
generation call(s): loading, conversion and context allocation are not timed, and one short
warm-up call runs first. 2 threads everywhere (--threads). At the end it prints, per workload,
the best peer and batchgen's rate over that peer's. The first line names the CPU and the ISA
torch and batchgen use; the peers' lines say what they were built for. Machines are noisy:
compare ratios from one run.

The peers are optional (a missing one is skipped with a line saying so):

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # builds llama.cpp, ~10 min on 2 cores
    pip install ctranslate2

Converted files are cached under --cache-dir (default ~/.cache/batchgen/peers) and reused.
--check compares, for llama.cpp, greedy output of the batched driver (every sample of a few
prompts, their KV copied from the prompt's sequence) with llama-cpp-python's own one-sequence
greedy generation (`Llama.generate`) on the same ids, for both GGUF files, and exits.

    python bench/bench_peers.py [--workload smollm2|rl|both] [--systems llama-f32,llama-q4_1,ct2-f32,ct2-int8,batchgen]
                                [--threads 2] [--prompts N] [--max-tokens N] [--dtype auto] [--cache-dir DIR]
                                [--llama-kv split|unified] [--llama-no-prefix-reuse] [--ct2-batch N] [--check]
                                [--model smollm2|FILE.gguf]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QUESTIONS = ROOT / "jobs" / "data" / "gsm8k_demo.jsonl"  # the first 64 GSM8K test questions (MIT)
SHARED = ROOT.parent / "shared" / "data"

from bench_rl import few_shot_prefix  # noqa: E402  (bench/ is the script's directory)
from machine import describe  # noqa: E402

PEERS = ("llama-f32", "llama-q4_1", "ct2-f32", "ct2-int8")
SYSTEMS = ("batchgen",) + PEERS


@dataclass
class Workload:
    """One benchmark shape: batchgen's prompt ids and how to sample them."""
    name: str
    prompts: list[list[int]]
    num_samples: int
    max_tokens: int
    top_k: int  # 0: the full vocabulary
    stop: list[int]

    def describe(self) -> str:
        lens = sorted(map(len, self.prompts))
        return (f"{self.name}: {len(self.prompts)} prompts of {lens[0]}-{lens[-1]} tokens x {self.num_samples} samples, "
                f"max_tokens={self.max_tokens}, temperature 1, "
                f"{f'top_k {self.top_k}' if self.top_k else 'full vocabulary'}, stop ids {self.stop}")


def count_generated(tokens: list[int], stop: list[int], max_tokens: int) -> int:
    """Generated tokens as every system counts them: up to and including the first stop token."""
    for i, t in enumerate(tokens[:max_tokens]):
        if t in stop:
            return i + 1
    return min(len(tokens), max_tokens)


def build_workloads(args, tok, stop: list[int]) -> list[Workload]:
    """The prompts of bench_smollm2.py and bench_rl.py, rendered by batchgen's tokenizer."""
    out = []
    if args.workload in ("smollm2", "both"):
        questions = [json.loads(line)["question"] for line in QUESTIONS.open()][: args.prompts or 32]
        prompts = [tok.render_chat([{"role": "user", "content": q}]) for q in questions]
        out.append(Workload("smollm2", prompts, 4, args.max_tokens or 128, 50, stop))
    if args.workload in ("rl", "both"):
        train, test = args.data / "gsm8k" / "train.jsonl", args.data / "gsm8k" / "test.jsonl"
        if not train.exists() or not test.exists():
            sys.exit(f"the rl workload needs ../shared/data beside the checkout, or --data ({train}, {test})")
        prefix = few_shot_prefix(train)
        questions = [json.loads(line)["question"] for line in test.open()][: args.prompts or 8]
        prompts = [tok.render_chat([{"role": "user", "content": f"{prefix}Question: {q}\nAnswer:"}])
                   for q in questions]
        out.append(Workload("rl", prompts, 16, args.max_tokens or 256, 0, stop))
    return out


def free_memory() -> None:
    """Return freed memory before the next system runs, so no system pays for another's."""
    gc.collect()


# ---------------------------------------------------------------------------------------------
# The peers' model files, made once from the installed GGUF file and cached.

def f32_gguf(src: Path, cache: Path) -> Path:
    """An F32 copy of the GGUF file `src`: every key/value copied, every tensor dequantized to
    float32 under its own name and in llama.cpp's layout (the q/k rows stay permuted as
    llama.cpp's converter wrote them: llama.cpp reads this file, not transformers). `src`
    itself where every tensor is F32 already (bench/standin.py's GGUF)."""
    import gguf

    reader = gguf.GGUFReader(src)
    if all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors):
        return src
    out = cache / (src.stem.replace("Q4_1", "") + "F32.gguf").replace("..", ".")
    if out.exists():
        return out
    from standin import write_f32_gguf  # bench/ is the script's directory

    print(f"writing {out} (dequantizing {src.name})", flush=True)
    write_f32_gguf(out, reader, ((t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False))
                                 for t in reader.tensors))
    return out


def q4_1_gguf(src: Path, cache: Path, threads: int) -> Path:
    """`src` where it is a Q4_1 file (the installed SmolLM2), else its Q4_1 quantization by
    llama.cpp's own quantizer (`llama_model_quantize`, its default choices per tensor)."""
    import gguf

    reader = gguf.GGUFReader(src)
    if any(t.tensor_type == gguf.GGMLQuantizationType.Q4_1 for t in reader.tensors):
        return src
    out = cache / f"{src.stem}-Q4_1.gguf"
    if out.exists():
        return out
    import ctypes

    import llama_cpp

    print(f"writing {out} (llama.cpp's quantizer)", flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, threads
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not quantize {src}")
    tmp.rename(out)
    return out


def ct2_model(src: Path, cache: Path, quantization: str | None) -> Path:
    """A CTranslate2 model directory (float32 when quantization is None, else int8) converted
    from the weights transformers reads out of the GGUF file, with its tokenizer."""
    out = cache / f"ct2-{src.stem}-{quantization or 'float32'}"
    if (out / "model.bin").exists():
        return out
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {src.name} to CTranslate2 ({quantization or 'float32'}) in {out}", flush=True)
    with tempfile.TemporaryDirectory() as hf_dir:
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it, though it
        # only dequantized at load: the layers are plain float32 Linear modules. Unmark it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf_dir)
        AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(hf_dir)
        del model
        TransformersConverter(hf_dir).convert(str(out), quantization=quantization, force=True)
    return out


# ---------------------------------------------------------------------------------------------
# llama.cpp through llama-cpp-python's ctypes bindings of llama.h

class LlamaBatched:
    """Batched sampling on llama.cpp: every prompt prefilled once, its KV copied to its samples'
    sequences, then one decode call per step for all live samples of a group of prompts.

    kv="split" (the default) gives each sequence its own stream of KV cells (llama.cpp's
    kv_unified=false): copying a prompt to a sample copies the stream's data, and a sample's
    attention reads only its own cells. kv="unified" is one buffer for all sequences, as
    llama.cpp's batched example sizes it (prompt + samples x new tokens): a copy only tags the
    prompt's cells with the sample's sequence id, so each prompt is stored once, but every
    decode step's attention runs over all the cells in use, masked per sequence: with 128
    sequences on bench_smollm2's workload that ran more than ten times slower than split.
    """

    def __init__(self, path: Path, threads: int, max_seqs: int, n_ctx: int, n_batch: int, kv: str = "split",
                 prefix_reuse: bool = True):
        import llama_cpp as L

        self.L, self.kv, self.max_seqs = L, kv, max_seqs
        self.prefix_reuse = prefix_reuse and kv == "split"
        self.reused = 0  # prompt positions copied from another prompt's stream instead of prefilled
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx  # split: rounded to max_seqs streams of n_ctx / max_seqs cells each
        cp.n_batch = n_batch  # the most tokens one llama_decode call takes
        cp.n_ubatch = min(n_batch, 512)
        cp.n_seq_max = max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = kv == "unified"
        # what "auto" picks on a CPU, named so that --check's one-sequence reference uses the
        # same attention kernel; it also skips the masked cells of other sequences
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} cells")
        self.n_batch = n_batch
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        # Zero the KV buffer once, so that its pages are touched here and not in a timed run.
        L.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _sampler(self, top_k: int, temperature: float, seed: int):
        """A sampler chain as llama.cpp's examples build one: greedy at temperature 0, else
        top-k (when set), temperature and a seeded draw."""
        L = self.L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if temperature == 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if top_k:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(top_k))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
        return chain

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode call over (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1: no room in the KV cache)")

    def _compact(self, live: list[int], done: list[bool]) -> list[int]:
        """The live samples after a step, in slots 0..n-1 (live[slot] is the sample whose KV is
        sequence `slot`).

        A split KV cache decodes a batch in one piece only while its sequence ids run
        consecutively (llama.cpp cuts a ubatch at every gap), so when samples finish, the
        highest live slots move down into the freed ones: one copy of a sequence's stream each,
        as many in all as there are samples. In a unified cache a move only retags cells."""
        L, lo, hi = self.L, 0, len(live) - 1
        while True:
            while lo < len(live) and not done[live[lo]]:
                lo += 1
            while hi >= 0 and done[live[hi]]:
                hi -= 1
            if lo >= hi:
                break
            L.llama_memory_seq_rm(self.mem, lo, -1, -1)  # the finished sample's cells
            L.llama_memory_seq_cp(self.mem, hi, lo, -1, -1)
            L.llama_memory_seq_rm(self.mem, hi, -1, -1)
            live[lo], live[hi] = live[hi], live[lo]
        return [s for s in live if not done[s]]

    def generate(self, prompts: list[list[int]], num_samples: int, max_tokens: int, top_k: int,
                 temperature: float, stop: list[int], seed: int = 0) -> list[list[list[int]]]:
        """Each prompt's num_samples continuations (token ids, the stop token kept)."""
        L = self.L
        per_group = max(1, self.max_seqs // num_samples)
        results: list[list[list[int]]] = []
        for g in range(0, len(prompts), per_group):
            group = prompts[g:g + per_group]
            L.llama_memory_clear(self.mem, False)  # forget the cells; the buffer needs no zeroing
            n = len(group) * num_samples  # sequence s is sample s % num_samples of prompt s // num_samples
            samplers = [self._sampler(top_k, temperature, seed + g * num_samples + s) for s in range(n)]
            out: list[list[int]] = [[] for _ in range(n)]
            done = [False] * n

            def take(s: int, batch_index: int) -> None:
                t = L.llama_sampler_sample(samplers[s], self.ctx, batch_index)  # also accepts t into the chain
                out[s].append(t)
                done[s] = t in stop or len(out[s]) >= max_tokens

            # Prefill. Unified: as many whole prompts per call as n_batch holds (their sequences
            # do not see each other). Split: one prompt per call, since a split batch needs the
            # same number of tokens from every sequence in it; with prefix_reuse a prompt that
            # begins like an earlier prompt of the group takes that prompt's stream (a split
            # cache copies whole streams), drops the cells past their common prefix and is
            # prefilled from there (batchgen's prefix caching, engine/prefix_cache.py).
            i = 0
            while i < len(group):
                entries, lasts = [], []
                while i < len(group) and (not entries or (self.kv == "unified" and
                                                          len(entries) + len(group[i]) <= self.n_batch)):
                    p, seq0 = group[i], i * num_samples
                    start = 0
                    if self.prefix_reuse and i > 0:
                        common = [next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
                                  for q in group[:i]]
                        j = max(range(i), key=common.__getitem__)
                        start = min(common[j], len(p) - 1)
                        if start > 0:
                            L.llama_memory_seq_cp(self.mem, j * num_samples, seq0, -1, -1)
                            L.llama_memory_seq_rm(self.mem, seq0, start, -1)
                            self.reused += start
                    entries += [(t, pos, seq0, pos == len(p) - 1) for pos, t in enumerate(p) if pos >= start]
                    lasts.append((i, len(entries) - 1))
                    i += 1
                self._decode(entries)
                for k, idx in lasts:
                    seq0 = k * num_samples
                    for s in range(seq0, seq0 + num_samples):
                        take(s, idx)  # every sample's first token, from the prompt's own logits
                        if s != seq0:  # the prompt's KV, copied to the sample's sequence
                            L.llama_memory_seq_cp(self.mem, seq0, s, -1, -1)
            # Decode: one token for each live sample per call. live[slot] is the sample whose KV
            # is sequence `slot`; samples start in their own slots.
            live = self._compact(list(range(n)), done)
            while live:
                self._decode([(out[s][-1], len(group[s // num_samples]) + len(out[s]) - 1, slot, True)
                              for slot, s in enumerate(live)])
                for slot, s in enumerate(live):
                    take(s, slot)
                live = self._compact(live, done)
            for smpl in samplers:
                L.llama_sampler_free(smpl)
            results += [out[k * num_samples:(k + 1) * num_samples] for k in range(len(group))]
        return results


def llama_runner(path: Path, wl: Workload, args) -> LlamaBatched:
    """A context sized for one group of wl's prompts with all their samples."""
    per_group = max(1, args.llama_seqs // wl.num_samples)
    n_seqs = per_group * wl.num_samples
    longest = max(map(len, wl.prompts))
    if args.llama_kv == "unified":  # each prompt once, plus every sample's new tokens
        lens = sorted(map(len, wl.prompts), reverse=True)[:per_group]
        n_ctx = sum(lens) + n_seqs * wl.max_tokens + 256
    else:  # a stream per sequence, each holding the longest prompt and its new tokens
        n_ctx = n_seqs * (-(-(longest + wl.max_tokens) // 256) * 256)
    n_batch = max(512, n_seqs, longest)
    return LlamaBatched(path, args.threads, n_seqs, n_ctx, n_batch, kv=args.llama_kv,
                        prefix_reuse=not args.llama_no_prefix_reuse)


def run_llama(name: str, path: Path, wl: Workload, args) -> tuple[int, float]:
    """(generated tokens, seconds) for llama.cpp on wl."""
    runner = llama_runner(path, wl, args)
    try:
        runner.generate([wl.prompts[0][:16]], 2, 4, wl.top_k, 1.0, wl.stop, seed=1234)  # warm-up
        t0 = time.perf_counter()
        reused = runner.reused
        res = runner.generate(wl.prompts, wl.num_samples, wl.max_tokens, wl.top_k, 1.0, wl.stop, seed=0)
        dt = time.perf_counter() - t0
        if runner.prefix_reuse:
            print(f"  {name}: {runner.reused - reused} prompt positions copied from an earlier prompt's stream")
    finally:
        runner.close()
    return sum(count_generated(s, wl.stop, wl.max_tokens) for row in res for s in row), dt


def llama_check(path: Path, wl: Workload, args, n_prompts: int, stop: list[int], tokens: int = 64) -> bool:
    """Greedy output of the batched driver (every sample of the first n_prompts prompts) against
    llama-cpp-python's own one-sequence generation (Llama.generate, greedy) on the same ids.

    Every sample equal to the reference shows that the prompt's KV reached each sample's
    sequence and, where prompts stop at different steps, that sequences moved between slots
    kept theirs. llama.cpp's quantized matrix products round differently for one row than for
    several, so on a quantized file a greedy run can part from the one-row reference at a near
    tie; such a prompt passes when all its samples agree with each other and the same driver
    with one sample (one row per step) reproduces the reference."""
    import llama_cpp

    def differs_at(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def batched_run(prompts: list[list[int]], num_samples: int) -> list[list[list[int]]]:
        runner = llama_runner(path, wl, args)
        try:
            return runner.generate(prompts, num_samples, tokens, 0, 0.0, stop)
        finally:
            runner.close()

    sub = wl.prompts[:n_prompts]
    batched = batched_run(sub, wl.num_samples)
    ok = True
    for k, p in enumerate(sub):
        # a fresh Llama per prompt: reusing one, its prefix-matching generate() gave other
        # tokens for a later prompt than a fresh instance did
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(p) + tokens + 16, n_batch=512, n_threads=args.threads,
                              n_threads_batch=args.threads, flash_attn=True, verbose=False)
        ref: list[int] = []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            ref.append(t)
            if t in stop or len(ref) >= tokens:
                break
        del llm
        samples = batched[k]
        line = f"  {path.name} prompt {k} ({len(p)} tokens): one-sequence run {len(ref)} tokens; "
        if all(s == ref for s in samples):
            print(line + f"all {len(samples)} samples the same")
            continue
        agree = all(s == samples[0] for s in samples)
        (alone,) = batched_run([p], 1)[0]
        passed = agree and alone == ref
        ok &= passed
        print(line + f"samples {'all equal, ' if agree else 'NOT equal, '}differing from it at token "
              f"{sorted({differs_at(s, ref) for s in samples})}; one sample alone "
              f"{'the same' if alone == ref else f'DIFFERENT at token {differs_at(alone, ref)}'}"
              f"{'' if passed else ' -- FAILED'}")
    return ok


# ---------------------------------------------------------------------------------------------
# CTranslate2

def run_ct2(model_dir: Path, compute_type: str, wl: Workload, tokens_of, args) -> tuple[int, float]:
    """(generated tokens, seconds) for CTranslate2's Generator on wl: one generate_batch call with
    all prompts, num_hypotheses samples each."""
    import ctranslate2

    # CTranslate2 names the ISA it dispatches to at INFO level, when the model loads
    ctranslate2.set_log_level(logging.INFO)
    gen = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=compute_type, inter_threads=1,
                                intra_threads=args.threads)
    ctranslate2.set_log_level(logging.WARNING)
    vocab = json.loads((model_dir / "vocabulary.json").read_text())
    prompts = [tokens_of(p) for p in wl.prompts]
    for p, strs in zip(wl.prompts, prompts):  # CTranslate2 maps these strings back to batchgen's ids
        assert [vocab[i] for i in p] == strs, "CTranslate2's vocabulary does not match batchgen's ids"
    end = tokens_of(wl.stop)
    opts = dict(sampling_topk=wl.top_k,  # 0: CTranslate2 draws from the full distribution
                sampling_temperature=1.0, end_token=end, return_end_token=True, include_prompt_in_result=False)
    try:
        gen.generate_batch([prompts[0][:16]], max_length=4, num_hypotheses=2, **opts)  # warm-up
        ctranslate2.set_random_seed(0)
        t0 = time.perf_counter()
        res = gen.generate_batch(prompts, max_length=wl.max_tokens, num_hypotheses=wl.num_samples,
                                 max_batch_size=args.ct2_batch, **opts)
        dt = time.perf_counter() - t0
    finally:
        del gen
    return sum(count_generated(s, wl.stop, wl.max_tokens) for r in res for s in r.sequences_ids), dt


# ---------------------------------------------------------------------------------------------
# batchgen

def run_batchgen(wl: Workload, args) -> tuple[int, float, list]:
    """(generated tokens, seconds, tokens) for batchgen on wl, as bench_smollm2 / bench_rl run it."""
    from engine import SamplingParams, load_engine

    eng = load_engine(args.model, device="cpu", dtype=args.dtype)
    params = SamplingParams(num_samples=wl.num_samples, max_tokens=wl.max_tokens, temperature=1.0, top_k=wl.top_k,
                            seed=0)
    eng.generate([wl.prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up (weights packed)
    t0 = time.perf_counter()
    res = eng.generate(wl.prompts, params)
    dt = time.perf_counter() - t0
    tokens = [[s.tokens for s in row] for row in res]
    del eng, res
    free_memory()
    return sum(count_generated(s, wl.stop, wl.max_tokens) for row in tokens for s in row), dt, tokens


# ---------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("smollm2", "rl", "both"), default="both")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per workload (default: 32 smollm2, 8 rl)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 128 smollm2, 256 rl")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="batchgen's dtype")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "batchgen" / "peers")
    ap.add_argument("--data", type=Path, default=SHARED, help="directory with gsm8k/train.jsonl and test.jsonl")
    ap.add_argument("--llama-kv", choices=("unified", "split"), default="split",
                    help="llama.cpp's KV layout (see LlamaBatched)")
    ap.add_argument("--llama-seqs", type=int, default=128, help="llama.cpp sequences decoded together")
    ap.add_argument("--llama-no-prefix-reuse", action="store_true",
                    help="llama.cpp prefills every prompt whole (default: a prompt copies the common prefix of "
                         "an earlier one in its group, as batchgen's prefix caching does)")
    ap.add_argument("--ct2-batch", type=int, default=0,
                    help="CTranslate2's max_batch_size in prompts (0: all prompts in one batch)")
    ap.add_argument("--check", action="store_true", help="check llama.cpp's batched driver against greedy, and exit")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the installed Q4_1 GGUF), or another SmolLM2-shaped GGUF file every system "
                         "reads: bench/standin.py's F32 one (llama-q4_1 then runs llama.cpp's Q4_1 quantization of it)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(systems) - set(SYSTEMS):
        sys.exit(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    torch.set_num_threads(args.threads)
    print(describe())

    from engine import load_engine
    from engine.loading.builtin import smollm2_path

    # batchgen's tokenizer makes every system's token ids, and its engine names the stop ids
    eng = load_engine(args.model, device="cpu", dtype="float32")
    stop = sorted(eng.default_stop_ids)
    workloads = build_workloads(args, eng.tokenizer, stop)
    (newline,) = eng.tokenizer.encode("\n")  # --check's second stop token
    del eng
    src = smollm2_path() if args.model == "smollm2" else Path(args.model)
    args.cache_dir.mkdir(parents=True, exist_ok=True)

    have_llama = have_ct2 = False
    if any(s.startswith("llama") for s in systems) or args.check:
        try:
            import llama_cpp
            have_llama = True
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's load and context logs
            print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}; "
                  f"{llama_cpp.llama_print_system_info().decode().strip()}")
        except ImportError as e:
            print(f"llama.cpp: skipped, llama_cpp is not importable ({e}); pip install llama-cpp-python")
    if any(s.startswith("ct2") for s in systems) and not args.check:
        try:
            import ctranslate2
            have_ct2 = True
            print(f"CTranslate2 {ctranslate2.__version__}: CPU compute types "
                  f"{sorted(ctranslate2.get_supported_compute_types('cpu'))}")
        except ImportError as e:
            print(f"CTranslate2: skipped, ctranslate2 is not importable ({e}); pip install ctranslate2")

    # the peers' files, made before anything is timed
    files: dict[str, Path] = {}
    if have_llama:
        if "llama-q4_1" in systems or args.check:
            files["llama-q4_1"] = q4_1_gguf(src, args.cache_dir, args.threads)
        if "llama-f32" in systems or args.check:
            files["llama-f32"] = f32_gguf(src, args.cache_dir)
    tokens_of = None
    if have_ct2:
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tokens_of = hf_tok.convert_ids_to_tokens
        for name, quant in (("ct2-f32", None), ("ct2-int8", "int8")):
            if name in systems:
                files[name] = ct2_model(src, args.cache_dir, quant)
        del hf_tok
    free_memory()

    if args.check:
        if not have_llama:
            sys.exit("--check needs llama_cpp")
        ok = True
        for wl in workloads:
            # the second pass stops at a newline too, so prompts end at different steps
            for n_prompts, stop in ((2, wl.stop), (4, wl.stop + [newline])):
                print(f"check: {wl.name} prompts, {wl.num_samples} samples each, greedy, at most 64 tokens, "
                      f"stop ids {stop}, llama.cpp KV {args.llama_kv}")
                for name in ("llama-f32", "llama-q4_1"):
                    ok &= llama_check(files[name], wl, args, n_prompts, stop)
        print("check: " + ("passed" if ok else "FAILED"))
        sys.exit(0 if ok else 1)

    summary = []
    for wl in workloads:
        print(f"workload {wl.describe()}", flush=True)
        rates: dict[str, float] = {}

        def report(name: str, n: int, dt: float) -> float:
            print(f"  {name:<22} {n:>6} tokens {dt:>7.1f} s {n / dt:>7.1f} tokens/s", flush=True)
            return n / dt

        batchgen_runs = []
        if "batchgen" in systems:
            n, dt, first = run_batchgen(wl, args)
            batchgen_runs.append(report(f"batchgen ({args.dtype}) run 1", n, dt))
        for name in PEERS:
            if name not in systems or name not in files:
                continue
            if name.startswith("llama"):
                n, dt = run_llama(name, files[name], wl, args)
            else:
                n, dt = run_ct2(files[name], "float32" if name == "ct2-f32" else "int8", wl, tokens_of, args)
            free_memory()
            rates[name] = report(name, n, dt)
        if "batchgen" in systems:
            n, dt, second = run_batchgen(wl, args)
            batchgen_runs.append(report(f"batchgen ({args.dtype}) run 2", n, dt))
            print(f"  batchgen's two runs gave {'the same' if first == second else 'DIFFERENT'} tokens")
            rates["batchgen"] = sum(batchgen_runs) / 2
        summary.append((wl, rates))

    print("summary (tokens/s; batchgen: mean of its runs before and after the peers):")
    for wl, rates in summary:
        peers = {k: v for k, v in rates.items() if k != "batchgen"}
        line = f"  {wl.name}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
        if peers and "batchgen" in rates:
            best = max(peers, key=peers.get)
            line += f"; best peer {best} {peers[best]:.1f}; batchgen / best peer = {rates['batchgen'] / peers[best]:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
