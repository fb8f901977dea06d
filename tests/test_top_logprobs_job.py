"""A real tiny-random job with sampling.top_logprobs (engine/params.py): the Parquet output's
top_logprob_ids / top_logprobs columns, a per-row value (input.sampling_column), a bad
per-row value as an error row, a bad config value refused before any work."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")


def test_job_writes_the_top_logprob_columns(tmp_path, ray_local):
    from jobs import run_job

    params = pa.struct([("top_logprobs", pa.int64()), ("logprobs_mode", pa.string())])
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "prompt": ["one", "two", "three", "four"],
                             "params": pa.array([None, {"top_logprobs": 0, "logprobs_mode": None},
                                                 {"top_logprobs": 5, "logprobs_mode": "processed"},
                                                 {"top_logprobs": 30, "logprobs_mode": None}], type=params)}),
                   tmp_path / "in.parquet")
    config = {"model": {"path": "tiny-random", "max_num_seqs": 8},
              "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "sampling_column": "params"},
              "output": {"path": str(tmp_path / "out")},
              "sampling": {"num_samples": 2, "max_tokens": 6, "top_k": 0, "seed": 1, "top_logprobs": 3},
              "cluster": {"unit_rows": 2}}
    result = run_job(config)
    table = result.to_table()
    assert pa.types.is_list(table.schema.field("top_logprob_ids").type)
    assert table.schema.field("top_logprobs").type == pa.list_(pa.list_(pa.float32()))
    rows = {(r["prompt_id"], r["sample_index"]): r for r in table.to_pylist()}
    for (pid, _), r in rows.items():
        if pid == "a":  # the job's k = 3, raw
            assert [len(x) for x in r["top_logprob_ids"]] == [3] * len(r["tokens"])
            for t, lp, ids, vals in zip(r["tokens"], r["logprobs"], r["top_logprob_ids"], r["top_logprobs"]):
                assert vals == sorted(vals, reverse=True) and (t not in ids or vals[ids.index(t)] == lp)
        elif pid == "b":  # k = 0 for this row: null
            assert r["top_logprob_ids"] is None and r["top_logprobs"] is None
        elif pid == "c":  # k = 5, processed (top_k 0, temperature 1: every token can be drawn)
            assert [len(x) for x in r["top_logprobs"]] == [5] * len(r["tokens"])
        else:  # 30 > 20: an error row naming the field
            assert r["finish_reason"] == "error" and "field 'top_logprobs': must be an integer from 0 to 20" in r["error"]
            assert r["top_logprob_ids"] is None


def test_a_bad_config_value_is_refused():
    from jobs.errors import SpecError
    from jobs.spec import JobSpec

    for bad in (-1, 21, 1.5, "3"):
        with pytest.raises(SpecError, match="top_logprobs"):
            JobSpec.from_dict({"sampling": {"top_logprobs": bad}})
    spec = JobSpec.from_dict({"sampling": {"top_logprobs": 4}})
    assert spec.sampling_params().top_logprobs == 4
    # the fingerprint holds top_logprobs only when set
    assert "top_logprobs" not in JobSpec.from_dict({}).fingerprint_dict()["sampling"]
    assert spec.fingerprint_dict()["sampling"]["top_logprobs"] == 4


def test_a_job_without_top_logprobs_keeps_the_schema_outputs_had_before(tmp_path, ray_local):
    """Without sampling.top_logprobs the output has exactly the columns outputs had before the
    key existed (and the same fingerprint: FINGERPRINT_VERSION unchanged), so an output begun
    by an earlier batchgen resumes into one schema; a row asking for its own k > 0 there has
    nowhere to put its lists: an error row naming why, not lists silently dropped."""
    from jobs import run_job
    from jobs.outputs.schema import OUTPUT_SCHEMA
    from jobs.plan.fingerprint import FINGERPRINT_VERSION

    assert FINGERPRINT_VERSION == 4
    params = pa.struct([("top_logprobs", pa.int64())])
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["one", "two"],
                             "params": pa.array([None, {"top_logprobs": 2}], type=params)}),
                   tmp_path / "in.parquet")
    config = {"model": {"path": "tiny-random", "max_num_seqs": 8},
              "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "sampling_column": "params"},
              "output": {"path": str(tmp_path / "out")},
              "sampling": {"num_samples": 2, "max_tokens": 4, "seed": 1}}
    table = run_job(config).to_table()
    assert table.schema.names == OUTPUT_SCHEMA.names
    rows = {(r["prompt_id"], r["sample_index"]): r for r in table.to_pylist()}
    assert rows[("a", 0)]["finish_reason"] in ("stop", "length") and rows[("a", 0)]["error"] is None
    for i in range(2):
        r = rows[("b", i)]
        assert r["finish_reason"] == "error" and "only in a job with sampling.top_logprobs > 0" in r["error"], r
