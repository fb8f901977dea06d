"""jobs.outputs (OutputDir, commit) + jobs.task.write_unit: atomic unit files, manifest resume/mismatch/overwrite,
status and verify catching each kind of corruption."""
from __future__ import annotations

import collections

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from engine.params import RequestOutput, Sample, ToolCall, error_output
from jobs.errors import OutputError
from jobs.outputs.layout import MANIFEST, SUCCESS, part_name
from jobs.outputs.output_dir import OutputDir
from jobs.outputs.schema import OUTPUT_SCHEMA
from jobs.plan.planner import plan_job
from jobs.spec import JobSpec
from jobs.task import JobTask

ROOT = Path(__file__).resolve().parent.parent


class FakeTok:
    vocab_size = 300
    bos_token_id = 1
    prepend_bos = False

    def encode(self, s):
        return [b + 10 for b in s.encode()]

    def decode(self, ids):
        return bytes(i - 10 for i in ids if i >= 10).decode(errors="replace")


def make_job(tmp_path, n=10, unit_rows=4, num_samples=2, **over):
    inp = tmp_path / "in.parquet"
    if not inp.exists():
        pq.write_table(pa.table({"prompt": [f"q{i}" if i != 3 else None for i in range(n)],
                                 "answer": list(range(n))}), inp)
    d = {"input": {"path": str(inp), "passthrough": ["answer"]}, "output": {"path": str(tmp_path / "out")},
         "sampling": {"num_samples": num_samples}, "cluster": {"unit_rows": unit_rows}}
    for k, v in over.items():
        sec, key = k.split("__")
        d.setdefault(sec, {})[key] = v
    spec = JobSpec.from_dict(d, "job.yaml")
    plan = plan_job(spec)
    return spec, plan, JobTask(spec, plan), OutputDir(spec.output.path)


def fake_outputs(task, reqs):
    outs = []
    for r in reqs:
        if r.prompt_tokens is None:
            outs.append(error_output(None, r.prompt_id, None, task.params, r.error))
            continue
        samples = [Sample(prompt_id=r.prompt_id, sample_index=j, tokens=[10 + 72, 10 + 105, 11], mask=[1, 0, 1],
                          logprobs=[-0.5, None, -1.25], finish_reason="stop",
                          tool_calls=[ToolCall(0, 2, "1+1", "2", None), ToolCall(2, 3, "1/0", None, "ZeroDivisionError")],
                          num_prompt_tokens=len(r.prompt_tokens), seed=task.params.seed)
                   for j in range(task.params.num_samples)]
        outs.append(RequestOutput(request_id=None, prompt_id=r.prompt_id, prompt_tokens=r.prompt_tokens, samples=samples))
    return outs


def run_unit(task, unit, tok=None):
    tok = tok or FakeTok()
    reqs = task.read_unit(unit, tok)
    return task.write_unit(unit, reqs, fake_outputs(task, reqs), tok)


def run_all(spec, plan, task, od):
    od.prepare(plan, spec)
    return [run_unit(task, u) for u in plan.units]


def test_write_unit_schema_rows_and_counts(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    assert od.prepare(plan, spec) == "new"
    res = run_unit(task, plan.units[0])
    assert res.index == 0 and res.path == str(tmp_path / "out" / "part-000000.parquet")
    assert (res.prompts, res.rows, res.generated_tokens, res.tool_calls, res.tool_errors, res.error_rows) == (4, 8, 18, 12, 6, 2)
    assert res.prompt_tokens == 3 * 2  # "q0","q1","q2" -> 2 tokens each; the null row has none
    t = pq.read_table(res.path)
    assert t.schema.names == OUTPUT_SCHEMA.names + ["answer"]
    for f in OUTPUT_SCHEMA:
        assert t.schema.field(f.name).type.equals(f.type) or str(f.type).replace("item", "element") == str(
            t.schema.field(f.name).type), f.name
    rows = t.to_pylist()
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [
        (f"in.parquet:{i}", j) for i in range(4) for j in range(2)]
    r0 = rows[0]
    assert r0["tokens"] == [82, 115, 11] and r0["mask"] == [1, 0, 1] and r0["logprobs"] == [-0.5, None, -1.25]
    assert r0["text"] == "Hi\x01" and r0["finish_reason"] == "stop" and r0["num_tokens"] == 3
    assert r0["tool_calls"][1] == {"start": 2, "end": 3, "expr": "1/0", "output": None, "error": "ZeroDivisionError",
                                   "name": None, "arguments": None, "latency_s": None, "forced_start": None}
    assert r0["answer"] == 0 and r0["error"] is None and r0["prompt_tokens"] == [10 + ord("q"), 10 + ord("0")]
    bad = rows[6]
    assert bad["finish_reason"] == "error" and "in.parquet row 3 column 'prompt': prompt is null" in bad["error"]
    assert bad["prompt_tokens"] is None and bad["text"] is None and bad["answer"] == 3
    meta = pq.read_schema(res.path).metadata
    assert meta[b"batchgen.fingerprint"].decode() == plan.fingerprint
    assert json.loads(meta[b"batchgen.unit"])["row_start"] == 0


def test_write_unit_rejects_mismatched_outputs(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    reqs = task.read_unit(plan.units[0], FakeTok())
    outs = fake_outputs(task, reqs)
    with pytest.raises(ValueError):
        task.write_unit(plan.units[0], reqs, outs[:-1], FakeTok())
    outs[0].samples.pop()
    with pytest.raises(ValueError, match="expected 0..1"):
        task.write_unit(plan.units[0], reqs, outs, FakeTok())
    assert od.committed_units() == set()


def test_task_pickles_small(tmp_path):
    import pickle

    spec, plan, task, od = make_job(tmp_path)
    clone = pickle.loads(pickle.dumps(task))
    assert clone.fingerprint == task.fingerprint and len(pickle.dumps(task)) < 10_000


KILLER = """
import os, sys
sys.path.insert(0, {root!r})
import jobs.outputs.commit as out
import pyarrow as pa
def die(*a):
    os._exit(9)
out.os.link = die
out.write_part({path!r}, 3, pa.table({{"x": [1, 2]}}))
"""


def test_kill_between_write_and_commit_leaves_no_part_file(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), path=od.path)])
    assert proc.returncode == 9
    names = os.listdir(od.path)
    assert not any(n.startswith("part-") for n in names)
    assert len([n for n in names if n.startswith(".tmp-part-000003-")]) == 1
    assert od.committed_units() == set()
    assert od.status()["temp_files"] == 1
    assert any("orphan temporary file" in p for p in od.verify())
    # resuming (same job) removes the orphan
    assert od.prepare(plan, spec) == "resume"
    assert od.temp_files() == [] and od.verify() == []


def test_failed_write_removes_temp(tmp_path, monkeypatch):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr("jobs.outputs.commit.os.link", boom)
    monkeypatch.setattr("jobs.outputs.commit.os.replace", boom)
    with pytest.raises(OSError):
        run_unit(task, plan.units[0])
    assert [n for n in os.listdir(od.path) if not n.startswith("_")] == []


def test_first_commit_wins(tmp_path, monkeypatch):
    """A unit written twice (a retry, or a second copy after a deadline) keeps the first
    file: the second commit finds it and leaves it alone, also where the filesystem has no
    hard links (the rename fallback)."""
    from jobs.outputs.commit import write_part

    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    first = pa.table({"x": [1]})
    path = write_part(od.path, 0, first)
    before = (Path(path).stat().st_ino, Path(path).read_bytes())
    assert write_part(od.path, 0, pa.table({"x": [2]})) == path
    assert (Path(path).stat().st_ino, Path(path).read_bytes()) == before

    def no_links(*a):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr("jobs.outputs.commit.os.link", no_links)
    write_part(od.path, 0, pa.table({"x": [3]}))
    write_part(od.path, 1, pa.table({"x": [4]}))
    assert pq.read_table(path).column("x").to_pylist() == [1]
    assert pq.read_table(Path(od.path) / part_name(1)).column("x").to_pylist() == [4]
    assert od.temp_files() == []


def test_without_hard_links_a_racing_second_copy_cannot_replace_a_committed_part(tmp_path, monkeypatch, caplog):
    """Where the filesystem has no hard links (link fails with EPERM, as on vfat), two copies
    of unit 0 race: copy B commits at the worst moment for copy A, just before A's part gets
    its name. Exactly one commit wins and its part stays (before the fix: A checked that the
    part was absent, B committed, A's rename replaced B's part, and both reported a commit).
    No warning: this filesystem refuses to replace in the rename itself (RENAME_NOREPLACE)."""
    import errno

    from jobs.outputs import commit

    final = str(tmp_path / part_name(0))
    results = []

    def copy_b():
        results.append(("B", commit.commit_file(pafs.LocalFileSystem(), final, b"B" * 16, ".tmp-part-000000")))

    def no_links(*a):
        raise OSError(errno.EPERM, "Operation not permitted")

    real_exists, real_rename = os.path.exists, getattr(commit, "_rename_noreplace", None)
    staged = []

    def exists_then_b(path):  # the check of a check-then-rename, then B lands
        seen = real_exists(path)
        if path == final and not staged:
            staged.append(1)
            copy_b()
        return seen

    def b_then_rename(src, dst):  # B lands just before A's rename
        if dst == final and not staged:
            staged.append(1)
            copy_b()
        return real_rename(src, dst)

    monkeypatch.setattr(commit.os, "link", no_links)
    monkeypatch.setattr(commit.os.path, "exists", exists_then_b)
    monkeypatch.setattr(commit, "_rename_noreplace", b_then_rename, raising=False)
    with caplog.at_level(logging.WARNING):
        results.append(("A", commit.commit_file(pafs.LocalFileSystem(), final, b"A" * 16, ".tmp-part-000000")))
    assert staged, "copy B never ran"
    assert results == [("B", True), ("A", False)], results
    assert Path(final).read_bytes() == b"B" * 16, "copy A replaced the part copy B had committed"
    assert os.listdir(tmp_path) == [part_name(0)]
    assert not [r for r in caplog.records if "RENAME_NOREPLACE" in r.getMessage()]


def test_without_hard_links_nor_noreplace_renames_commits_check_then_rename_with_a_warning(tmp_path, monkeypatch,
                                                                                          caplog):
    """A filesystem refusing both hard links and RENAME_NOREPLACE (renameat2 fails with
    EINVAL, as NFS does): a commit checks that the part is absent, then renames, and says
    once per directory what that leaves open; a committed part is still never written again."""
    import errno

    from jobs.outputs import commit

    def refuse(*a):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(commit.os, "link", refuse)
    monkeypatch.setattr(commit, "_rename_noreplace", lambda src, dst: None)
    fs, final = pafs.LocalFileSystem(), str(tmp_path / part_name(0))
    with caplog.at_level(logging.WARNING):
        assert commit.commit_file(fs, final, b"A", ".tmp-part-000000")
        assert not commit.commit_file(fs, final, b"B", ".tmp-part-000000")
        assert commit.commit_file(fs, str(tmp_path / part_name(1)), b"C", ".tmp-part-000001")
    warnings = [r.getMessage() for r in caplog.records if "RENAME_NOREPLACE" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0], warnings
    assert Path(final).read_bytes() == b"A" and sorted(os.listdir(tmp_path)) == [part_name(0), part_name(1)]


def test_status_and_verify_clean(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    st = od.status()
    assert (st["units_done"], st["units_total"], st["rows"], st["rows_expected"], st["prompts"]) == (3, 3, 20, 20, 10)
    assert st["error_rows"] == 2 and st["tool_calls"] == 36 and st["success"] is False
    assert od.verify() == []
    od.mark_success({"rows": 20})
    assert od.status()["success"] and od.status()["summary"] == {"rows": 20}
    assert od.verify() == []


def test_manifest_contents(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["fingerprint"] == plan.fingerprint and m["spec"]["sampling"]["num_samples"] == 2
    assert [u["expected_rows"] for u in m["units"]] == [8, 8, 4]
    assert m["files"][0]["num_rows"] == 10 and m["batchgen_version"] and m["created"]


def test_passthrough_declared_non_nullable_in_first_file_takes_nulls_of_later_files(tmp_path):
    """A passthrough column the first input file declares non-nullable, with a null in a later
    file: every unit commits (the output's passthrough field is nullable), verify is clean,
    the manifest's output_schema text is what it was before the fix, and a part written
    before it (the column non-nullable) still verifies and resumes."""
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1, 2]},
                            schema=pa.schema([("prompt", pa.string()),
                                              pa.field("answer", pa.int64(), nullable=False)])),
                   d / "a.parquet")
    pq.write_table(pa.table({"prompt": ["c", "d"], "answer": pa.array([3, None], pa.int64())}), d / "b.parquet")
    spec, plan, task, od = make_job(tmp_path, input__path=str(d), cluster__unit_rows=2)
    run_all(spec, plan, task, od)  # before the fix: unit 1 raised "declared non-nullable but contains nulls"
    assert od.committed_units() == {0, 1} and od.verify() == []
    assert pq.read_table(Path(od.path) / part_name(1)).column("answer").to_pylist() == [3, 3, None, None]
    # the manifest's schema text ignores top-level nullability: an output written before the fix
    # (its field non-nullable) has the same manifest and fingerprint, so it resumes
    m = json.loads((Path(od.path) / MANIFEST).read_text())
    assert ["answer", "int64"] in m["output_schema"]
    old = pq.read_table(Path(od.path) / part_name(0))
    i = old.schema.get_field_index("answer")
    old_schema = old.schema.set(i, old.schema.field(i).with_nullable(False))
    pq.write_table(old.cast(old_schema), Path(od.path) / part_name(0))
    assert not pq.read_schema(Path(od.path) / part_name(0)).field("answer").nullable
    assert od.verify() == [] and od.prepare(plan, spec) == "resume"


def corrupt(kind, tmp_path, od, plan, task):
    out = Path(od.path)
    if kind == "rows":
        t = pq.read_table(out / part_name(0))
        pq.write_table(t.slice(0, 5).replace_schema_metadata(t.schema.metadata), out / part_name(0))
        return "part-000000.parquet: 5 rows, expected 8"
    if kind == "fingerprint":
        t = pq.read_table(out / part_name(1))
        meta = dict(t.schema.metadata)
        meta[b"batchgen.fingerprint"] = b"0" * 64
        pq.write_table(t.replace_schema_metadata(meta), out / part_name(1))
        return "part-000001.parquet: fingerprint 000000000000 does not match"
    if kind == "unit_metadata":  # valid JSON, not an object (verify raised AttributeError)
        t = pq.read_table(out / part_name(1))
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"batchgen.unit": b"[1]"}), out / part_name(1))
        return "part-000001.parquet: unit metadata says index None, expected 1"
    if kind == "schema":
        t = pq.read_table(out / part_name(2))
        pq.write_table(t.drop_columns(["text"]).replace_schema_metadata(t.schema.metadata), out / part_name(2))
        return "part-000002.parquet: schema mismatch"
    if kind == "duplicate":
        t = pq.read_table(out / part_name(0))
        pq.write_table(t, out / part_name(1))  # same prompt ids in another unit
        return "duplicate row prompt_id='in.parquet:0' sample_index=0"
    if kind == "duplicate_in_file":  # right row count, one (prompt, sample) twice
        t = pq.read_table(out / part_name(0))
        pq.write_table(pa.concat_tables([t.slice(0, 7), t.slice(2, 1)]).replace_schema_metadata(t.schema.metadata),
                       out / part_name(0))
        return "part-000000.parquet: duplicate row prompt_id='in.parquet:1' sample_index=0 (twice in this file)"
    if kind == "orphan":
        (out / ".tmp-part-000001-abcdef.parquet").write_bytes(b"partial")
        return ".tmp-part-000001-abcdef.parquet: orphan temporary file"
    if kind == "orphan_in_batchgen":  # a manifest, lease or hash cache write cut short (status counts it)
        (out / "_batchgen" / ".tmp-0123abcd").write_text("{")
        return "_batchgen/.tmp-0123abcd: orphan temporary file"
    if kind == "unexpected":
        (out / "notes.txt").write_text("hi")
        return "notes.txt: unexpected file"
    if kind == "extra_unit":
        (out / "part-000099.parquet").write_bytes((out / part_name(0)).read_bytes())
        return "part-000099.parquet: unexpected file"
    if kind == "success_missing":
        od.mark_success({})
        os.remove(out / part_name(2))
        return "_SUCCESS is present but 1 of 3 units are missing"
    if kind == "truncated":
        data = (out / part_name(0)).read_bytes()
        (out / part_name(0)).write_bytes(data[: len(data) // 2])
        return "part-000000.parquet: unreadable Parquet file"
    if kind == "other_unit_rows":  # unit 0's rows under unit 1's name and metadata, unit 0 absent
        t0, t1 = pq.read_table(out / part_name(0)), pq.read_table(out / part_name(1))
        pq.write_table(t0.replace_schema_metadata(t1.schema.metadata), out / part_name(1))
        os.remove(out / part_name(0))
        return "part-000001.parquet: prompt_id 'in.parquet:0' is not a prompt of its unit (in.parquet rows 4..7)"
    if kind == "fewer_prompts":  # right row count, no duplicate, one prompt's rows given to another
        t = pq.read_table(out / part_name(0))
        ids, si = t.column("prompt_id").to_pylist(), t.column("sample_index").to_pylist()
        ids[6:8], si[6:8] = ["in.parquet:2"] * 2, [2, 3]
        t = t.set_column(0, "prompt_id", pa.array(ids)).set_column(1, "sample_index", pa.array(si, pa.int32()))
        pq.write_table(t, out / part_name(0))
        return "part-000000.parquet: 3 distinct prompt ids, expected its unit's 4 prompts (in.parquet rows 0..3)"
    if kind == "alias_name":  # read by every `part-*.parquet` glob next to part-000001.parquet
        (out / "part-0000001.parquet").write_bytes((out / part_name(1)).read_bytes())
        return "part-0000001.parquet: unexpected file"
    if kind == "bad_success":  # `status` shows its summary as {"unreadable": true}
        (out / SUCCESS).write_text("{")
        return "_SUCCESS: unreadable summary"
    if kind == "no_manifest":
        os.remove(out / MANIFEST)
        return "manifest _batchgen/manifest.json is missing"
    if kind == "bad_manifest":
        (out / MANIFEST).write_text("{not json")
        return "manifest.json is unreadable"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["rows", "fingerprint", "unit_metadata", "schema", "duplicate", "duplicate_in_file", "orphan",
                                  "orphan_in_batchgen", "unexpected", "extra_unit",
                                  "success_missing", "truncated", "no_manifest", "bad_manifest", "other_unit_rows",
                                  "fewer_prompts", "alias_name", "bad_success"])
def test_verify_catches(tmp_path, kind):
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    assert od.verify() == []
    expected = corrupt(kind, tmp_path, od, plan, task)
    problems = od.verify()
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("edit, why", [
    (lambda m: m["units"][1].pop("expected_rows"), "units[1] has no expected_rows"),
    (lambda m: m["units"][1].update(expected_rows="8"), "units[1] expected_rows must be a non-negative integer, got '8'"),
    (lambda m: m["units"].__setitem__(2, None), "units[2] must be an object with index"),
    (lambda m: m["units"][0].pop("index"), "units[0] has no index"),
    (lambda m: m["units"][2].update(index=0), "units[2] index 0 is also the index of an earlier unit"),
    (lambda m: m["units"][1].update(row_end=None), "units[1] row_end must be a non-negative integer, got None"),
    (lambda m: m.update(units=5), "units must be a list, got int"),
    (lambda m: m.update(fingerprint=None), "fingerprint must be a string, got None"),
    (lambda m: m.update(fingerprint_data=[1]), "fingerprint_data must be an object, got list"),
    (lambda m: m.update(output_schema=[["prompt_id"]]), "output_schema must be a list of [column, type] pairs"),
    (lambda m: m.update(num_prompts="10"), "num_prompts must be a non-negative integer, got '10'"),
    (lambda m: m.update(checkpoint_sha256=[]), "checkpoint_sha256 must be an object, got list"),
    (lambda m: m.update(auto_dtype="bf16"), "auto_dtype must be one of float32, bfloat16, float16, got 'bf16'"),
    (lambda m: m.update(kernels="avx2"), "kernels must be one of compiled, torch, got 'avx2'"),
])
def test_a_damaged_manifest_entry_is_named_by_status_verify_plan_and_run(tmp_path, edit, why):
    """A manifest whose values are hand-edited or wrong (a unit entry without a key, a value of
    the wrong type) is an error naming the file and the entry: `status` and `run` exit 2,
    `verify` reports it as its problem, `plan` says `run` refuses it; they raised KeyError or
    TypeError from the middle of reading the parts."""
    from jobs.cli import main
    from jobs.plan.report import describe_plan

    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    path = Path(od.path) / MANIFEST
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    want = f"{MANIFEST} is damaged: {why}"
    with pytest.raises(OutputError, match=re.escape(want)):
        od.status()
    assert main(["status", od.path]) == 2
    problems = od.verify()
    assert len(problems) == 1 and want in problems[0], problems
    assert main(["verify", od.path]) == 1
    text, code = describe_plan(spec)
    assert code == 2 and want in text, text
    with pytest.raises(OutputError, match=re.escape(want) + ".*pass --overwrite"):
        od.prepare(plan, spec)
    assert od.prepare(plan, spec, overwrite=True) == "overwrite"


def test_dtype_auto_is_recorded_once_and_binds_a_resume(tmp_path):
    """What model.dtype "auto" resolved to is recorded in the manifest (once: another
    dtype is refused, naming both), `plan` shows it for a resume, and the runner gives it
    to the resumed run's workers in place of "auto" (an explicit dtype is left alone)."""
    from types import SimpleNamespace

    from jobs.plan.report import describe_plan
    from jobs.runner import bind_auto_dtype

    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    auto = SimpleNamespace(engine_kwargs={"dtype": "auto"})
    assert od.recorded()["auto_dtype"] is None and bind_auto_dtype(auto, od, None) is None and auto.engine_kwargs["dtype"] == "auto"
    od.record_auto_dtype("bfloat16")
    od.record_auto_dtype("bfloat16")
    with pytest.raises(OutputError, match="rows are computed with auto_dtype bfloat16 .* resolved model.dtype auto to float32"):
        od.record_auto_dtype("float32")
    assert od.recorded()["auto_dtype"] == "bfloat16" and od.prepare(plan, spec) == "resume"
    assert bind_auto_dtype(auto, od, od.recorded()["auto_dtype"]) == "bfloat16" and auto.engine_kwargs["dtype"] == "bfloat16"
    explicit = SimpleNamespace(engine_kwargs={"dtype": "float32"})
    assert bind_auto_dtype(explicit, od, "bfloat16") is None and explicit.engine_kwargs["dtype"] == "float32"
    text, code = describe_plan(spec)
    assert code == 0 and "dtype:         bfloat16 (model.dtype auto" in text
    # the runner's callback names a write the store refuses (it raised the store's bare error)
    from jobs.errors import JobFailed
    from jobs.runner import recorder

    def refuse(name, text):
        raise OSError("read-only file system")

    (tmp_path / "new").mkdir()
    spec, plan, _, fresh = make_job(tmp_path / "new")
    fresh.prepare(plan, spec)
    fresh._write_atomic = refuse
    with pytest.raises(JobFailed, match=r"cannot record in .*out's manifest that model.dtype auto resolved to float32 "
                                        r"\(OSError: read-only file system\)"):
        recorder(fresh.record_auto_dtype, fresh, "model.dtype auto resolved to")("float32")


def test_workers_of_the_other_cpu_kernels_are_refused(tmp_path):
    """Rows computed with torch's CPU kernels (a machine without a C++ compiler) differ in
    their last bits from the compiled kernels': the first ready CPU worker's kind binds the
    run and is recorded in the manifest (a resume on a machine without a compiler silently
    finished an output begun with them), a worker of the other kind is refused naming why
    and what to do, and a resume gives the recorded kind (OutputDir.kernels) to the slots.
    GPU workers (kernels None) are not concerned."""
    from types import SimpleNamespace

    from cluster.health import WorkerRecord, WorkerSlots
    from jobs.plan.report import describe_plan

    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)

    def slots(kernels=None):
        return WorkerSlots(SimpleNamespace(engine_kwargs={"dtype": "float32"}), num_workers=2, num_cpus=1, num_gpus=0,
                           in_flight_per_worker=2, actor_options=None, suspect_timeout_s=None, start_timeout_s=60,
                           max_start_failures=2, may_add_nodes=False, events=collections.deque(),
                           kernels=kernels, on_kernels=od.record_kernels)

    def worker(name, kernels):
        return WorkerRecord(name=name, slot=0, handle=None, ready_ref=None, created=0.0,
                            info={"host": "h", "kernels": kernels, "dtype": "float32"})

    s = slots()
    first, torch_one, gpu = worker("w0", "compiled"), worker("w1", "torch"), worker("w2", None)
    assert s.refuse_kernels(first) is None
    s._bind(first)
    assert od.recorded()["kernels"] == "compiled" and s.kernels == "compiled"
    why = s.refuse_kernels(torch_one)
    assert "has no compiled kernels" in why and "this run's workers are computed with them" in why
    assert s.refuse_kernels(gpu) is None
    resumed = slots(od.recorded()["kernels"])  # a resume: the output's record, not the first worker's, binds
    assert "but this output's rows were computed with them" in resumed.refuse_kernels(torch_one)
    assert resumed.refuse_kernels(worker("w3", "compiled")) is None
    text, code = describe_plan(spec)
    assert code == 0 and "kernels:       compiled" in text
    with pytest.raises(OutputError, match="rows are computed with kernels compiled"):
        od.record_kernels("torch")


def test_status_counts_only_committed_and_reports_unreadable(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    run_unit(task, plan.units[2])
    st = od.status()
    assert (st["units_done"], st["rows"], st["prompts"]) == (1, 4, 2)
    (Path(od.path) / part_name(0)).write_bytes(b"garbage")
    assert od.status()["unreadable_units"] and od.status()["units_done"] == 1
    os.remove(Path(od.path) / MANIFEST)
    with pytest.raises(OutputError, match="no _batchgen/manifest.json"):
        od.status()


@pytest.mark.parametrize("counts", [b"{", b"[1]", b'{"prompts": "x"}'])
def test_status_names_a_part_whose_counts_metadata_is_damaged(tmp_path, counts):
    """A part file whose batchgen.counts metadata is not a JSON object of counts (a file
    rewritten by another tool) is listed as unreadable by `status`, naming it, and not
    counted; status raised JSONDecodeError or TypeError from its footer thread."""
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    t = pq.read_table(Path(od.path) / part_name(0))
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"batchgen.counts": counts}),
                   Path(od.path) / part_name(0))
    st = od.status()
    assert st["units_done"] == 2 and st["rows"] == 12, st
    assert [u.split(":")[0] for u in st["unreadable_units"]] == [part_name(0)], st["unreadable_units"]
    assert "batchgen.counts metadata is not an object of counts" in st["unreadable_units"][0]


@pytest.mark.parametrize("counts, why", [
    (b"{", "its batchgen.counts metadata is not an object of counts"),
    (b"[1]", "its batchgen.counts metadata is not an object of counts"),
    (b'{"prompts": "x"}', "its batchgen.counts metadata is not an object of counts"),
    (b'{"prompts": -4}', "its batchgen.counts metadata is not an object of counts"),
    (b'{"prompts": true}', "its batchgen.counts metadata is not an object of counts"),
    (None, "it has no batchgen.counts metadata"),
])
def test_verify_reports_every_part_status_cannot_count(tmp_path, counts, why):
    """A part whose batchgen.counts metadata `status` cannot read (so lists as unreadable and
    leaves out of its numbers) is a problem for `verify` too, named alike, and `batchgen
    verify` exits 1: verify did not read that metadata and called the output fine."""
    from jobs.cli import main

    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    t = pq.read_table(Path(od.path) / part_name(0))
    meta = {k: v for k, v in t.schema.metadata.items() if k != b"batchgen.counts"}
    pq.write_table(t.replace_schema_metadata(meta if counts is None else {**meta, b"batchgen.counts": counts}),
                   Path(od.path) / part_name(0))
    st = od.status()
    assert st["units_done"] == 2 and st["unreadable_units"] == [f"{part_name(0)}: {why}" + (
        f": {counts!r}" if counts else "")], st["unreadable_units"]
    problems = od.verify()
    assert problems == [f"{part_name(0)}: {why}" + (f": {counts!r}" if counts else "")], problems
    assert main(["verify", od.path]) == 1


@pytest.mark.parametrize("key", ["prompts", "rows", "generated_tokens", "prompt_tokens", "tool_calls", "tool_errors",
                                 "error_rows"])
def test_verify_finds_counts_metadata_the_rows_contradict(tmp_path, key):
    """`status` sums each part's batchgen.counts metadata without reading rows: `verify`
    checks every count it holds against the rows (as jobs/task.py counts them), so a part
    whose metadata says other numbers than its rows (rewritten by another tool, the metadata
    kept) is named with the count, and status's number is not taken on trust."""
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    path = Path(od.path) / part_name(0)  # prompt 3 (null: error rows, no prompt tokens) is in unit 0
    t = pq.read_table(path)
    c = json.loads(t.schema.metadata[b"batchgen.counts"])
    assert c == {"prompts": 4, "rows": 8, "generated_tokens": 18, "prompt_tokens": 6, "tool_calls": 12,
                 "tool_errors": 6, "error_rows": 2, "input_rows_decoded": 10}
    real = c[key]
    c[key] += 1
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"batchgen.counts": json.dumps(c).encode()}), path)
    before = od.status()
    assert od.verify() == [f"{part_name(0)}: its batchgen.counts metadata says {key} {real + 1}, its rows hold {real} "
                           f"(`batchgen status` reports the metadata)"]
    assert key == "rows" or before[key] == {"prompts": 10, "generated_tokens": 54, "prompt_tokens": 18,
                                            "tool_calls": 36, "tool_errors": 18, "error_rows": 2}[key] + 1


def test_a_part_name_with_more_digits_is_no_unit(tmp_path):
    """part-0000001.parquet matches the part pattern, but only part_name(1) is unit 1's file:
    `status` counted the copy as a fourth unit of three (and its rows twice), and a resume
    took it for unit 1 when part-000001.parquet was gone. Now it is an unexpected file that
    `verify` names (every `part-*.parquet` glob reads it), and unit 1 runs again."""
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    out = Path(od.path)
    (out / "part-0000001.parquet").write_bytes((out / part_name(1)).read_bytes())
    st = od.status()
    assert (st["units_done"], st["units_total"], st["rows"], st["rows_expected"]) == (3, 3, 20, 20), st
    assert od.verify() == ["part-0000001.parquet: unexpected file (not a unit of this job)"]
    os.remove(out / part_name(1))
    assert od.committed_units() == {0, 2} and od.status()["units_done"] == 2


def test_resume_keeps_committed_units(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    run_unit(task, plan.units[0])
    spec2, plan2, task2, od2 = make_job(tmp_path, cluster__num_workers=2, cluster__address="auto")
    assert plan2.fingerprint == plan.fingerprint
    assert od2.prepare(plan2, spec2) == "resume"
    assert od2.committed_units() == {0}


def test_mismatch_names_differing_keys_and_overwrite_clears(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    od.mark_success({})
    spec2, plan2, task2, od2 = make_job(tmp_path, sampling__temperature=0.5, sampling__max_tokens=7)
    with pytest.raises(OutputError) as e:
        od2.prepare(plan2, spec2)
    msg = str(e.value)
    assert "sampling.temperature: 1.0 -> 0.5" in msg and "sampling.max_tokens: 256 -> 7" in msg
    assert plan.fingerprint[:12] in msg and plan2.fingerprint[:12] in msg and e.value.exit_code == 2
    assert od2.committed_units() == {0, 1, 2}  # nothing touched
    (Path(od.path) / "keep.txt").write_text("user file")
    assert od2.prepare(plan2, spec2, overwrite=True) == "overwrite"
    assert od2.committed_units() == set() and not (Path(od.path) / SUCCESS).exists()
    assert (Path(od.path) / "keep.txt").exists()
    assert json.loads((Path(od.path) / MANIFEST).read_text())["fingerprint"] == plan2.fingerprint


def test_mismatch_names_changed_input_file(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    pq.write_table(pa.table({"prompt": ["a"], "answer": [1]}), tmp_path / "in.parquet")
    spec2, plan2, _, od2 = make_job(tmp_path)
    with pytest.raises(OutputError, match=r"input file in.parquet: \d+ bytes/10 rows -> \d+ bytes/1 rows"):
        od2.prepare(plan2, spec2)


def test_non_empty_dir_without_manifest(tmp_path):
    spec, plan, task, od = make_job(tmp_path)
    os.makedirs(od.path)
    (Path(od.path) / "stuff.csv").write_text("x")
    with pytest.raises(OutputError, match="is not empty and has no batchgen manifest"):
        od.prepare(plan, spec)
    assert od.prepare(plan, spec, overwrite=True) == "overwrite"


def test_unwritable_output(tmp_path):
    (tmp_path / "afile").write_text("x")
    spec, plan, task, _ = make_job(tmp_path, output__path=str(tmp_path / "afile" / "out"))
    with pytest.raises(OutputError, match="cannot create directory") as e:
        OutputDir(spec.output.path).prepare(plan, spec)
    assert e.value.exit_code == 2


def test_stop_reason_column_and_text(tmp_path):
    """A sample ended by a stop token keeps it in `tokens` (counted in num_tokens); `text`
    leaves it out and `stop_reason` holds its text. A stop string ends `text` before it and
    is the stop_reason; a sample cut at max_tokens has none."""
    spec, plan, task, od = make_job(tmp_path, n=2, unit_rows=2, num_samples=3)
    od.prepare(plan, spec)
    tok = FakeTok()
    tok.decode_token_bytes = lambda t: bytes([t - 10])
    reqs = task.read_unit(plan.units[0], tok)
    stop_id = 10 + ord("!")
    hi = [10 + b for b in b"Hi"]
    samples = [Sample(prompt_id="x", sample_index=0, tokens=hi + [stop_id], mask=[1, 1, 1], logprobs=[-1.0, -2.0, -0.5],
                      finish_reason="stop", stop_reason=stop_id),
               Sample(prompt_id="x", sample_index=1, tokens=[10 + b for b in b"ok\n\nQ"], mask=[1] * 5,
                      logprobs=[-1.0] * 5, finish_reason="stop", stop_reason="\n\n"),
               Sample(prompt_id="x", sample_index=2, tokens=hi, mask=[1, 1], logprobs=[-1.0, -1.0])]
    outs = [RequestOutput(None, r.prompt_id, r.prompt_tokens, samples) for r in reqs]
    res = task.write_unit(plan.units[0], reqs, outs, tok)
    rows = pq.read_table(res.path).to_pylist()[:3]
    assert [(r["text"], r["stop_reason"], r["finish_reason"], r["num_tokens"]) for r in rows] == [
        ("Hi", "!", "stop", 3), ("ok", "\n\n", "stop", 5), ("Hi", None, "length", 2)]
    assert rows[0]["tokens"][-1] == stop_id and rows[0]["mask"][-1] == 1 and rows[0]["logprobs"][-1] == -0.5
    assert res.generated_tokens == 2 * (3 + 5 + 2)


# ------------------------------------------------------------------ run_job without Ray

class InlineDispatcher:
    """cluster.dispatcher.UnitDispatcher without Ray: each unit runs in this process with
    fake_outputs (no engine), so run_job's resume and cleanup paths are tested in a second."""

    def __init__(self, task, **kw):
        self.task = task

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, units, on_result=None, on_progress=None, watchdog=None):
        results = []
        for u in units:
            results.append(run_unit(self.task, u))
            if on_result:
                on_result(results[-1])
        return results


@pytest.fixture
def run_inline(monkeypatch):
    import cluster.dispatcher
    import jobs.runner

    monkeypatch.setattr(cluster.dispatcher, "UnitDispatcher", InlineDispatcher)
    monkeypatch.setattr(jobs.runner, "connect_ray", lambda spec: False)
    return lambda spec: jobs.runner.run_job(spec, progress=False, echo=False)


def test_resume_reruns_units_whose_part_is_empty_or_cut_short(tmp_path, run_inline, caplog):
    """A part left empty or cut short (linked before a power loss dropped its data) is not
    committed: resume removes it, logging its name, and runs its unit again, so the job
    finishes with the same rows (before the fix every rerun failed "units missing"); `plan`
    names them beforehand."""
    import logging

    from jobs.plan.report import describe_plan

    spec, plan, task, od = make_job(tmp_path)
    assert run_inline(spec) == 0
    out = Path(od.path)
    want = {i: pq.read_table(out / part_name(i)) for i in range(3)}
    (out / part_name(1)).write_bytes(b"")
    data = (out / part_name(2)).read_bytes()
    (out / part_name(2)).write_bytes(data[: len(data) - 100])
    os.remove(out / SUCCESS)
    assert od.committed_units() == {0}
    assert [rel for rel, _ in od.damaged_parts()] == [part_name(1), part_name(2)]
    report, code = describe_plan(spec)  # `plan` says what `run` will do with them
    assert code == 0 and "resume, 1 of 3 units committed; 2 part file(s) damaged, which `run` removes" in report
    assert f"{part_name(1)} (empty file (0 bytes))" in report
    with caplog.at_level(logging.WARNING, logger="batchgen"):
        assert run_inline(spec) == 0
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"{part_name(1)} is damaged, empty file" in logged
    assert f"{part_name(2)} is damaged, no Parquet footer" in logged
    assert od.committed_units() == {0, 1, 2} and od.damaged_parts() == [] and od.verify() == []
    for i in (1, 2):
        assert pq.read_table(out / part_name(i)).equals(want[i])
    assert od.status()["summary"]["units_this_run"] == 2


def test_a_resume_that_stops_leaves_no_success_marker_of_the_earlier_run(tmp_path, run_inline, monkeypatch):
    """A finished output whose part was deleted (as a damaged part's message advises) has a
    _SUCCESS that no longer holds; the rerun removes it before its units run, so a rerun that
    stops leaves no marker claiming every unit is in (it stayed: `status` said "success
    marker: yes" at 2/3 units and `verify` exited 1); the rerun that finishes writes it again."""
    from cluster.unit import UnitFailed
    from jobs.errors import JobFailed

    spec, plan, task, od = make_job(tmp_path)
    assert run_inline(spec) == 0
    os.remove(Path(od.path) / part_name(1))
    assert od.status()["success"]

    def fail(self, units, **kw):
        raise UnitFailed("unit 1 failed 3 times: boom")

    run_units = InlineDispatcher.run
    monkeypatch.setattr(InlineDispatcher, "run", fail)
    with pytest.raises(JobFailed):
        run_inline(spec)
    assert not od.status()["success"] and od.verify() == []
    monkeypatch.setattr(InlineDispatcher, "run", run_units)
    assert run_inline(spec) == 0
    st = od.status()
    assert st["success"] and st["summary"]["units_this_run"] == 1 and st["summary"]["samples"] == 20


def test_a_part_whose_footer_cannot_be_read_is_named_when_the_run_ends(tmp_path, run_inline):
    """A part that ends like a Parquet file but whose footer is garbage is taken for committed
    at the start; the end of the run cannot read it and fails naming the file and what to do
    (before: "1 units missing after the run; rerun to resume", forever)."""
    from jobs.errors import JobFailed

    spec, plan, task, od = make_job(tmp_path)
    assert run_inline(spec) == 0
    p = Path(od.path) / part_name(1)
    data = bytearray(p.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    data[-8 - footer_len:-8] = b"\xff" * footer_len  # the footer's bytes, its length and magic kept
    p.write_bytes(bytes(data))
    os.remove(Path(od.path) / SUCCESS)
    with pytest.raises(JobFailed, match=r"(?s)part files cannot be read \(part-000001\.parquet: .*can be deleted: "
                                        r"a rerun then runs its unit again") as e:
        run_inline(spec)
    assert e.value.exit_code == 1


def test_commit_fsyncs_the_file_before_its_link_and_the_directory_after(tmp_path, monkeypatch):
    """A local commit (a part, the lease) and a replacement (manifest, _SUCCESS, heartbeats)
    fsync the temporary file before the link or rename that makes it visible, and the
    directory after: a power loss cannot leave the final name on an empty file."""
    import stat

    from jobs.outputs import commit

    events = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        return real_fsync(fd)

    monkeypatch.setattr(commit.os, "fsync", fsync)
    monkeypatch.setattr(commit.os, "link", lambda a, b: (events.append("link"), real_link(a, b))[1])
    monkeypatch.setattr(commit.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    import pyarrow.fs as pafs

    commit.write_part(str(tmp_path), 0, pa.table({"x": [1]}))
    assert events == ["fsync file", "link", "fsync dir"]
    events.clear()
    commit.replace_whole(pafs.LocalFileSystem(), str(tmp_path / "_SUCCESS"), b"{}")
    assert events == ["fsync file", "replace", "fsync dir"]
    assert sorted(os.listdir(tmp_path)) == ["_SUCCESS", part_name(0)]


def test_leftovers_of_a_crash_are_batchgens_own_and_removed(tmp_path, run_inline):
    """Files a crash can leave (a lease being created, a manifest or heartbeat being replaced,
    the writability and S3 conditional-write probes) neither make a directory without a
    manifest count as holding unrelated files, nor make verify fail after a resume: run
    removes them. A user's file with a similar name is still refused and never deleted
    (before the fix: run refused the directory, verify reported "unexpected file" forever)."""
    spec, plan, task, od = make_job(tmp_path)
    out = Path(od.path)
    (out / "_batchgen").mkdir(parents=True)
    crash = ["_batchgen/.tmp-lease-0123abcd.json", "_batchgen/.tmp-" + "e" * 32]
    for rel in crash:
        (out / rel).write_text("{}")
    od.check_no_unrelated_files()  # what `run` and `plan` check before the lease
    assert run_inline(spec) == 0
    assert not any((out / rel).exists() for rel in crash)
    probes = [".batchgen-probe-" + "a" * 32, ".batchgen-probe-if-none-match-" + "b" * 32,
              "_batchgen/.batchgen-probe-if-none-match-" + "c" * 32]
    for rel in probes:
        (out / rel).write_text("probe")
    os.remove(out / SUCCESS)
    problems = od.verify()
    # those under _batchgen/ too, as status counts them
    assert [p.split(":")[0] for p in problems] == probes and all("orphan temporary file" in p for p in problems)
    assert od.status()["temp_files"] == 3
    assert run_inline(spec) == 0
    assert not any((out / rel).exists() for rel in probes) and od.verify() == []
    # exact names only: a user's ".tmp-notes" is neither taken for batchgen's nor removed
    other = tmp_path / "other"
    other.mkdir()
    (other / ".tmp-notes").write_text("mine")
    spec2, plan2, _, od2 = make_job(tmp_path, output__path=str(other))
    with pytest.raises(OutputError, match=r"not empty and has no batchgen manifest \(1 files: \.tmp-notes\)"):
        run_inline(spec2)
    assert (other / ".tmp-notes").read_text() == "mine"


def test_cleanup_spares_the_temporary_file_of_a_write_in_flight(tmp_path, monkeypatch):
    """The driver cleans up leftovers while its lease's heartbeat thread may be replacing
    lease.json through a `_batchgen/.tmp-<uuid>` file: cleanup never removes that one (the
    heartbeat would then fail), only leftovers of earlier crashes."""
    from jobs.outputs import output_dir

    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    old = Path(od.path) / "_batchgen" / (".tmp-" + "d" * 32)
    old.write_text("left by a crash")
    real = output_dir.replace_whole
    seen = {}

    def replace_whole(fs, final, data, tmp_name=None):
        parent = final.rsplit("/", 1)[0]
        Path(parent, tmp_name).write_bytes(data)  # the temporary file exists, not yet renamed
        seen["removed"] = od.cleanup_temp_files()
        seen["kept"] = Path(parent, tmp_name).exists()
        os.remove(Path(parent, tmp_name))
        real(fs, final, data, tmp_name=tmp_name)

    monkeypatch.setattr(output_dir, "replace_whole", replace_whole)
    od.write_text("_batchgen/lease.json", "{}")
    assert seen == {"removed": 1, "kept": True} and not old.exists()
    assert (Path(od.path) / "_batchgen" / "lease.json").read_text() == "{}"


def test_writability_probe_removed_by_a_cleaning_driver_still_counts_as_written(tmp_path, monkeypatch):
    """The driver holding the lease removes probes a crash left; a second driver's probe,
    written just then, may vanish before that driver removes it itself. The directory took
    the write, so it is writable: no "not writable" error (the lease then decides)."""
    from jobs.outputs import output_dir

    real = output_dir.put_whole

    def put_then_cleaned_up(fs, path, data):
        real(fs, path, data)
        os.remove(path)  # the lease holder's cleanup_temp_files, at that moment

    monkeypatch.setattr(output_dir, "put_whole", put_then_cleaned_up)
    spec, plan, task, od = make_job(tmp_path)
    od.ensure_writable()
    assert os.listdir(od.path) == []


def test_the_manifest_keeps_no_credentials(tmp_path):
    """Credentials written into the input or output URI (s3://KEY:SECRET@bucket/...; an AWS
    secret may hold a "/") are left out of the manifest's copy of the job's spec, as
    docs/failures.md promises (the spec was written there whole); the options stay."""
    from types import SimpleNamespace

    from jobs.config import load_job_spec
    from jobs.outputs.output_dir import OutputDir

    spec = load_job_spec({"input": {"path": "s3://AKIA:SEC/RET@bkt/in?region=x"},
                          "output": {"path": "s3://AKIA:TOPSECRET@bkt/out"}, "model": {"path": "tiny-random"}})
    plan = SimpleNamespace(files=[], units=[], root="s3://AKIA:SEC/RET@bkt/in", fingerprint="f", fingerprint_data={},
                           num_prompts=0, passthrough_fields=[], unit_rows=lambda unit, n: 0, checkpoint_sha256=None)
    text = json.dumps(OutputDir(str(tmp_path / "out"))._manifest(plan, spec))
    assert "SEC/RET" not in text and "TOPSECRET" not in text and "AKIA" not in text
    manifest = json.loads(text)
    assert manifest["spec"]["input"]["path"] == "s3://bkt/in?region=x"
    assert manifest["spec"]["output"]["path"] == "s3://bkt/out"
