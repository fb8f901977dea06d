"""`from jobs import run_job` (a config path, a dict or a JobSpec, with overrides) and the
output read with no conversion by pandas, polars, duckdb and Hugging Face `datasets`.

One small job on tiny-random (stop strings, so stop_reason holds strings and token texts)
runs once on a local Ray instance; the other calls resume it (nothing runs again).
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["prompt_id", "sample_index", "tokens", "mask", "logprobs", "text", "finish_reason", "stop_reason",
           "num_tokens", "tool_calls"]


@pytest.fixture(scope="module")
def job(tmp_path_factory, ray_local):
    from jobs import run_job

    d = tmp_path_factory.mktemp("api")
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(6)],
                             "prompt": [f"Question {i}: what is {i} + {i}?" for i in range(6)]}), d / "in.parquet")
    config = {"model": {"path": "tiny-random", "max_num_seqs": 16},
              "input": {"path": str(d / "in.parquet"), "id_column": "id"},
              "output": {"path": str(d / "out")},
              "sampling": {"num_samples": 3, "max_tokens": 8, "top_k": 20, "seed": 1},
              "cluster": {"unit_rows": 4}}
    yield d, config, run_job(config, {"sampling.stop": ["e", "o"], "sampling.logprobs_mode": "processed"})


def test_run_job_from_a_dict_returns_the_dataset(job):
    d, config, result = job
    assert result.output_path == str(d / "out")
    assert result.summary["samples"] == 18 and result.summary["units"] == 2 and result.summary["error_rows"] == 0
    table = result.to_table()
    assert table.num_rows == 18
    rows = table.to_pylist()
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [(f"q{i}", j) for i in range(6) for j in range(3)]
    assert all(len(r["tokens"]) == len(r["mask"]) == len(r["logprobs"]) == r["num_tokens"] <= 8 for r in rows)
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    assert stopped and all(r["stop_reason"] in ("e", "o") or r["tokens"][-1] in (100256, 100260) for r in stopped)


def test_run_job_from_a_path_and_a_spec_resumes(job, tmp_path):
    """The same job as a YAML path with --set-style strings, and as a JobSpec with a mapping:
    the same fingerprint, so both resume it (no unit runs) and see the same rows."""
    from jobs import load_job_spec, run_job

    d, config, result = job
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(config))
    again = run_job(cfg, ["sampling.stop=[e, o]", "sampling.logprobs_mode=processed"])
    assert again.summary["units_this_run"] == 0 and again.summary["fingerprint"] == result.summary["fingerprint"]
    assert again.to_table().equals(result.to_table())
    spec = load_job_spec(cfg)
    third = run_job(spec, {"sampling.stop": ["e", "o"], "sampling.logprobs_mode": "processed"})
    assert third.summary["fingerprint"] == result.summary["fingerprint"]
    from jobs.errors import SpecError

    with pytest.raises(SpecError, match="unknown key sampling.temprature"):
        run_job(spec, {"sampling.temprature": 0.5})


def test_the_summary_is_read_without_a_second_pass_over_the_parts(job, monkeypatch):
    """The result's summary is the _SUCCESS the run wrote: each part's footer is read once
    per call (the run's own summary), not a second time for the API's (a pass over the
    footers of a 40,000-unit output takes seconds)."""
    import json

    from jobs import run_job
    from jobs.outputs.layout import SUCCESS, part_name
    from jobs.outputs.output_dir import OutputDir

    d, config, result = job
    reads = []
    real = OutputDir._part_metadata
    monkeypatch.setattr(OutputDir, "_part_metadata", lambda self, rel: reads.append(rel) or real(self, rel))
    again = run_job(config, {"sampling.stop": ["e", "o"], "sampling.logprobs_mode": "processed"})
    assert again.summary["units_this_run"] == 0 and again.summary["samples"] == 18
    assert again.summary == json.loads(OutputDir(again.output_path).read_text(SUCCESS))
    assert sorted(reads) == [part_name(0), part_name(1)]  # once each


def test_readers_load_the_output_without_conversion(job, tmp_path, monkeypatch):
    """pandas, polars, duckdb and Hugging Face datasets read the output directory (or its
    part-*.parquet glob) as written, and agree with pyarrow value for value."""
    d, _, result = job
    out = d / "out"
    want = result.to_table(COLUMNS).to_pylist()

    import pandas as pd

    df = pd.read_parquet(out, columns=COLUMNS)  # the directory: _batchgen/ and _SUCCESS are skipped
    assert len(df) == len(want)
    for got, w in zip(df.to_dict("records"), want):
        assert (got["prompt_id"], got["sample_index"]) == (w["prompt_id"], w["sample_index"])
        assert list(got["tokens"]) == w["tokens"] and list(got["mask"]) == w["mask"]
        assert list(got["logprobs"]) == pytest.approx(w["logprobs"])
        assert got["stop_reason"] == w["stop_reason"] if w["stop_reason"] is not None else pd.isna(got["stop_reason"])

    import polars as pl

    pdf = pl.read_parquet(str(out / "part-*.parquet"), columns=COLUMNS)
    assert pdf.schema["tokens"] == pl.List(pl.Int32) and pdf.schema["mask"] == pl.List(pl.Int8)
    assert pdf.schema["logprobs"] == pl.List(pl.Float32)
    assert pdf.to_dicts() == [{**w, "tool_calls": w["tool_calls"]} for w in want]

    import duckdb

    con = duckdb.connect()
    got = con.execute(f"SELECT prompt_id, sample_index, tokens, mask, stop_reason, len(tokens) AS n "
                      f"FROM read_parquet('{out}/part-*.parquet') ORDER BY prompt_id, sample_index").fetchall()
    assert [(g[0], g[1], list(g[2]), list(g[3]), g[4], g[5]) for g in got] == \
        [(w["prompt_id"], w["sample_index"], w["tokens"], w["mask"], w["stop_reason"], w["num_tokens"]) for w in want]

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train",
                      cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == len(want)
    hf = ds.select_columns(COLUMNS).to_list()
    assert [(r["prompt_id"], r["sample_index"], r["tokens"], r["mask"], r["stop_reason"]) for r in hf] == \
        [(w["prompt_id"], w["sample_index"], w["tokens"], w["mask"], w["stop_reason"]) for w in want]
    assert [r["logprobs"] for r in hf] == [pytest.approx(w["logprobs"]) for w in want]


@pytest.mark.parametrize("passthrough", [[], ["answer"]])
def test_a_zero_row_job_returns_the_output_schema(tmp_path, passthrough, monkeypatch):
    """A job whose input has no rows (no units, so no part file) returns a dataset with the
    output's columns and types, passthrough columns included, as its manifest records
    them (it had no columns at all). No unit runs, so Ray is never started."""
    import jobs.runner
    from jobs import run_job
    from jobs.outputs.output_dir import OutputDir
    from jobs.outputs.schema import output_schema, type_str

    monkeypatch.setattr(jobs.runner, "connect_ray", lambda spec: pytest.fail("Ray started for a job of no units"))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.int64())}),
                   tmp_path / "in.parquet")
    result = run_job({"model": {"path": "tiny-random"}, "input": {"path": str(tmp_path / "in.parquet"),
                                                                  "passthrough": passthrough},
                      "output": {"path": str(tmp_path / "out")}})
    table = result.to_table()
    want = output_schema([pa.field("answer", pa.int64())] if passthrough else [])
    assert table.num_rows == 0 and result.summary["samples"] == 0
    assert table.schema == want
    manifest = OutputDir(str(tmp_path / "out")).read_manifest()
    assert [[f.name, type_str(f.type)] for f in table.schema] == manifest["output_schema"]
    assert result.to_table(["prompt_id", "tokens"]).column_names == ["prompt_id", "tokens"]


def test_a_resume_keeps_the_dtype_auto_resolved_to_first(job, tmp_path):
    """`model.dtype: auto` resolves per machine (bfloat16 on an AMX Xeon, float32 on an AVX2
    EPYC) and the fingerprint holds "auto", so a resume on another kind of machine used to
    add rows of another dtype to the output. The first run records what its workers resolved
    (the manifest's auto_dtype) and a resume runs in it: here an output recorded as begun
    in the other dtype, one unit missing, gets that unit in the recorded dtype, bit for bit
    what a job with that dtype set explicitly writes."""
    import json
    import shutil

    import torch

    from engine.loading.checkpoint import resolve_dtype
    from jobs import run_job

    d, config, result = job
    overrides = {"sampling.stop": ["e", "o"], "sampling.logprobs_mode": "processed"}
    here = str(resolve_dtype("auto", torch.device("cpu"))).replace("torch.", "")
    manifest = json.loads((d / "out" / "_batchgen" / "manifest.json").read_text())
    assert manifest["auto_dtype"] == here  # recorded when the first worker was ready
    other = {"float32": "bfloat16", "bfloat16": "float32"}[here]

    out = tmp_path / "out"
    shutil.copytree(d / "out", out)
    manifest["auto_dtype"] = other  # as if begun on the other kind of machine
    (out / "_batchgen" / "manifest.json").write_text(json.dumps(manifest))
    (out / "part-000001.parquet").unlink()
    resumed = run_job({**config, "output": {"path": str(out)}}, overrides)
    assert resumed.summary["units_this_run"] == 1
    explicit = run_job({**config, "output": {"path": str(tmp_path / "explicit")},
                        "model": {**config["model"], "dtype": other}}, overrides)
    cols = ["prompt_id", "sample_index", "tokens", "logprobs"]
    new_unit = pq.read_table(out / "part-000001.parquet", columns=cols)
    assert new_unit.equals(pq.read_table(tmp_path / "explicit" / "part-000001.parquet", columns=cols))
    assert not new_unit.equals(pq.read_table(d / "out" / "part-000001.parquet", columns=cols))
    assert json.loads((out / "_batchgen" / "manifest.json").read_text())["auto_dtype"] == other

