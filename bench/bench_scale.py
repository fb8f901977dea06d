"""batchgen at ten million prompts: planning, read amplification, status and verify.

    .venv/bin/python bench/bench_scale.py [--dir /tmp/batchgen_scale] [--skip STEP ...]
    .venv/bin/python bench/bench_scale.py --files 4 --rows 10000 --big-rows 65536   # a quick dry run

Generates its own data under --dir (reused when already there), then measures, each in a
fresh process (peak RSS is that process's ru_maxrss):

1. plan: `batchgen plan` over 10,000,000 short prompts in 100 Parquet files (id column,
   250-row groups as `batchgen prepare --row-group-rows 250` writes them), unit_rows 250:
   40,000 units; and over the same prompts with pyarrow's default layout (one row group per
   file), which plans every file for staging.
2. amplification: a job over one file of 1,048,576 rows in a single row group, unit_rows
   256 (4,096 units), num_samples 1, through the real runner, Ray workers and output path,
   with an I/O-only engine (one token per sample: no model, so the numbers are the data
   path's): input rows decoded (staging + units) / rows used.
3. status and verify of a 40,000-file output: the plan of step 1 prepared as an output and
   one part file per unit (250 prompts x 4 samples = 1,000 rows, 40,000,000 rows in all)
   written through jobs.outputs.commit.write_part.
4. batch_plan: `batchgen plan` of an OpenAI batch file of 1,000,000 chat lines (--batch-lines;
   GSM8K questions with a system message, max_completion_tokens and temperature, n 2 on every
   fourth line), which reads and checks every line; and of 200,000 lines with a seed each.
5. queue: UnitQueue.in_flight(), which every progress report calls, with 200,000 units.

Targets (issue 8): plan under 60 s and 2 GB RSS for 10M prompts; rows decoded / used about
2x at most; verify of 40,000 files under 2 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_FILES, ROWS_PER_FILE, GROUP = 100, 100_000, 250
BIG_ROWS, BIG_UNIT = 1 << 20, 256
BATCH_LINES = 1_000_000
SAMPLES = 4


# ------------------------------------------------------------------ data

def _prompts(k: int, n: int):
    import pyarrow as pa

    start = k * n
    ids = pa.array([f"p{start + i:09d}" for i in range(n)])
    text = pa.array([f"Question {start + i}: what is {i % 97} + {k}?" for i in range(n)])
    return pa.table({"id": ids, "prompt": text})


def _write_inputs(d: Path, row_group_size: int | None) -> None:
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    for k in range(N_FILES):
        f = d / f"part-{k:03d}.parquet"
        if not f.exists():
            pq.write_table(_prompts(k, ROWS_PER_FILE), f, row_group_size=row_group_size)


def _write_batch(path: Path, n: int, seeds: bool = False) -> None:
    """An OpenAI batch file of `n` chat lines over the GSM8K demo questions."""
    if path.exists():
        return
    qs = [json.loads(line)["question"] for line in (ROOT / "jobs" / "data" / "gsm8k_demo.jsonl").open()]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(n):
            body = {"model": "smollm2", "messages": [{"role": "system", "content": "Solve the problem step by step."},
                                                      {"role": "user", "content": qs[i % len(qs)]}],
                    "max_completion_tokens": 256, "temperature": 0.7}
            if seeds:
                body["seed"] = i
            if i % 4 == 0:
                body["n"] = 2
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    tmp.rename(path)


def _queue_report_ms(n: int) -> float:
    """Milliseconds of one progress report's UnitQueue.in_flight() with `n` units, 16 running."""
    from collections import deque

    from cluster.unit import WorkUnit
    from cluster.unit_queue import UnitQueue

    class W:
        def __init__(self, name):
            self.name = name

    q = UnitQueue(max_unit_attempts=3, unit_timeout_s=None, events=deque(maxlen=100))
    q.reset([WorkUnit(index=i, source="f", row_start=i, row_end=i + 1) for i in range(n)])
    for k in range(16):
        w = W(f"w{k % 8}")
        u = q.take(w, 64)
        if u is not None:
            q.sent(u, w, 0.0)
    t = time.perf_counter()
    for _ in range(200):
        q.in_flight()
    return (time.perf_counter() - t) / 200 * 1e3


def _config(path: Path, inp: Path, out: Path, unit_rows: int, **extra) -> Path:
    cfg = {"input": {"path": str(inp), "id_column": "id"}, "output": {"path": str(out)},
           "sampling": {"num_samples": extra.pop("num_samples", SAMPLES), "max_tokens": 1},
           "cluster": {"unit_rows": unit_rows, **extra}}
    path.write_text(json.dumps(cfg))
    return path


# ------------------------------------------------------------------ measured children

def _measure(argv: list[str]) -> dict:
    """Run `bench_scale.py --child ARGV` in a fresh process; its JSON report."""
    r = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                       env={**os.environ,
                            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if r.returncode != 0:
        raise SystemExit(f"child {argv} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(argv: list[str]) -> None:
    import contextlib
    import io

    t0 = time.perf_counter()
    what, arg = argv[0], argv[1]
    report: dict = {}
    if what in ("plan", "verify", "status"):
        from jobs.cli import main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            report["exit"] = main([what, arg])
        report["output"] = buf.getvalue()[-2000:]
    elif what == "io_job":
        report.update(_io_job(arg))
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    report["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(report))


# ------------------------------------------------------------------ an I/O-only job

class _IOEngine:
    """One token per sample, at once: the job's data path without a model."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = []
        self.num_generated_tokens = 0

    def add_request(self, prompt_tokens, params, prompt_id, request_id=None):
        self.pending.append((request_id, prompt_id, list(prompt_tokens), params))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        from engine.params import RequestOutput, Sample

        out = []
        for rid, pid, toks, params in self.pending:
            samples = [Sample(prompt_id=pid, sample_index=j, tokens=[toks[-1]], mask=[1], logprobs=[-1.0],
                              finish_reason="length", tool_calls=[], num_prompt_tokens=len(toks), seed=params.seed)
                       for j in range(params.num_samples)]
            self.num_generated_tokens += params.num_samples
            out.append(RequestOutput(request_id=rid, prompt_id=pid, prompt_tokens=toks, samples=samples))
        self.pending = []
        return out


class _ByteTokenizer:
    vocab_size = 256
    prepend_bos = False
    bos_token_id = None

    def encode(self, s):
        return list(s.encode()[:8])

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def _io_job(cfg: str) -> dict:

    from jobs.config import load_spec
    from jobs.outputs.output_dir import OutputDir
    from jobs.runner import run_job
    from jobs.task import JobTask

    class IOTask(JobTask):
        def load_engine(self):
            return _IOEngine(_ByteTokenizer())

    spec = load_spec(cfg)
    run_job(spec, overwrite=True, progress=False, task_factory=IOTask)
    st = OutputDir(spec.output.path).status()
    summary = st["summary"]
    return {"units": st["units_total"], "prompts": st["prompts"], "units_rows_decoded": st["input_rows_decoded"],
            "staging_rows_decoded": summary["staging_rows_decoded_this_run"]}


# ------------------------------------------------------------------ a 40,000-file output

def _write_parts(args: tuple) -> int:
    """Worker process: write the part files of units [lo, hi)."""
    out_path, fingerprint, units, lo, hi, rows_per_file = args
    import json as _json

    import numpy as np
    import pyarrow as pa

    from jobs.outputs.commit import write_part
    from jobs.outputs.schema import META_COUNTS, META_FINGERPRINT, META_UNIT, META_VERSION, output_schema

    schema = output_schema([])
    rows = 250 * SAMPLES
    const = {
        "sample_index": pa.array(np.tile(np.arange(SAMPLES, dtype=np.int32), 250)),
        "prompt_tokens": pa.array([list(range(12))] * rows, pa.list_(pa.int32())),
        "tokens": pa.array([list(range(100, 116))] * rows, pa.list_(pa.int32())),
        "mask": pa.array([[1] * 16] * rows, pa.list_(pa.int8())),
        "logprobs": pa.array([[-1.5] * 16] * rows, pa.list_(pa.float32())),
        "text": pa.array(["sixteen tokens of generated text"] * rows),
        "finish_reason": pa.array(["length"] * rows),
        "stop_reason": pa.nulls(rows, pa.string()),
        "tool_calls": pa.array([[]] * rows, schema.field("tool_calls").type),
        "num_prompt_tokens": pa.array([12] * rows, pa.int32()),
        "num_tokens": pa.array([16] * rows, pa.int32()),
        "seed": pa.array([0] * rows, pa.int64()),
        "error": pa.nulls(rows, pa.string()),
        "weight_version": pa.array([[0] * 16] * rows, pa.list_(pa.int32())),
    }
    for u in units[lo:hi]:
        index, file_no, a, b = u
        start = file_no * rows_per_file + a
        ids = [f"p{start + i:09d}" for i in range(b - a)]
        cols = {"prompt_id": pa.array(np.repeat(np.array(ids, dtype=object), SAMPLES), pa.string()), **const}
        meta = {META_FINGERPRINT: fingerprint.encode(),
                META_UNIT: _json.dumps({"index": index, "row_start": a, "row_end": b}).encode(),
                META_COUNTS: _json.dumps({"prompts": b - a, "rows": rows, "generated_tokens": 16 * rows}).encode(),
                META_VERSION: b"bench"}
        write_part(out_path, index, pa.table([cols[f.name] for f in schema], schema=schema.with_metadata(meta)))
    return hi - lo


def _make_output(cfg: Path) -> Path:
    from jobs.config import load_spec
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job

    spec = load_spec(cfg)
    out = OutputDir(spec.output.path)
    want = N_FILES * ROWS_PER_FILE // GROUP
    if len(out.committed_units()) == want:
        return Path(out.path)
    plan = plan_job(spec)
    assert len(plan.units) == want, len(plan.units)
    out.prepare(plan, spec, overwrite=True)
    file_no = {f.path: k for k, f in enumerate(plan.files)}
    units = [(u.index, file_no[u.source], u.row_start, u.row_end) for u in plan.units]
    step = 2_000
    with Pool(2) as pool:
        pool.map(_write_parts, [(out.path, plan.fingerprint, units, lo, min(lo + step, len(units)), ROWS_PER_FILE)
                                for lo in range(0, len(units), step)])
    return Path(out.path)


# ------------------------------------------------------------------ main

def main() -> None:
    global N_FILES, ROWS_PER_FILE, BIG_ROWS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/batchgen_scale", help="where the generated data and outputs go")
    ap.add_argument("--skip", nargs="*", default=[], choices=["plan", "amplification", "verify", "batch_plan", "queue"])
    ap.add_argument("--files", type=int, default=N_FILES, help="input files (default 100)")
    ap.add_argument("--rows", type=int, default=ROWS_PER_FILE, help="prompts per file (default 100,000)")
    ap.add_argument("--big-rows", type=int, default=BIG_ROWS, help="rows of the one-row-group file (default 2^20)")
    ap.add_argument("--batch-lines", type=int, default=BATCH_LINES, help="lines of the OpenAI batch file (default 1,000,000)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    N_FILES, ROWS_PER_FILE, BIG_ROWS = args.files, args.rows, args.big_rows
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")

    t = time.perf_counter()
    _write_inputs(d / "prompts", GROUP)
    print(f"inputs: {N_FILES} files x {ROWS_PER_FILE:,} prompts ({time.perf_counter() - t:.0f}s to generate or check)")
    plan_cfg = _config(d / "plan.yaml", d / "prompts", d / "out_verify", GROUP)
    if "plan" not in args.skip:
        r = _measure(["plan", str(plan_cfg)])
        results["plan"] = r
        print(f"plan, {GROUP}-row groups: {r['wall_s']}s, peak RSS {r['max_rss_mb']} MB, exit {r['exit']}")
        print("  " + "\n  ".join(ln for ln in r["output"].splitlines() if ln.startswith(("units", "rows decoded"))))
        _write_inputs(d / "prompts_1rg", None)
        r = _measure(["plan", str(_config(d / "plan_1rg.yaml", d / "prompts_1rg", d / "out_1rg", GROUP))])
        results["plan_one_row_group_per_file"] = r
        print(f"plan, one row group per file: {r['wall_s']}s, peak RSS {r['max_rss_mb']} MB, exit {r['exit']}")
        print("  " + "\n  ".join(ln for ln in r["output"].splitlines() if ln.startswith(("units", "rows decoded"))))

    if "amplification" not in args.skip:
        import pyarrow.parquet as pq

        big = d / "big" / "big.parquet"
        if not big.exists():
            big.parent.mkdir(parents=True, exist_ok=True)
            t = _prompts(0, BIG_ROWS)
            pq.write_table(t, big, row_group_size=BIG_ROWS)
        assert pq.ParquetFile(big).metadata.num_row_groups == 1
        cfg = _config(d / "big.yaml", big, d / "out_big", BIG_UNIT, num_samples=1, num_workers=2)
        r = _measure(["io_job", str(cfg)])
        results["amplification"] = r
        used = r["prompts"]
        decoded = r["units_rows_decoded"] + r["staging_rows_decoded"]
        r["ratio"] = round(decoded / used, 3)
        r["without_staging_or_alignment"] = r["units"] * BIG_ROWS
        print(f"amplification: {r['units']:,} units over one {BIG_ROWS:,}-row group: rows decoded {decoded:,} "
              f"(staging {r['staging_rows_decoded']:,} + units {r['units_rows_decoded']:,}) / rows used {used:,} = "
              f"{r['ratio']}x (each unit decoding the whole group: {r['without_staging_or_alignment']:,} = "
              f"{r['without_staging_or_alignment'] / used:,.0f}x); job {r['wall_s']}s, driver peak RSS "
              f"{r['max_rss_mb']} MB")

    if "verify" not in args.skip:
        t = time.perf_counter()
        out = _make_output(plan_cfg)
        print(f"output: {N_FILES * ROWS_PER_FILE // GROUP:,} part files in {out} ({time.perf_counter() - t:.0f}s to write or check)")
        for verb in ("status", "verify"):
            r = _measure([verb, str(out)])
            results[verb] = r
            last = [ln for ln in r["output"].splitlines() if ln.strip()][-1:]
            print(f"{verb} of {N_FILES * ROWS_PER_FILE // GROUP:,} files: {r['wall_s']}s, peak RSS {r['max_rss_mb']} MB, exit {r['exit']} {last}")
    if "batch_plan" not in args.skip:
        for label, n, seeds in (("chat lines", args.batch_lines, False), ("chat lines, a seed each", args.batch_lines // 5, True)):
            f = d / f"batch-{n}{'-seeds' if seeds else ''}.jsonl"
            _write_batch(f, n, seeds)
            cfg = d / f"{f.stem}.yaml"
            cfg.write_text(json.dumps({"model": {"path": "tiny-random"}, "output": {"path": str(d / f"out_{f.stem}")},
                                       "input": {"path": str(f), "format": "openai_batch"}}))
            r = _measure(["plan", str(cfg)])
            results[f"batch_plan_{f.stem}"] = r
            print(f"plan of an OpenAI batch file, {n:,} {label} ({f.stat().st_size / 1e6:,.0f} MB): {r['wall_s']}s "
                  f"({n / r['wall_s']:,.0f} lines/s, the process's start included), peak RSS {r['max_rss_mb']} MB, "
                  f"exit {r['exit']}")
    if "queue" not in args.skip:
        ms = _queue_report_ms(200_000)
        results["queue_in_flight_ms"] = ms
        print(f"UnitQueue.in_flight() with 200,000 units: {ms:.4f} ms per progress report")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    (d / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
