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

A build compiles in a temporary folder of the cache, `.build-{host}-{pid}-*`, which its
process holds locked (flock) while it lives and renames the library out of at the end. An
interrupted build (KeyboardInterrupt or any other exception, a compiler that fails or is
killed) kills its compilers and removes the folder before the exception goes on. A process
killed hard (SIGKILL, the OOM killer) cannot, so each build first removes the folders no
live process holds (`sweep_stale_builds`: of this host, unlocked and of a dead pid or
unlocked at all where the cache's filesystem can lock; of another host sharing the cache,
untouched for `STALE_AFTER_S`); a folder a live process is building in is never removed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stale folders go by pid and age alone
    fcntl = None

CSRC = Path(__file__).parent / "csrc"  # every .cpp in it is compiled into one library; the .h are shared
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
COMPILE_TIMEOUT_S = 300  # one compiler process (a source file, the link)
# A build folder of another host (a cache on a shared filesystem, whose pids and locks this
# host cannot see) is stale once untouched this long: every compiler writes its .o there
# within COMPILE_TIMEOUT_S, so a live build's folder is never this old
STALE_AFTER_S = 4 * 3600
BUILD_PREFIX = ".build-"
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
    """The kernel cache, an absolute path: a relative BATCHGEN_CACHE_DIR is the current
    directory's ("." gave a library path without a "/", which dlopen looks for on the library
    search path, not here: the build succeeded and the library never loaded), and "~" is the
    home directory (as a quoted value leaves it)."""
    if os.environ.get("BATCHGEN_CACHE_DIR"):
        return Path(os.environ["BATCHGEN_CACHE_DIR"]).expanduser().absolute()
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
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)
    except OSError:
        pass
    finally:  # written but not renamed (an OSError, a KeyboardInterrupt): not left behind
        try:
            tmp.unlink()
        except OSError:
            pass
    return verdict


def _host() -> str:
    """This host's name as build folders carry it (no '-', which separates the pid)."""
    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process, alive
        return True
    return True


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive flock on `fd` without waiting: True taken, False held by another
    process (a live one: the kernel drops a dead process's locks), None where the filesystem
    cannot lock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP, EINVAL: no locks here


class _CacheLock:
    """The cache directory's own lock (flock on the directory), held while build folders are
    swept or one is created and locked: a sweeper never sees a new folder before its owner
    holds it. A no-op where the filesystem cannot lock."""

    def __init__(self, cache: Path):
        self.cache = cache
        self.fd: int | None = None

    def __enter__(self):
        try:
            self.fd = os.open(self.cache, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return self
        if fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)  # held for a directory listing and a mkdir
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of build folder `name` (`.build-{host}-{pid}-{random}`), None for another name."""
    if not name.startswith(BUILD_PREFIX):
        return None
    parts = name[len(BUILD_PREFIX):].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def sweep_stale_builds(cache: Path, now: float | None = None) -> list[str]:
    """Remove the build folders in `cache` that no live process builds in (a build killed
    hard: SIGKILL, the OOM killer, a lost node); returns their names. A folder goes when no
    process holds its lock and it is this host's (its pid dead, or any pid where the
    filesystem can lock: the lock is the owner's for as long as it lives, whatever its pid
    namespace) or untouched for STALE_AFTER_S (another host's, whose pids and NFS locks this
    host cannot see). Call under `_CacheLock`."""
    now = time.time() if now is None else now
    host, removed = _host(), []
    try:
        entries = [e for e in os.scandir(cache) if e.name.startswith(BUILD_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for entry in entries:
        owner = _owner(entry.name)
        if owner is None:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue  # gone meanwhile
        try:
            locked = _try_lock(fd)
            if locked is False:
                continue  # a live process builds there
            try:
                age = now - os.fstat(fd).st_mtime
            except OSError:
                continue
            if owner[0] == host:
                stale = locked is True or not _pid_alive(owner[1]) or age > STALE_AFTER_S
            else:
                stale = age > STALE_AFTER_S
            if stale:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        finally:
            os.close(fd)
    return removed


class _Compilers:
    """The build's compiler processes, each in a process group of its own (the driver and
    cc1plus, as), so that an interrupted build kills them all (`cancel`) instead of waiting
    for them, and none writes into its folder after it is removed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self.cancelled = False

    def run(self, args: list[str]) -> subprocess.CompletedProcess:
        with self._lock:
            if self.cancelled:
                return subprocess.CompletedProcess(args, -signal.SIGKILL, "", "cancelled")
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            self._running.add(proc)
        try:
            try:
                out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                out, err = proc.communicate()
                err = f"{err}\ntimed out after {COMPILE_TIMEOUT_S} s"
            except BaseException:  # interrupted while waiting in this thread (the link)
                self._kill(proc)
                proc.wait()
                raise
            return subprocess.CompletedProcess(args, proc.returncode, out, err)
        finally:
            with self._lock:
                self._running.discard(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            try:
                proc.kill()
            except OSError:
                pass

    def cancel(self) -> None:
        """Start no more compilers and kill (and reap) the running ones."""
        with self._lock:
            self.cancelled = True
            running = list(self._running)
        for proc in running:
            self._kill(proc)
        for proc in running:
            try:
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass


def _failure(r: subprocess.CompletedProcess) -> str:
    why = (r.stderr or "").strip()[-500:]
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        why = f"killed by {name}" + (f": {why}" if why else "")
    return why or f"exit status {r.returncode}"


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
    tmp: Path | None = None
    fd: int | None = None
    compilers = _Compilers()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename into place: processes that build at once (the
        # workers of one machine) each get a whole file. The folder is created and locked
        # under the cache's lock, which the sweep of stale folders holds too.
        with _CacheLock(target.parent):
            sweep_stale_builds(target.parent)
            tmp = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{_host()}-{os.getpid()}-", dir=target.parent))
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            _try_lock(fd)  # held until the folder is gone (closing fd releases it)
        out = tmp / target.name
        objects = [tmp / (f.stem + ".o") for f in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        steps = [[cxx, *compile_flags, "-c", "-o", str(o), str(f)] for f, o in zip(sources, objects)]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(steps), cpus)))
        try:
            compiled = list(pool.map(compilers.run, steps))
        except BaseException:
            compilers.cancel()  # kill the running compilers rather than wait for them
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        failed = [r for r in compiled if r.returncode != 0]
        if not failed:  # link
            failed = [r for r in [compilers.run([cxx, *flags, "-o", str(out), *map(str, objects)])] if r.returncode]
        if failed:
            raise Unavailable(f"{cxx} failed: {_failure(failed[0])}")
        os.replace(out, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"building in {target.parent} failed: {e}") from None
    finally:  # whatever ends the build (KeyboardInterrupt included): no compiler, no folder left
        compilers.cancel()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if fd is not None:
            os.close(fd)
    return target
