"""Building the compiled CPU kernels (engine/kernels/csrc/) for this machine's instruction set.

Instruction sets (`ISAS`, narrowest first): the library is built for one of
- `avx2`: x86-64 with AVX2 and FMA (Haswell, Zen 1-3);
- `avx512`: and AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake): 16-lane GEMM tiles;
- `avx512_bf16`: and AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4-5): bfloat16
  products with vdpbf16ps, which the other builds compute bit for bit with two fused
  multiply-adds;
- `amx`: and AMX-TILE, AMX-BF16 (Sapphire Rapids and later): bfloat16-weight GEMMs on AMX
  tiles (gemm_amx.cpp; float32 ones as in avx512_bf16), used only once verified
  (engine/kernels/amx_probe.py).
`supported_isas()` lists those the CPU has (CPUID flags, from /proc/cpuinfo) and torch's own
dispatch allows, so `ATEN_CPU_CAPABILITY=avx2` limits both.

The library is compiled with the system's C++ compiler (`$CXX`, else `c++`; no torch
headers; each source file in a process of its own, as many at once as this process may use
CPUs, then linked: about 20 s on 2 cores, decode_attention.cpp's templates the longest) into
a cache directory keyed by the sources' hash, the ISA's flags and the
compiler (`cache_dir()`: `$BATCHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/batchgen`, else
`~/.cache/batchgen`); processes that build at once each get a whole file. The machine's
one-time verdicts (the AMX probe's, `dtype: auto`'s) are kept in the same directory
(`cached_verdict`).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

CSRC = Path(__file__).parent / "csrc"  # every .cpp in it is compiled into one library; the .h are shared
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
# Narrowest first: each ISA's compiler flags and the /proc/cpuinfo flags it needs.
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "avx512": (("-mavx2", "-mfma", "-mf16c", *_AVX512), ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                                                         "avx512vl")),
    "avx512_bf16": (("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16"),
                    ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")),
    # the avx512_bf16 build plus gemm_amx.cpp's kernel for bfloat16 weights, used only once
    # verified (`amx_verdict`)
    "amx": (("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
            ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile",
             "amx_bf16")),
}


class Unavailable(Exception):
    """The library cannot be built or loaded here (the message says why)."""


def cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or "" where unreadable."""
    return next((line.split(":", 1)[1].strip() for line in cpuinfo_lines() if line.startswith("model name")), "")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where unreadable."""
    for line in cpuinfo_lines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_isas() -> list[str]:
    """The ISAs of `ISAS` this machine can run, narrowest first: what CPUID reports (on Linux;
    elsewhere, torch's CPU capability alone, without bf16), cut to what torch's own dispatch
    allows (`ATEN_CPU_CAPABILITY=avx2` leaves only `avx2`). Empty off x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    cap = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: trust torch's capability, which never reports bf16
        return {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(cap, [])
    out = [isa for isa, (_, need) in ISAS.items() if all(f in flags for f in need)]
    return out[:1] if cap == "AVX2" else out if cap == "AVX512" else []


def cache_dir() -> Path:
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return Path(os.environ["BATCHGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"


def cached_verdict(name: str, key: str, decide: Callable[[], dict]) -> dict:
    """A machine's one-time decision, kept as JSON in `cache_dir()`: the file
    `{name}-{sha256(key)[:16]}.json` when it reads back, else `decide()`'s dict, written
    there (atomically; an unwritable cache only means deciding again next time)."""
    path = cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    verdict = decide()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)
    except OSError:
        pass
    return verdict


def _run_compiler(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def build_library(isa: str, require_cpu: bool = True, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the shared library for `isa`, compiled if the cache lacks it (raises
    Unavailable). require_cpu=False builds for an ISA this CPU cannot run (to check that
    it compiles; loading it is safe, calling it is not); extra_flags: more compiler flags
    (tests: -DBATCHGEN_AMX_EMULATE), in the file's name and key."""
    if os.environ.get("BATCHGEN_NATIVE", "1") == "0":
        raise Unavailable("BATCHGEN_NATIVE=0")
    if require_cpu and isa not in supported_isas():
        raise Unavailable(f"this CPU does not run {isa} (it runs {supported_isas() or 'none of ' + str(list(ISAS))})")
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise Unavailable(f"no C++ compiler ({cxx})")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"{cxx} --version failed: {e}") from None
    sources = sorted(CSRC.glob("*.cpp"))
    flags = (*FLAGS, *ISAS[isa][0], *extra_flags)
    key = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in sources + sorted(CSRC.glob("*.h")))
                         + " ".join(flags).encode()
                         + version.encode()).hexdigest()[:16]
    tag = isa + "".join("-" + f.lstrip("-").split("=")[0].lower() for f in extra_flags)
    target = cache_dir() / f"batchgen_kernels-{tag}-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename into place: processes that build at once (the
        # workers of one machine) each get a whole file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            objects = [Path(tmp) / (f.stem + ".o") for f in sources]
            compile_flags = [f for f in flags if f != "-shared"]
            steps = [[cxx, *compile_flags, "-c", "-o", str(o), str(f)] for f, o in zip(sources, objects)]
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            with ThreadPoolExecutor(max_workers=max(1, min(len(steps), cpus))) as pool:
                compiled = list(pool.map(_run_compiler, steps))
            failed = [r for r in compiled if r.returncode != 0]
            if not failed:  # link
                failed = [r for r in [_run_compiler([cxx, *flags, "-o", str(out), *map(str, objects)])] if r.returncode]
            if failed:
                raise Unavailable(f"{cxx} failed: {failed[0].stderr.strip()[-500:]}")
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"building in {target.parent} failed: {e}") from None
    return target
