"""The kernel cache's build folders (engine/kernels/build.py): a build interrupted by Ctrl-C
(SIGINT) while its compilers run kills them and leaves nothing in the cache; a build killed
hard (SIGKILL) leaves its folder, which the next build removes, never one a live builder is
writing in; builders of the same library at once all get it whole. Builds run for real in
subprocesses with their own BATCHGEN_CACHE_DIR; every wait polls with a deadline."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine.kernels.build as B

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None
                                or not B.supported_isas(), reason="no kernel build here")


def _start_build(cache: Path, env: dict | None = None, csrc: Path | None = None) -> subprocess.Popen:
    cache.mkdir(exist_ok=True)
    code = ("import sys; import engine.kernels.build as B\n"
            + (f"B.CSRC = __import__('pathlib').Path({str(csrc)!r})\n" if csrc else "")
            + "print(B.build_library(B.supported_isas()[0]), flush=True)")
    e = {**os.environ, "BATCHGEN_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _poll(what, deadline_s: float, why: str):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {deadline_s} s: {why}")


def _compiling(proc: subprocess.Popen, cache: Path) -> tuple[Path, list[int]]:
    """Once `proc`'s build folder exists and a compiler runs in it: (folder, compiler pids)."""
    def ready():
        folders = [p for p in cache.iterdir() if p.name.startswith(B.BUILD_PREFIX)]
        compilers = _children(proc.pid)
        return (folders[0], compilers) if folders and compilers else None
    return _poll(ready, 120, "the build folder and a compiler process")


def _hanging_compiler(tmp_path: Path) -> Path:
    """A compiler that writes its output's first bytes and then never finishes (`--version` is
    the real one's): a build that only ends when interrupted."""
    cxx = tmp_path / "hanging-c++"
    cxx.write_text('#!/bin/sh\ncase " $* " in *" --version "*) exec c++ --version;; esac\n'
                   'while [ $# -gt 0 ]; do [ "$1" = "-o" ] && printf partial > "$2"; shift; done\n'
                   'exec sleep 1000\n')
    cxx.chmod(0o755)
    return cxx


@pytest.mark.parametrize("compiler", ["real", "hanging"])
def test_ctrl_c_during_the_build_kills_the_compilers_and_leaves_nothing(compiler, tmp_path):
    """SIGINT to the building process alone (as Ray's or a supervisor's interrupt): the build
    raises KeyboardInterrupt at once, its compilers killed (not waited for: the hanging one
    would take 300 s), and the cache holds no folder and no library."""
    cache = tmp_path / "cache"
    env = {"CXX": str(_hanging_compiler(tmp_path))} if compiler == "hanging" else {}
    proc = _start_build(cache, env)
    folder, compilers = _compiling(proc, cache)
    assert folder.name.startswith(f"{B.BUILD_PREFIX}{B._host()}-{proc.pid}-")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert time.monotonic() - t0 < 30
    assert not [p for p in compilers if _alive(p)]
    assert list(cache.iterdir()) == []


def test_a_build_killed_hard_is_swept_by_the_next_never_a_live_one(tmp_path):
    """SIGKILL (no cleanup can run) leaves the folder; the next build removes it, but not the
    folder of a builder still at work (the same cache, at the same time), which cleans up
    after itself when it is interrupted in turn."""
    cache = tmp_path / "cache"
    killed = _start_build(cache)
    dead_folder, compilers = _compiling(killed, cache)
    killed.kill()  # the process and, as a node's loss would, its compilers
    for pid in compilers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed.communicate(timeout=60)
    _poll(lambda: not [p for p in compilers if _alive(p)], 30, "the killed compilers gone")
    assert dead_folder.is_dir()

    live = _start_build(cache, {"CXX": str(_hanging_compiler(tmp_path))})
    try:
        live_folder = _poll(lambda: [p for p in cache.iterdir() if p.name.startswith(B.BUILD_PREFIX)
                                     and p != dead_folder and _children(live.pid)], 120, "the live build")[0]
        old = time.time() - 2 * B.STALE_AFTER_S  # old, too: its lock, not its age, keeps it
        os.utime(live_folder, (old, old))
        env = {"BATCHGEN_CACHE_DIR": str(cache), "CXX": "false"}
        fails = subprocess.run([sys.executable, "-c", "import engine.kernels.build as B; "
                                "B.build_library(B.supported_isas()[0])"], env={**os.environ, **env,
                               "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "Unavailable" in fails.stderr and "false failed" in fails.stderr, fails.stderr[-2000:]
        assert not dead_folder.exists() and live_folder.is_dir()
        live.send_signal(signal.SIGINT)
        live.communicate(timeout=60)
    finally:
        live.kill()
    assert list(cache.iterdir()) == []


def test_sweep_rules(tmp_path, monkeypatch):
    """This host's unlocked folders go (a dead pid or a reused one); another host's only once
    untouched for STALE_AFTER_S; a locked one and other names never."""
    host = B._host()
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {f".build-{host}-{dead.pid}-aaaa": True, f".build-{host}-{os.getpid()}-bbbb": True,
             ".build-otherhost-1-cccc": False, ".build-otherhost-2-dddd": True, "tmpxyz": False,
             ".build-nopid": False}
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "gemm.o").write_text("x")
    old = time.time() - B.STALE_AFTER_S - 60
    os.utime(tmp_path / ".build-otherhost-2-dddd", (old, old))
    locked = tmp_path / f".build-{host}-{os.getpid()}-eeee"
    locked.mkdir()
    fd = os.open(locked, os.O_RDONLY)
    try:
        assert B._try_lock(fd) is True
        removed = B.sweep_stale_builds(tmp_path)
    finally:
        os.close(fd)
    assert sorted(removed) == sorted(n for n, gone in names.items() if gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([locked.name] + [n for n, g in names.items() if not g])
    # without locks (a filesystem that has none), this host's folders go by their pid alone
    monkeypatch.setattr(B, "_try_lock", lambda fd: None)
    for n in (f".build-{host}-{dead.pid}-ffff", f".build-{host}-{os.getpid()}-gggg"):
        (tmp_path / n).mkdir()
    assert B.sweep_stale_builds(tmp_path) == [f".build-{host}-{dead.pid}-ffff"]
    assert (tmp_path / f".build-{host}-{os.getpid()}-gggg").is_dir() and locked.is_dir()


def test_builders_of_one_library_at_once_all_get_it_whole(tmp_path):
    """Four processes build the same (small) library into one empty cache at once: each gets
    the same path, the library loads and works, and no build folder is left."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "tiny.cpp").write_text('extern "C" int batchgen_tiny(int x) { return 3 * x + 1; }\n')
    cache = tmp_path / "cache"
    procs = [_start_build(cache, csrc=csrc) for _ in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
        outs.append(out.strip())
    assert len(set(outs)) == 1 and Path(outs[0]).parent == cache
    assert ctypes.CDLL(outs[0]).batchgen_tiny(4) == 13
    assert [p.name for p in cache.iterdir()] == [Path(outs[0]).name]


@pytest.mark.parametrize("given", [".", "rel/cache"])
def test_a_relative_cache_dir_gives_a_library_that_loads(given, tmp_path):
    """BATCHGEN_CACHE_DIR relative to the current directory: the library's path is absolute
    and loads. With "." the path had no "/", so dlopen looked for it on the library search
    path, not in the cache: the build succeeded and loading it failed."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "tiny.cpp").write_text('extern "C" int batchgen_tiny(int x) { return 3 * x + 1; }\n')
    work = tmp_path / "work"
    work.mkdir()
    code = ("import ctypes, pathlib, engine.kernels.build as B\n"
            f"B.CSRC = pathlib.Path({str(csrc)!r})\n"
            "p = B.build_library(B.supported_isas()[0])\n"
            "print(p, ctypes.CDLL(str(p)).batchgen_tiny(4))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "BATCHGEN_CACHE_DIR": given, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    path, value = r.stdout.split()
    assert value == "13" and Path(path).is_absolute() and Path(path).parent == (work / given).resolve()
