"""Bad input that only the engine can judge, run as a real job unit (JobTask + the demo
engine in a GenerationWorker, in-process, no Ray): the rows fail alone or run, nothing is
dropped, and the counts reach the unit's summary and `batchgen status`.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cluster.worker import GenerationWorker
from jobs.outputs.output_dir import OutputDir
from jobs.plan.planner import plan_job
from jobs.spec import JobSpec
from jobs.task import JobTask


def run_all_units(spec):
    plan = plan_job(spec)
    out = OutputDir(spec.output.path)
    out.prepare(plan, spec)
    w = GenerationWorker(JobTask(spec, plan), "w0", num_threads=1)
    try:
        results = [w.run_unit(u) for u in plan.units]
    finally:
        w.shutdown()
    rows = []
    for f in sorted(Path(spec.output.path).glob("part-*.parquet")):
        rows.extend(pq.read_table(f).to_pylist())
    return results, rows, out


def spec_for(tmp_path, table, fmt="text", column="prompt", model=None, **sampling):
    tmp_path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, tmp_path / "in.parquet")
    return JobSpec.from_dict({
        "model": {"path": "tiny-random", **(model or {})},
        "input": {"path": str(tmp_path / "in.parquet"), "format": fmt, "column": column, "id_column": "id"},
        "output": {"path": str(tmp_path / "out")},
        "sampling": {"num_samples": 2, "max_tokens": 4, "top_k": 0, "seed": 1, **sampling},
        "cluster": {"unit_rows": 8},
    })


def test_prompt_longer_than_the_context_window_is_an_error_row(tmp_path):
    """A prompt past the context window (model.max_seq_len here) fails alone: its samples
    are error rows naming the lengths; the row beside it is generated normally."""
    long_text = "word " * 200
    spec = spec_for(tmp_path, pa.table({"id": ["long", "ok"], "prompt": [long_text, "hello"]}),
                    model={"max_seq_len": 64})
    results, rows, out = run_all_units(spec)
    by_id = {(r["prompt_id"], r["sample_index"]): r for r in rows}
    assert len(rows) == 4
    for j in range(2):
        bad = by_id[("long", j)]
        assert bad["finish_reason"] == "error" and "context window of 64 tokens" in bad["error"]
        assert bad["tokens"] == [] and bad["num_prompt_tokens"] > 64
        good = by_id[("ok", j)]
        assert good["error"] is None and len(good["tokens"]) == 4
    assert sum(r.error_rows for r in results) == 2
    assert out.status()["error_rows"] == 2


def test_token_ids_out_of_range_and_negative(tmp_path):
    """tokens-format rows with ids outside the vocabulary become error rows."""
    vocab = 100265
    spec = spec_for(tmp_path, pa.table({"id": ["neg", "big", "ok"], "prompt": [[1, -5], [vocab], [1, 2, 3]]}),
                    fmt="tokens")
    _, rows, out = run_all_units(spec)
    errs = {r["prompt_id"]: r["error"] for r in rows if r["error"]}
    assert set(errs) == {"neg", "big"} and len(rows) == 6
    assert all("row" in e for e in errs.values())  # the message names the row
    assert out.status()["error_rows"] == 4


def test_num_samples_beyond_the_kv_budget_still_runs(tmp_path):
    """num_samples x max_tokens far beyond the KV cache (3 slots here): samples run in groups
    that fit, every (prompt_id, sample_index) is written once, and the result equals a run
    with a cache big enough for all of them."""
    table = pa.table({"id": ["a", "b"], "prompt": ["one", "two"]})
    small = spec_for(tmp_path / "small", table, model={"max_num_seqs": 3}, num_samples=7, max_tokens=6)
    big = spec_for(tmp_path / "big", table, model={"max_num_seqs": 64}, num_samples=7, max_tokens=6)
    _, rows_small, _ = run_all_units(small)
    _, rows_big, _ = run_all_units(big)
    key = lambda r: (r["prompt_id"], r["sample_index"])
    assert sorted(map(key, rows_small)) == [(p, j) for p in "ab" for j in range(7)]
    assert [r["tokens"] for r in sorted(rows_small, key=key)] == [r["tokens"] for r in sorted(rows_big, key=key)]
