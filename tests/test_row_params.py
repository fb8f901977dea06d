"""Per-request sampling parameters (`input.sampling_column`): one unit mixing per-row
num_samples, max_tokens, temperature, top_k, stop strings and logprobs_mode gives each row
what it asked for, each sample equal (bit for bit, on tiny-random on CPU) to the same
request run alone in a fresh engine, and bad values become error rows naming the field.
The job runs on a real local Ray instance (one per module), as `batchgen run` runs it.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.params import SamplingParams
from jobs.errors import InputError
from jobs.inputs.row_params import row_num_samples, row_params

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]

PARAMS_TYPE = pa.struct([("num_samples", pa.int64()), ("max_tokens", pa.int64()), ("temperature", pa.float64()),
                         ("top_k", pa.int64()), ("stop", pa.list_(pa.string())), ("logprobs_mode", pa.string())])
ROWS = [  # (prompt, params struct or None)
    ("The first prompt", None),  # the job's sampling
    ("Greedy, three times", {"num_samples": 3, "max_tokens": 4, "temperature": 0.0}),
    ("Stop on letters", {"num_samples": 1, "max_tokens": 12, "temperature": 1.3, "stop": ["e", "a"]}),
    ("A bad temperature", {"temperature": -1.0}),
    ("A bad num_samples", {"num_samples": 0}),
    ("Processed logprobs", {"num_samples": 2, "max_tokens": 5, "top_k": 10, "logprobs_mode": "processed"}),
    ("Four long ones", {"num_samples": 4, "max_tokens": 9, "stop": ["x"]}),
]
EXPECTED_ROWS = [2, 3, 1, 2, 1, 2, 4]
JOB_SAMPLING = {"num_samples": 2, "max_tokens": 6, "temperature": 1.0, "top_k": 0, "seed": 3}


def write_input(d: Path, rows=ROWS) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(rows))], "prompt": [p for p, _ in rows],
                             "params": pa.array([v for _, v in rows], type=PARAMS_TYPE)}), path)
    return path


def spec_for(inp: Path, out: Path, **input_keys):
    from jobs.spec import JobSpec

    return JobSpec.from_dict({
        "model": {"path": "tiny-random", "max_num_seqs": 16},
        "input": {"path": str(inp), "id_column": "id", "sampling_column": "params", **input_keys},
        "output": {"path": str(out)},
        "sampling": JOB_SAMPLING,
        "cluster": {"num_workers": 1, "cpus_per_worker": 1, "unit_rows": 8},
    })


def test_row_params_rules():
    """Null fields keep the job's value; integral floats are integers; a bad value names the
    field and keeps the row's valid num_samples (else the job's when null, else 1)."""
    base = SamplingParams(num_samples=2, max_tokens=6, seed=3)
    assert row_params(base, None) == (base, None)
    p, err = row_params(base, {"max_tokens": 9.0, "temperature": None, "stop": ["\n\nQ:"]})
    assert err is None and (p.max_tokens, p.temperature, p.stop, p.seed) == (9, 1.0, ("\n\nQ:",), 3)
    p, err = row_params(base, {"num_samples": 5, "top_p": 1.5}, "f.parquet row 3 column 'params' ")
    assert err == "f.parquet row 3 column 'params' field 'top_p': must be in (0, 1], got 1.5" and p.num_samples == 5
    assert row_params(base, {"logprobs_mode": "cooked"})[1] == "field 'logprobs_mode': must be one of raw, processed, got 'cooked'"
    assert [row_num_samples(v, 2) for v in (None, {}, {"num_samples": None}, {"num_samples": 4}, {"num_samples": -1})] \
        == [2, 2, 2, 4, 1]
    # a typo's 10^12 samples: one error row naming the bound (it was a MemoryError failing the unit, then the job)
    p, err = row_params(base, {"num_samples": 10**12})
    assert err == "field 'num_samples': must be an integer from 1 to 1,000,000, got 1000000000000"
    assert p.num_samples == 1 and row_num_samples({"num_samples": 10**12}, 2) == 1
    # a top_k past int64 (JSON has no bound; 1e20 from a float column is integral): an error row,
    # not the OverflowError that failed the engine's whole step
    for big in (2**63, 1e20):
        p, err = row_params(base, {"top_k": big})
        assert err == f"field 'top_k': must be an integer >= 0 (0 disables it) and below 2**63, got {int(big)}"


def test_sampling_column_is_checked_before_work(tmp_path):
    """A missing column, a column that is not a struct, or a struct field that is not a
    sampling parameter stops the job (InputError) naming the file, column and field."""
    from jobs.plan.planner import plan_job

    inp = write_input(tmp_path)
    with pytest.raises(InputError, match="column 'nope' .input.sampling_column. not found"):
        plan_job(spec_for(inp, tmp_path / "o", sampling_column="nope"))
    with pytest.raises(InputError, match="input.sampling_column 'prompt' has type string; expected a struct"):
        plan_job(spec_for(inp, tmp_path / "o", sampling_column="prompt"))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "params": pa.array([{"temprature": 0.5}])}), bad)
    with pytest.raises(InputError, match="bad.parquet: input.sampling_column 'params' has field 'temprature'"):
        plan_job(spec_for(bad, tmp_path / "o", id_column=None))
    plan = plan_job(spec_for(inp, tmp_path / "o"))
    assert plan.expected_rows == {0: sum(EXPECTED_ROWS)}
    other = plan_job(spec_for(inp, tmp_path / "o", sampling_column=None))
    assert other.fingerprint != plan.fingerprint and other.expected_rows == {}


def test_mixed_rows_in_one_unit_equal_each_request_alone(ray_local, tmp_path):
    from engine import load_engine
    from jobs.outputs.output_dir import OutputDir
    from jobs.runner import run_job

    inp = write_input(tmp_path / "in")
    spec = spec_for(inp, tmp_path / "out")
    assert run_job(spec, progress=False, echo=False) == 0
    od = OutputDir(str(tmp_path / "out"))
    assert od.verify() == []
    rows = od.read_part(0).to_pylist()
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["prompt_id"], []).append(r)
    assert [len(by_id[f"r{i}"]) for i in range(len(ROWS))] == EXPECTED_ROWS

    for i in (3, 4):
        (field,) = [k for k in ROWS[i][1]]
        for r in by_id[f"r{i}"]:
            assert r["finish_reason"] == "error" and f"row {i} column 'params' field '{field}': must be" in r["error"]

    import torch

    threads = torch.get_num_threads()
    # the job's dtype (auto: this machine's choice, as its worker made it) and thread count
    eng = load_engine("tiny-random", device="cpu", dtype="auto", num_threads=1)
    try:
        _compare_alone(eng, spec, by_id)
    finally:
        torch.set_num_threads(threads)
    greedy = by_id["r1"]
    assert len({tuple(r["tokens"]) for r in greedy}) == 1 and all(len(r["tokens"]) <= 4 for r in greedy)
    assert any(r["stop_reason"] in ("e", "a") for r in by_id["r2"])
    assert all(len(r["tokens"]) <= 6 for r in by_id["r0"])  # the job's max_tokens


def _compare_alone(eng, spec, by_id):
    from engine.tokenizers.stop_strings import completion_text

    base = spec.sampling_params()
    for i, (_, value) in enumerate(ROWS):
        if i in (3, 4):
            continue
        params, err = row_params(base, value)
        got = by_id[f"r{i}"]
        alone = eng.generate([got[0]["prompt_tokens"]], params, prompt_ids=[f"r{i}"])[0]
        for r, s in zip(got, alone):
            assert r["tokens"] == s.tokens and r["logprobs"] == pytest.approx(s.logprobs, abs=0, rel=0)
            assert r["finish_reason"] == s.finish_reason and r["num_tokens"] == len(s.tokens) <= params.max_tokens
            assert r["text"] == completion_text(eng.tokenizer, s.tokens, s.stop_reason)
            if isinstance(s.stop_reason, str):
                assert r["stop_reason"] == s.stop_reason and s.stop_reason not in r["text"]


def test_a_staged_input_keeps_its_sampling_column(ray_local, tmp_path):
    """A file whose one row group is larger than 2 x unit_rows is staged (re-chunked into the
    output directory) before the units run; the copy keeps the sampling column with the
    prompt, id and passthrough columns, so each row still gets what it asked for (it used to
    be dropped, and every unit failed reading the copy)."""
    from jobs.outputs.output_dir import OutputDir
    from jobs.runner import run_job

    rows = ROWS * 3  # 21 rows in one row group: staged at unit_rows 8
    (tmp_path / "in").mkdir()
    inp = tmp_path / "in" / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(rows))], "prompt": [p for p, _ in rows],
                             "params": pa.array([v for _, v in rows], type=PARAMS_TYPE)}), inp)
    spec = spec_for(inp, tmp_path / "out")
    assert run_job(spec, progress=False, echo=False) == 0
    od = OutputDir(str(tmp_path / "out"))
    assert od.verify() == [] and list((tmp_path / "out" / "_batchgen" / "staged").iterdir())
    counts: dict[str, int] = {}
    for i in sorted(od.committed_units()):
        for pid in od.read_part(i).column("prompt_id").to_pylist():
            counts[pid] = counts.get(pid, 0) + 1
    assert [counts[f"r{i}"] for i in range(len(rows))] == EXPECTED_ROWS * 3
