"""Weights into a GenerationPool of 2 workers: `update_weights` from the bench process's state
dict (buckets through Ray's object store) against `load_weights` from a checkpoint directory
and against starting a new pool; wall time and peak host memory of each.

Models: SmolLM2-135M (the built-in GGUF file, dequantized, written as a Hugging Face
directory) and a random Llama of about 1B parameters in float32 (transformers'
save_pretrained). The state dict sent is the directory's own (read back with safetensors, as
a trainer holds its weights), so every swap leaves the same weights: the rows generated after
each swap are checked equal to those of the freshly started pool (tests/test_update_weights.py
checks other weights bit for bit). "save+load" adds what a trainer pays to write the
checkpoint that load_weights reads (safetensors' save_file of the same state dict). The
state dict is memory-mapped from the checkpoint file (`mapped_state_dict`), so that two
workers and the "trainer" fit a 24 GB machine shared with other work.

Memory: the proportional set size (PSS, shared pages split between the processes mapping
them) summed over this process and every process Ray started under it (raylet, object
store, workers), sampled every 50 ms; "peak" is the highest sum during the operation and
"+peak" its rise over the sum just before. The object store's buckets live in /dev/shm and
count in the processes that map them; a checkpoint's pages read through a memory map count
in the workers while mapped (page cache, not anonymous memory).

    python bench/bench_weight_sync.py [--models smollm2,llama-1b] [--layers 18] [--repeat 3] [--bucket-mb 512]

Each swap runs `repeat` times; the first of each kind touches memory fresh (the object store's
pages for update_weights' buckets; later updates reuse the pages the update before last freed),
so the ratios compare the medians of the later calls, and every call's time is printed.

Machines are noisy (and shared): compare the ratios of one run.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [[1, 420, 2340, 300, 17, 9], [1, 5, 6, 7, 8, 9, 10, 11]]
GIB = 1 << 30


class MemorySampler:
    """Sum of PSS over this process and its descendants, sampled on a thread."""

    def __init__(self, period_s: float = 0.05):
        import psutil

        self.me = psutil.Process()
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> int:
        import psutil

        total = 0
        for p in [self.me] + self.me.children(recursive=True):
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return total

    def __enter__(self) -> "MemorySampler":
        self.before = self.peak = self.now()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _timed(fn, repeat: int) -> tuple[list[float], int, int]:
    """(seconds of each of `repeat` calls, highest peak PSS, highest rise over the start)."""
    times, peaks, rises = [], [], []
    for _ in range(repeat):
        gc.collect()
        with MemorySampler() as m:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        peaks.append(m.peak)
        rises.append(m.peak - m.before)
    return times, max(peaks), max(rises)


def mapped_state_dict(path: Path) -> dict:
    """A safetensors file's tensors as read-only views of its memory map (page cache, not
    anonymous memory: the bench's "trainer" then fits beside two workers on a 24 GB machine
    shared with other work; reading them costs what reading a trainer's tensors does once
    the file is cached)."""
    import mmap
    import struct
    import warnings

    import torch

    from engine.loading.tensor_files import _ST_DTYPES

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    n = struct.unpack("<Q", mm[:8])[0]
    header = json.loads(mm[8:8 + n])
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only: only read
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            dtype = _ST_DTYPES[info["dtype"]]
            count = (b - a) // torch.tensor([], dtype=dtype).element_size()
            t = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + a) if count else torch.empty(0, dtype=dtype)
            out[name] = t.view(info["shape"])
    return out


def write_smollm2(d: Path) -> Path:
    """SmolLM2-135M's GGUF weights (dequantized to float32) as a Hugging Face directory."""
    from safetensors.torch import save_file

    from engine.loading.builtin import resolve_builtin
    from engine.loading.gguf import read_gguf

    ck = read_gguf(resolve_builtin("smollm2"))
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(ck.config))
    save_file({k: v.contiguous() for k, v in ck.weights.items()}, str(d / "model.safetensors"))
    return d


def write_llama(d: Path, layers: int) -> Path:
    """A random Llama (TinyLlama's shape with SmolLM2's vocabulary, `layers` layers, untied head), float32."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(d)
    del model
    return d


def bench_model(name: str, directory: Path, tokenizer: str, repeat: int, bucket_bytes: int) -> dict:
    import ray
    from safetensors.torch import save_file

    from jobs import GenerationPool

    n_params = sum(t.numel() for t in mapped_state_dict(directory / "model.safetensors").values())
    config = {"model": {"path": str(directory), "tokenizer": tokenizer, "dtype": "float32", "max_seq_len": 256,
                        "max_num_seqs": 8, "kv_cache_gb": 0.1},
              "sampling": {"num_samples": 2, "max_tokens": 8, "temperature": 0.0, "seed": 0, "stop_token_ids": []},
              "cluster": {"num_workers": 2}}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=max(4 * bucket_bytes, 1 << 30),  # two buckets in flight, with room
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        holder = {}
        start_s, start_peak, start_rise = _timed(lambda: holder.update(pool=GenerationPool(config)), 1)
        pool = holder["pool"]
        try:
            before = pool.generate(PROMPTS, {"seed": 0})
            pids = sorted(s["pid"] for s in pool.engine_states())
            state_dict = mapped_state_dict(directory / "model.safetensors")  # the trainer's tensors
            for t in state_dict.values():  # in the page cache, as a trainer's are in memory
                t.sum()
            up_s, up_peak, up_rise = _timed(lambda: pool.update_weights(state_dict, bucket_bytes=bucket_bytes), repeat)
            assert pool.generate(PROMPTS, {"seed": 0}).equals(before)
            load_s, load_peak, load_rise = _timed(lambda: pool.load_weights(str(directory)), repeat)
            assert pool.generate(PROMPTS, {"seed": 0}).equals(before)
            out = Path(tempfile.mkdtemp(prefix="bench-save-"))
            save_s, _, _ = _timed(lambda: save_file(state_dict, str(out / "model.safetensors")), 1)
            assert sorted(s["pid"] for s in pool.engine_states()) == pids
        finally:
            pool.close()
    finally:
        ray.shutdown()
    up, load = statistics.median(up_s[1:] or up_s), statistics.median(load_s[1:] or load_s)
    start, save = start_s[0], save_s[0]
    show = lambda ts: " ".join(f"{t:.2f}" for t in ts)  # noqa: E731
    print(f"{name} ({n_params / 1e6:.0f}M params, float32, {n_params * 4 / GIB:.2f} GiB), 2 workers; "
          f"seconds of each of {repeat} calls, ratios of the median after the first:")
    print(f"  update_weights {show(up_s):>18} s  peak {up_peak / GIB:5.2f} GiB (+{up_rise / GIB:.2f})")
    print(f"  load_weights   {show(load_s):>18} s  peak {load_peak / GIB:5.2f} GiB (+{load_rise / GIB:.2f})   "
          f"{load / up:.1f}x update_weights; with the trainer's save ({save:.2f} s): {(load + save) / up:.1f}x")
    print(f"  new pool       {start:18.2f} s  peak {start_peak / GIB:5.2f} GiB (+{start_rise / GIB:.2f})   "
          f"{start / up:.1f}x update_weights")
    print("  rows after every swap equal the new pool's: yes; worker pids unchanged: yes", flush=True)
    return dict(model=name, params=n_params, start_s=start, update_s=up_s, load_s=load_s, save_s=save,
                start_peak=start_peak, update_peak=up_peak, load_peak=load_peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,llama-1b")
    ap.add_argument("--layers", type=int, default=18, help="layers of the random Llama (18: about 1.0B parameters)")
    ap.add_argument("--repeat", type=int, default=3, help="calls of each swap (the first touches new memory)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    args = ap.parse_args()
    from machine import describe

    from engine.loading.builtin import resolve_builtin

    print(describe())
    tokenizer = str(resolve_builtin("smollm2"))  # a GGUF file's vocabulary: 49152 tokens, enough for both
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            d = write_smollm2(Path(tmp) / name) if name == "smollm2" else write_llama(Path(tmp) / name, args.layers)
            print(f"{name}: checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
            bench_model(name, d, tokenizer, args.repeat, args.bucket_mb << 20)
            gc.collect()


if __name__ == "__main__":
    main()
