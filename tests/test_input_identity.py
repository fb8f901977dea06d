"""A resume must not mix two inputs (issue 20, item 6): an input file replaced by another of
the same name, size and row count used to resume into mixed data, the fingerprint holding only
those three. Now a Parquet file is also identified by its footer's sha256 (row groups, column
chunk offsets and sizes, statistics) and its modification time, and the refusal names the
file."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.errors import OutputError


def _write(path, prompts, **kw):
    pq.write_table(pa.table({"prompt": prompts}), path, compression="none", use_dictionary=False,
                   row_group_size=2, **kw)


def _spec(tmp_path, prompts_path):
    from jobs.spec import JobSpec

    return JobSpec.from_dict({"model": {"path": "tiny-random"}, "input": {"path": str(prompts_path)},
                              "output": {"path": str(tmp_path / "out")}, "sampling": {"num_samples": 1}}, "t.yaml")


@pytest.mark.parametrize("statistics", [True, False], ids=["footer-differs", "only-the-time-differs"])
def test_a_replaced_input_of_the_same_size_and_rows_is_not_resumed(tmp_path, statistics):
    """The replacement has the same name, byte size and rows. With column statistics its
    footer differs; without them the footer can be byte-identical and the modification time
    tells. Either way the plan's fingerprint changes and the output refuses the resume,
    naming the file; the untouched file resumes."""
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job

    prompts = tmp_path / "prompts.parquet"
    _write(prompts, ["apple", "berry", "cherry", "damson"], write_statistics=statistics)
    spec = _spec(tmp_path, prompts)
    first = plan_job(spec)
    out = OutputDir(spec.output.path)
    assert out.prepare(first, spec) == "new"
    assert out.prepare(plan_job(spec), spec) == "resume"

    size, mtime = prompts.stat().st_size, prompts.stat().st_mtime_ns
    _write(prompts, ["grape", "lemon", "mangos", "orange"], write_statistics=statistics)
    if statistics:
        os.utime(prompts, ns=(mtime, mtime))  # the same time: only the footer tells
    else:
        os.utime(prompts, ns=(mtime + 10**9, mtime + 10**9))
    assert prompts.stat().st_size == size and pq.ParquetFile(prompts).metadata.num_rows == 4
    second = plan_job(spec)
    assert second.fingerprint != first.fingerprint
    with pytest.raises(OutputError, match=r"input file prompts\.parquet: changed since the output was written"):
        out.prepare(second, spec)


def test_the_footer_hash_reads_only_the_footer(tmp_path):
    """The identity costs a footer read, not the file: a truncated file is refused by name."""
    from jobs.errors import InputError
    from jobs.plan.planner import plan_job

    prompts = tmp_path / "prompts.parquet"
    _write(prompts, ["a", "b"])
    plan = plan_job(_spec(tmp_path, prompts))
    content = plan.fingerprint_data["input"]["files"][0][3]
    assert set(content) == {"footer_sha256", "mtime_ns"} and content["mtime_ns"] == prompts.stat().st_mtime_ns
    prompts.write_bytes(prompts.read_bytes()[:-3])
    with pytest.raises(InputError, match="prompts.parquet: not a readable Parquet file"):
        plan_job(_spec(tmp_path, prompts))


def test_an_output_of_an_older_layout_is_not_resumed(tmp_path, monkeypatch):
    """A release that changes the output's rows (here: the weight_version column and the
    tool_calls fields) bumps FINGERPRINT_VERSION, so an output written by the previous release
    is never resumed into a mix of two layouts; the refusal says why."""
    import jobs.plan.fingerprint as fp
    from jobs.outputs.output_dir import OutputDir
    from jobs.outputs.schema import output_schema  # noqa: F401 - the layout the version guards
    from jobs.plan.planner import plan_job

    prompts = tmp_path / "prompts.parquet"
    _write(prompts, ["apple", "berry"])
    spec = _spec(tmp_path, prompts)
    monkeypatch.setattr(fp, "FINGERPRINT_VERSION", fp.FINGERPRINT_VERSION - 1)
    old = plan_job(spec)
    monkeypatch.undo()
    out = OutputDir(spec.output.path)
    assert out.prepare(old, spec) == "new"
    with pytest.raises(OutputError, match=r"written by another batchgen release"):
        out.prepare(plan_job(spec), spec)
