"""jobs.inputs.parquet: input discovery (files, directories, globs, URIs), schema checks, units, ids."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.errors import InputError
from jobs.inputs.parquet import discover, read_rows
from jobs.plan.planner import plan_job
from jobs.spec import JobSpec


def write_prompts(path, prompts, row_group_size=None, **cols):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table({"prompt": pa.array(prompts, type=pa.string()), **cols})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def spec_for(path, **over):
    d = {"input": {"path": str(path)}, "cluster": {"unit_rows": 4}}
    for k, v in over.items():
        sec, key = k.split("__")
        d.setdefault(sec, {})[key] = v
    return JobSpec.from_dict(d, "test.yaml")


def test_single_file_units(tmp_path):
    f = write_prompts(str(tmp_path / "p.parquet"), [f"q{i}" for i in range(10)])
    plan = plan_job(spec_for(f))
    assert plan.num_prompts == 10
    assert [(u.index, u.row_start, u.row_end) for u in plan.units] == [(0, 0, 4), (1, 4, 8), (2, 8, 10)]
    assert all(u.source == f for u in plan.units)
    assert plan.files[0].name == "p.parquet" and plan.files[0].num_rows == 10
    assert plan.files[0].size == os.path.getsize(f)
    assert len(plan.fingerprint) == 64


def test_directory_recursive_sorted_and_global_unit_index(tmp_path):
    write_prompts(str(tmp_path / "d" / "b.parquet"), ["x"] * 5)
    write_prompts(str(tmp_path / "d" / "a.parquet"), ["y"] * 3)
    write_prompts(str(tmp_path / "d" / "sub" / "c.parquet"), ["z"] * 4)
    write_prompts(str(tmp_path / "d" / "_hidden" / "h.parquet"), ["h"])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    plan = plan_job(spec_for(tmp_path / "d"))
    assert [f.name for f in plan.files] == ["a.parquet", "b.parquet", "sub/c.parquet"]
    # b.parquet's one 5-row group (more than unit_rows 4, at most 2x) is cut in two halves
    assert [(u.index, os.path.basename(u.source), u.row_start, u.row_end) for u in plan.units] == [
        (0, "a.parquet", 0, 3), (1, "b.parquet", 0, 3), (2, "b.parquet", 3, 5), (3, "c.parquet", 0, 4)]


def test_glob_and_relative_root(tmp_path, monkeypatch):
    write_prompts(str(tmp_path / "data" / "part-1.parquet"), ["a"])
    write_prompts(str(tmp_path / "data" / "part-2.parquet"), ["b"])
    write_prompts(str(tmp_path / "data" / "other.parquet"), ["c"])
    monkeypatch.chdir(tmp_path)
    root, found = discover("data/part-*.parquet")
    assert root == str(tmp_path / "data")
    assert [name for _, name, _ in found] == ["part-1.parquet", "part-2.parquet"]
    with pytest.raises(InputError, match="matches no files"):
        discover("data/nothing-*.parquet")


def test_a_name_holding_glob_characters_is_that_file_not_a_pattern(tmp_path):
    """A file whose name holds ? or [ (an S3 key written %3F) is read alone, though the same
    text as a pattern would match its neighbours too; a pattern naming no file stays one."""
    for name, text in [("a?b.parquet", "q"), ("axb.parquet", "x"), ("p[1].parquet", "p"), ("p1.parquet", "1")]:
        write_prompts(str(tmp_path / "d" / name), [text])
    for name in ("a?b.parquet", "p[1].parquet"):
        _, found = discover(str(tmp_path / "d" / name))
        assert [n for _, n, _ in found] == [name]
    _, found = discover(str(tmp_path / "d" / "a?b*.parquet"))
    assert [n for _, n, _ in found] == ["a?b.parquet", "axb.parquet"]


def test_a_raw_question_mark_in_an_s3_key_is_explained():
    """`?` starts a URI's options: a key written with a raw `?` fails naming the fix (%3F),
    not only pyarrow's "Unexpected query parameter"."""
    with pytest.raises(InputError, match=r"Unexpected query parameter.*object key holding `\?` is written %3F"):
        discover("s3://bkt/in/a?b.parquet")


def test_file_uri(tmp_path):
    f = write_prompts(str(tmp_path / "p.parquet"), ["a", "b"])
    plan = plan_job(spec_for("file://" + f))
    assert plan.num_prompts == 2 and plan.units[0].source == f


def test_prompt_ids_default_and_id_column(tmp_path):
    from jobs.task import JobTask

    class Tok:
        vocab_size = 300
        bos_token_id = None

        def encode(self, s):
            return list(s.encode())

    d = tmp_path / "root"
    write_prompts(str(d / "sub" / "a.parquet"), ["hi", "yo"], ident=pa.array([7, 8]))
    spec = spec_for(d)
    plan = plan_job(spec)
    reqs = JobTask(spec, plan, str(tmp_path / "out")).read_unit(plan.units[0], Tok())
    assert [r.prompt_id for r in reqs] == ["sub/a.parquet:0", "sub/a.parquet:1"]
    spec = spec_for(d, input__id_column="ident")
    plan = plan_job(spec)
    reqs = JobTask(spec, plan, str(tmp_path / "out")).read_unit(plan.units[0], Tok())
    assert [r.prompt_id for r in reqs] == ["7", "8"]


def test_uint64_id_column_plans_and_keeps_exact_ids(tmp_path):
    """A uint64 id column with ids above 2**63 - 1 plans (it crashed casting to int64) and its
    prompt ids are the exact unsigned values, the same on every plan; a repeated uint64 id is
    still refused, naming the id and both rows."""
    from jobs.task import JobTask

    class Tok:
        vocab_size = 300
        bos_token_id = None

        def encode(self, s):
            return list(s.encode())

    big = 2**63 + 5
    f = write_prompts(str(tmp_path / "d" / "a.parquet"), ["hi", "yo", "ok"],
                      ident=pa.array([big, 7, 2**64 - 1], pa.uint64()))
    spec = spec_for(f, input__id_column="ident")
    plan = plan_job(spec)
    assert plan_job(spec).fingerprint == plan.fingerprint
    reqs = JobTask(spec, plan, str(tmp_path / "out")).read_unit(plan.units[0], Tok())
    assert [r.prompt_id for r in reqs] == [str(big), "7", str(2**64 - 1)]
    write_prompts(f, ["hi", "yo"], ident=pa.array([big, big], pa.uint64()))
    with pytest.raises(InputError, match=f"duplicate prompt id '{big}'.*a.parquet row 0 and a.parquet row 1"):
        plan_job(spec)


def _fake_output(out, unit_rows=1):
    """What a run leaves in its output directory: a committed part file (the output's
    columns, no `prompt`), the manifest and a staged input copy under _batchgen/."""
    os.makedirs(out / "_batchgen" / "staged", exist_ok=True)
    pq.write_table(pa.table({"prompt_id": ["a.parquet:0"], "tokens": [[1, 2]]}), out / "part-000000.parquet")
    (out / "_batchgen" / "manifest.json").write_text("{}")
    pq.write_table(pa.table({"prompt": ["staged"]}), out / "_batchgen" / "staged" / "x.parquet")


@pytest.mark.parametrize("pattern", ["", "**/*.parquet"])
def test_output_inside_the_input_directory_is_not_input(tmp_path, pattern, caplog):
    """An output.path inside the input directory (or a glob's root): the job's part files and
    _batchgen/ state are skipped by the input scan, so a rerun plans what the first run
    planned (the same files and fingerprint) and resumes, instead of reading its own part
    file as input ("column 'prompt' not found")."""
    data = tmp_path / "data"
    write_prompts(str(data / "a.parquet"), ["p", "q"])
    write_prompts(str(data / "sub" / "b.parquet"), ["r"])
    path = str(data / pattern) if pattern else str(data)
    spec = spec_for(path, output__path=str(data / "out"))
    first = plan_job(spec)
    _fake_output(data / "out")
    with caplog.at_level("INFO", logger="batchgen"):
        again = plan_job(spec)
    assert [f.name for f in again.files] == [f.name for f in first.files] == ["a.parquet", "sub/b.parquet"]
    assert again.fingerprint == first.fingerprint
    assert "skipped 1 file(s) under output.path" in caplog.text
    # another job's output in the same directory is input (refused by its schema), but never
    # the _batchgen/ state of an output (hidden in a directory, skipped by a glob too)
    assert [name for _, name, _ in discover(path)[1]] == ["a.parquet", "out/part-000000.parquet", "sub/b.parquet"]
    other = spec_for(path, output__path=str(data / "out2"))
    with pytest.raises(InputError, match="out/part-000000.parquet: column 'prompt'"):
        plan_job(other)


def test_ids_and_fingerprint_stable_when_dataset_moves(tmp_path):
    write_prompts(str(tmp_path / "a" / "x.parquet"), ["p", "q"])
    fp1 = plan_job(spec_for(tmp_path / "a")).fingerprint
    os.rename(tmp_path / "a", tmp_path / "b")
    fp2 = plan_job(spec_for(tmp_path / "b", output__path="elsewhere", cluster__num_workers=2)).fingerprint
    assert fp1 == fp2
    assert plan_job(spec_for(tmp_path / "b", cluster__unit_rows=1)).fingerprint != fp1
    assert plan_job(spec_for(tmp_path / "b", sampling__seed=5)).fingerprint != fp1


def test_fingerprint_changes_with_input_contents(tmp_path):
    f = write_prompts(str(tmp_path / "p.parquet"), ["a", "b"])
    fp1 = plan_job(spec_for(f)).fingerprint
    write_prompts(f, ["a", "b", "c"])
    assert plan_job(spec_for(f)).fingerprint != fp1


def test_zero_row_file_warns_and_has_no_units(tmp_path, caplog):
    write_prompts(str(tmp_path / "d" / "a.parquet"), [])
    write_prompts(str(tmp_path / "d" / "b.parquet"), ["x"])
    plan = plan_job(spec_for(tmp_path / "d"))
    assert len(plan.units) == 1 and plan.units[0].source.endswith("b.parquet")
    assert any("a.parquet: 0 rows" in w for w in plan.warnings)


def test_a_zero_row_file_with_untyped_columns_does_not_stop_the_job(tmp_path):
    """pandas writes an empty object column (chat messages, a dict passthrough, a filtered
    shard with no rows) with Arrow type null. Such a file holds nothing to read: the job runs
    its other files, and the output takes the passthrough type of a file with rows. It stopped
    the job: "a.parquet: column 'messages' has type null, but input.format chat needs ...".
    A file with rows and a null column, or an empty file of another type, is still refused."""
    d = tmp_path / "d"
    d.mkdir()
    null = pa.array([], type=pa.null())
    pq.write_table(pa.table({"messages": null, "meta": null, "uid": null, "params": null}), d / "a.parquet")
    msgs = pa.array([[{"role": "user", "content": "hi"}]])
    pq.write_table(pa.table({"messages": msgs, "meta": pa.array([{"k": 1}]), "uid": ["x"],
                             "params": pa.array([{"temperature": 0.5}])}), d / "b.parquet")
    spec = spec_for(d, input__format="chat", input__passthrough=["meta"], input__id_column="uid",
                    input__sampling_column="params")
    plan = plan_job(spec)
    assert plan.num_prompts == 1 and [u.source.rsplit("/", 1)[-1] for u in plan.units] == ["b.parquet"]
    assert [str(f.type) for f in plan.passthrough_fields] == ["struct<k: int64>"]
    assert any("a.parquet: 0 rows" in w for w in plan.warnings)
    pq.write_table(pa.table({"messages": msgs, "meta": pa.array([None], type=pa.null()), "uid": ["y"],
                             "params": pa.array([None], type=pa.null())}), d / "a.parquet")
    with pytest.raises(InputError, match="a.parquet: input.sampling_column 'params' has type null"):
        plan_job(spec)
    pq.write_table(pa.table({"messages": pa.array([], type=pa.string()), "meta": null, "uid": null,
                             "params": null}), d / "a.parquet")
    with pytest.raises(InputError, match="a.parquet: column 'messages' has type string"):
        plan_job(spec)


def test_read_rows_reads_only_the_range_across_row_groups(tmp_path):
    f = write_prompts(str(tmp_path / "p.parquet"), [f"q{i}" for i in range(50)], row_group_size=7,
                      other=pa.array(range(50)))
    t = read_rows(f, 12, 23, ["prompt"])
    assert t.column_names == ["prompt"]
    assert t.column(0).to_pylist() == [f"q{i}" for i in range(12, 23)]
    assert read_rows(f, 49, 50, ["other"]).column(0).to_pylist() == [49]


def test_chat_and_tokens_schemas_accepted(tmp_path):
    msgs = pa.array([[{"role": "user", "content": "hi"}]],
                    type=pa.large_list(pa.struct([("role", pa.large_string()), ("content", pa.string()),
                                                  ("name", pa.string())])))
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "c.parquet")
    assert plan_job(spec_for(tmp_path / "c.parquet", input__format="chat")).num_prompts == 1
    pq.write_table(pa.table({"prompt": pa.array([[1, 2]], type=pa.list_(pa.int64()))}), tmp_path / "t.parquet")
    assert plan_job(spec_for(tmp_path / "t.parquet", input__format="tokens")).num_prompts == 1


def test_string_and_large_string_files_mix(tmp_path):
    write_prompts(str(tmp_path / "d" / "a.parquet"), ["x"])
    pq.write_table(pa.table({"prompt": pa.array(["y"], type=pa.large_string())}), tmp_path / "d" / "b.parquet")
    assert plan_job(spec_for(tmp_path / "d")).num_prompts == 2


def test_dictionary_and_string_view_columns_are_string_columns(tmp_path):
    """A dictionary-encoded string column (what pandas writes for a category column) and a
    string_view column hold strings: prompts (text, and chat roles and contents) and ids read
    from them as from string columns, across files that encode them differently, and duplicate
    ids are found across encodings. Each was refused as "has type dictionary<...>, but
    input.format text needs string" (string_view: "has type string_view")."""
    from jobs.task import JobTask

    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"prompt": pa.array(["x", None, "x"]).dictionary_encode(),
                             "uid": pa.array(["a", "b", "c"]).dictionary_encode()}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": pa.array(["y"], type=pa.string_view()),
                             "uid": pa.array(["d"], type=pa.string_view())}), d / "b.parquet")
    pq.write_table(pa.table({"prompt": pa.array(["z"], type=pa.large_string()), "uid": ["e"]}), d / "c.parquet")
    spec = spec_for(d, input__id_column="uid")
    plan = plan_job(spec)
    assert plan.num_prompts == 5
    task = JobTask(spec, plan)
    reqs = [r for u in plan.units for r in task.read_unit(u, _ByteTok())]
    assert [(r.prompt_id, r.prompt_tokens) for r in reqs] == [
        ("a", [130]), ("b", None), ("c", [130]), ("d", [131]), ("e", [132])]
    assert reqs[1].error == "a.parquet row 1 column 'prompt': prompt is null"
    pq.write_table(pa.table({"prompt": pa.array(["w"], type=pa.string_view()),
                             "uid": pa.array(["a"], type=pa.string_view())}), d / "b.parquet")
    with pytest.raises(InputError, match="duplicate prompt id 'a' .*a.parquet row 0 and b.parquet row 0"):
        plan_job(spec)
    role = pa.dictionary(pa.int8(), pa.string())
    msgs = pa.array([[{"role": "user", "content": "hi"}]],
                    type=pa.list_(pa.struct([("role", role), ("content", pa.string_view())])))
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "c.parquet")
    spec = spec_for(tmp_path / "c.parquet", input__format="chat")
    plan = plan_job(spec)
    assert JobTask(spec, plan).read_unit(plan.units[0], _ByteTok())[0].prompt_tokens == [114, 115]


class _ByteTok:
    """bytes + 10; a chat renders as its contents' bytes."""

    vocab_size = 300
    prepend_bos = False

    def encode(self, s):
        return [b + 10 for b in s.encode()]

    def render_chat(self, messages, date=None):
        return [t for m in messages for t in self.encode(m["content"])]


def test_package_input():
    spec = JobSpec.from_dict({"input": {"path": "package://demo_prompts.parquet", "format": "chat",
                                        "id_column": "id", "passthrough": ["category"]},
                              "cluster": {"unit_rows": 16}})
    plan = plan_job(spec)
    assert plan.num_prompts == 64 and len(plan.units) == 4
    assert plan.units[0].source == "package://demo_prompts.parquet"
    assert [f.name for f in plan.passthrough_fields] == ["category"]
    with pytest.raises(InputError, match="no such packaged file"):
        plan_job(JobSpec.from_dict({"input": {"path": "package://nope.parquet"}}))


def test_demo_data_is_small():
    from jobs.inputs.reader import DATA_DIR

    assert (DATA_DIR / "demo_prompts.parquet").stat().st_size < 50_000


# ------------------------------------------------------------------ row groups, staging, URIs

def test_prepared_files_give_units_that_decode_only_their_rows(tmp_path):
    """`batchgen prepare` writes 256-row groups; with unit_rows 256 every unit is one row
    group and decodes exactly its rows (nothing is staged)."""
    from jobs.inputs.parquet import read_rows_counted
    from jobs.inputs.prepare import prepare_jsonl

    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(600)))
    prepare_jsonl(str(src), str(tmp_path / "p.parquet"))
    assert [pq.ParquetFile(tmp_path / "p.parquet").metadata.row_group(i).num_rows for i in range(3)] == [256, 256, 88]
    plan = plan_job(spec_for(tmp_path / "p.parquet", cluster__unit_rows=256))
    assert [(u.row_start, u.row_end) for u in plan.units] == [(0, 256), (256, 512), (512, 600)]
    assert plan.rows_decoded == 600 and plan.staged_files == []
    t, decoded = read_rows_counted(plan.units[1].source, 256, 512, ["prompt"])
    assert decoded == 256 and t.column(0).to_pylist() == [f"q{i}" for i in range(256, 512)]


def test_staging_rechunks_a_large_row_group_once(tmp_path):
    """A file whose single row group is far larger than its units is staged: its columns are
    rewritten once with unit_rows-row groups, the units read that copy (same rows, each
    decoding only its own), a second staging reuses the copy, and a damaged copy is redone."""
    from jobs.inputs.parquet import read_rows, read_rows_counted
    from jobs.inputs.staging import stage_inputs
    from jobs.outputs.output_dir import OutputDir

    f = write_prompts(str(tmp_path / "big.parquet"), [f"q{i}" for i in range(100)], other=pa.array(range(100)))
    spec = spec_for(f, cluster__unit_rows=8, output__path=str(tmp_path / "out"))
    plan = plan_job(spec)
    assert [x.staged for x in plan.files] == [True] and plan.rows_decoded == 200 and len(plan.units) == 13
    out = OutputDir(spec.output.path)
    out.ensure_writable()
    units, names, decoded = stage_inputs(plan, out, 8, ["prompt"], plan.units)
    assert decoded == 100 and len(names) == 1 and list(names.values()) == ["big.parquet"]
    copy = units[0].source
    assert copy.startswith(str(tmp_path / "out" / "_batchgen" / "staged")) and all(u.source == copy for u in units)
    for orig, moved in zip(plan.units, units):
        t, n = read_rows_counted(moved.source, moved.row_start, moved.row_end, ["prompt"])
        assert n == moved.num_rows  # the copy's row groups are the units
        assert t.column(0).to_pylist() == read_rows(orig.source, orig.row_start, orig.row_end, ["prompt"]).column(0).to_pylist()
    assert pq.read_schema(copy).names == ["prompt"]  # only the columns the job reads
    assert stage_inputs(plan, out, 8, ["prompt"], plan.units)[2] == 0  # reused
    data = open(copy, "rb").read()
    open(copy, "wb").write(data[: len(data) // 2])
    assert stage_inputs(plan, out, 8, ["prompt"], plan.units)[2] == 100  # damaged: rewritten
    assert out.verify() == [f"{out.shown}: manifest _batchgen/manifest.json is missing (not a batchgen output directory?)"]


def test_staged_groups_stay_unit_aligned_across_read_batches(tmp_path, monkeypatch):
    """The staged copy is read in batches (READ_BATCH rows) that unit_rows does not divide:
    rows left over from one batch join the next, so every row group but the last has
    exactly unit_rows rows, each unit decodes only its own rows, and the rows are unchanged."""
    from jobs.inputs import staging
    from jobs.inputs.parquet import read_rows_counted
    from jobs.outputs.output_dir import OutputDir

    monkeypatch.setattr(staging, "READ_BATCH", 64)
    f = write_prompts(str(tmp_path / "big.parquet"), [f"q{i}" for i in range(500)])
    spec = spec_for(f, cluster__unit_rows=30, output__path=str(tmp_path / "out"))
    plan = plan_job(spec)
    out = OutputDir(spec.output.path)
    out.ensure_writable()
    units, _, decoded = staging.stage_inputs(plan, out, 30, ["prompt"], plan.units)
    assert decoded == 500
    md = pq.ParquetFile(units[0].source).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [30] * 16 + [20]
    got = []
    for u in units:
        t, n = read_rows_counted(u.source, u.row_start, u.row_end, ["prompt"])
        assert n == u.num_rows, (u.row_start, u.row_end, n)
        got += t.column(0).to_pylist()
    assert got == [f"q{i}" for i in range(500)]


def test_staged_copy_leaks_no_descriptor_and_follows_the_umask(tmp_path):
    """Staging a file leaves no open file descriptor and no temporary behind, and the copy
    gets the permissions of a normally created file (0666 less the umask, 0644 under 022),
    so workers running as another user can read it."""
    from jobs.inputs.staging import stage_inputs
    from jobs.outputs.output_dir import OutputDir

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    f = write_prompts(str(tmp_path / "big.parquet"), [f"q{i}" for i in range(100)])
    spec = spec_for(f, cluster__unit_rows=8, output__path=str(tmp_path / "out"))
    plan = plan_job(spec)
    out = OutputDir(spec.output.path)
    out.ensure_writable()
    old = os.umask(0o022)
    try:
        fds = len(os.listdir("/proc/self/fd"))
        units, _, decoded = stage_inputs(plan, out, 8, ["prompt"], plan.units)
        leaked = len(os.listdir("/proc/self/fd")) - fds
    finally:
        os.umask(old)
    copy = units[0].source
    assert decoded == 100
    assert (leaked, oct(os.stat(copy).st_mode & 0o777)) == (0, "0o644")
    assert os.listdir(os.path.dirname(copy)) == [os.path.basename(copy)]  # no temporary left


def test_uri_options_are_not_globs_and_credentials_are_redacted():
    from jobs import uri

    u = "s3://KEY:SECRET@bkt/in/part-*.parquet?endpoint_override=127.0.0.1:9000&scheme=http"
    assert uri.split_query(u) == ("s3://KEY:SECRET@bkt/in/part-*.parquet", "endpoint_override=127.0.0.1:9000&scheme=http")
    assert uri.redact(u) == "s3://bkt/in/part-*.parquet?endpoint_override=127.0.0.1:9000&scheme=http"
    assert uri.join("s3://bkt/run?region=eu-west-1", "part-000001.parquet") == "s3://bkt/run/part-000001.parquet?region=eu-west-1"
    assert uri.uri_for("s3://KEY:SECRET@bkt/in?region=x", "bkt/in/a.parquet") == "s3://KEY:SECRET@bkt/in/a.parquet?region=x"
    assert uri.split_query("data/what?.parquet") == ("data/what?.parquet", "")  # a local path: ? is a glob
    # a secret with "/" pasted raw (AWS secret keys may hold one) is hidden too; an "@" in a
    # bucket's path is not a user's
    assert uri.redact("s3://AKIA:SEC/RET+x@bkt/run?region=x") == "s3://bkt/run?region=x"
    assert uri.redact("s3://bkt/dir@2026/run") == "s3://bkt/dir@2026/run"
    assert uri.redact("s3://user@bkt/run") == "s3://bkt/run"


def _checkpoint_job(tmp_path):
    """A checkpoint directory (64 bytes of weights, an empty config) and a one-prompt job on
    it: (checkpoint dir, spec)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"a" * 64)
    (ck / "config.json").write_text("{}")
    f = write_prompts(str(tmp_path / "p.parquet"), ["q"])
    return ck, spec_for(f, model__path=str(ck), output__path=str(tmp_path / "out"))


def test_fingerprint_covers_checkpoint_content_cached_by_path_size_mtime(tmp_path):
    """A retrained checkpoint with the same file sizes is another job (the fingerprint holds
    every file's SHA-256); the hash cache answers for an unchanged (path, size, mtime)."""
    from jobs.errors import OutputError
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.fingerprint import HashCache

    ck, spec = _checkpoint_job(tmp_path)
    cache = HashCache()
    first = plan_job(spec, hash_cache=cache)
    assert cache.changed and len(cache.entries) == 2
    assert first.fingerprint_data["model"]["sha256"]["config.json"] == \
        "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # sha256 of "{}"
    OutputDir(spec.output.path).prepare(first, spec)
    st = os.stat(ck / "model.safetensors")
    (ck / "model.safetensors").write_bytes(b"b" * 64)  # retrained: same size
    second = plan_job(spec, hash_cache=HashCache())
    assert second.fingerprint != first.fingerprint
    with pytest.raises(OutputError, match=r"model\.sha256\.model\.safetensors: '[0-9a-f]{64}' -> '[0-9a-f]{64}'"):
        OutputDir(spec.output.path).prepare(second, spec)
    # the cache answers for an unchanged file without reading it
    cache = HashCache()
    assert plan_job(spec, hash_cache=cache).fingerprint == second.fingerprint and cache.changed
    reloaded = HashCache.loads(cache.dumps())
    assert plan_job(spec, hash_cache=reloaded).fingerprint == second.fingerprint and not reloaded.changed
    # ... but not for one whose old modification time was put back: see the next test
    os.utime(ck / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert plan_job(spec, hash_cache=reloaded).fingerprint == second.fingerprint and reloaded.changed


def test_a_checkpoint_replaced_with_its_old_mtime_is_not_resumed(tmp_path):
    """Retrained weights of the same sizes copied over the checkpoint with their modification
    time kept (`cp -p`, `rsync -a`; here the same time as the old file's) used to answer from
    the output's hash cache, keyed by (path, size, mtime), with the old weights' hash: the
    fingerprint did not change and the run resumed, mixing rows of two models. The cache key
    holds the inode change time and inode too, which no copy can set back."""
    import shutil

    from jobs.errors import OutputError
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.fingerprint import load_hash_cache, save_hash_cache

    ck, spec = _checkpoint_job(tmp_path)
    out = OutputDir(spec.output.path)
    cache = load_hash_cache(out)  # as jobs/runner.py run_job plans and prepares
    first = plan_job(spec, hash_cache=cache)
    assert out.prepare(first, spec) == "new"
    save_hash_cache(out, cache)
    cache = load_hash_cache(out)
    assert plan_job(spec, hash_cache=cache).fingerprint == first.fingerprint and not cache.changed

    st = os.stat(ck / "model.safetensors")
    retrained = tmp_path / "retrained.safetensors"
    retrained.write_bytes(b"b" * 64)
    os.utime(retrained, ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.copy2(retrained, ck / "model.safetensors")  # cp -p
    now = os.stat(ck / "model.safetensors")
    assert (now.st_size, now.st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    cache = load_hash_cache(out)
    second = plan_job(spec, hash_cache=cache)
    assert second.fingerprint != first.fingerprint
    with pytest.raises(OutputError, match=r"another job's output.*model\.sha256\.model\.safetensors"):
        out.prepare(second, spec)
