"""What machine a benchmark ran on: the CPU model, the vector instruction sets it has, the ones
torch and batchgen's compiled kernels use, and the thread count. Every bench prints this line
first, so a figure can be traced to its machine (the README's performance figures carry it).
"""
from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags worth naming, in order of appearance in the line
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The flags of _FLAGS this CPU reports (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _FLAGS if f in have]
    except OSError:
        pass
    return []


def describe() -> str:
    """One line: CPU model, its flags, torch's CPU capability, the ISA of batchgen's compiled
    kernels (None where they are unavailable) and torch's thread count."""
    import torch

    try:
        from engine.kernels.native import native_isa
        isa = native_isa()
    except ImportError:
        isa = "unknown"
    return (f"machine: {cpu_model()} [{' '.join(cpu_flags()) or 'no x86 vector flags'}]; torch "
            f"{torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}; batchgen kernels: "
            f"{isa}; {torch.get_num_threads()} threads")


if __name__ == "__main__":
    print(describe())
