"""A corpus of bad inputs and the exact behaviour for each.

Job-level problems (config, input schema, output ownership) stop the job before any work:
the error class has exit code 2, the message names the file/key/column/row, and no part
file is written (the runner's pool is never reached). Row-level problems become a
UnitRequest with prompt_tokens None and an error naming the file, row and column; the rows
around them are unaffected.

Cases only the engine can judge (a prompt longer than the context window, token ids past
the model's vocabulary, num_samples x max_tokens beyond the KV-cache budget) run as real
job units in tests/test_bad_input_engine.py; checkpoint problems are in test_gpt2.py and
test_nanochat.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.cli import main
from jobs.config import load_spec
from jobs.errors import InputError, OutputError, SpecError
from jobs.outputs.output_dir import OutputDir
from jobs.plan.planner import plan_job
from jobs.spec import JobSpec
from jobs.task import JobTask

CHAT = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


class FakeTok:
    """encode = bytes + 10; a permissive render_chat (jobs.task does the structural checks)."""

    vocab_size = 300
    bos_token_id = 1
    prepend_bos = True

    def encode(self, s):
        if "\x00" in s:
            raise ValueError("NUL byte in text")
        return [b + 10 for b in s.encode()]

    def decode(self, ids):
        return bytes(i - 10 for i in ids if i >= 10).decode(errors="replace")

    def render_chat(self, messages, date=None):
        out = [1]
        for m in messages:
            out += [2] + self.encode(m["content"]) + [3]
        return out + [4]


# ---------------------------------------------------------------- job-level problems

def _tables():
    ok = pa.table({"prompt": ["a", "b"], "answer": [1, 2]})
    return ok


def setup_case(tmp_path: Path, case: str) -> tuple[str, type, list[str]]:
    """Write the inputs and config of `case`; returns (config path, error class, message fragments)."""
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "out"
    cfg: dict = {"input": {"path": str(data / "p.parquet")}, "output": {"path": str(out)},
                 "cluster": {"unit_rows": 1}}
    p = data / "p.parquet"

    def w(table, path=p):
        pq.write_table(table, path)

    if case == "missing_column":
        w(pa.table({"question": ["a"]}))
        frag, err = ["p.parquet", "column 'prompt' (input.column) not found", "question"], InputError
    elif case == "text_wrong_type":
        w(pa.table({"prompt": [1, 2]}))
        frag, err = ["p.parquet", "column 'prompt' has type int64", "input.format text needs string"], InputError
    elif case == "chat_is_string":
        w(pa.table({"messages": ["hi"]}))
        cfg["input"]["format"] = "chat"
        frag, err = ["p.parquet", "column 'messages' has type string", "list<struct<role: string, content: string>>"], InputError
    elif case == "chat_struct_no_content":
        w(pa.table({"messages": pa.array([[{"role": "user", "text": "hi"}]])}))
        cfg["input"]["format"] = "chat"
        frag, err = ["p.parquet", "column 'messages'", "needs list<struct<role: string, content: string>>"], InputError
    elif case == "tokens_wrong_type":
        w(pa.table({"prompt": pa.array([[1.5, 2.0]])}))
        cfg["input"]["format"] = "tokens"
        frag, err = ["p.parquet", "column 'prompt' has type list<double>", "needs list<integer>"], InputError
    elif case == "id_column_missing":
        w(_tables())
        cfg["input"]["id_column"] = "uid"
        frag, err = ["p.parquet", "column 'uid' (input.id_column) not found"], InputError
    elif case == "id_column_wrong_type":
        w(pa.table({"prompt": ["a"], "uid": [1.5]}))
        cfg["input"]["id_column"] = "uid"
        frag, err = ["p.parquet", "id column 'uid' has type double"], InputError
    elif case == "passthrough_missing":
        w(_tables())
        cfg["input"]["passthrough"] = ["answer", "solution"]
        frag, err = ["p.parquet", "column 'solution' (input.passthrough) not found"], InputError
    elif case == "duplicate_ids_across_files":
        w(pa.table({"prompt": ["a", "b"], "uid": ["x", "y"]}), data / "a.parquet")
        w(pa.table({"prompt": ["c", "d"], "uid": ["z", "x"]}), data / "b.parquet")
        cfg["input"].update(path=str(data), id_column="uid")
        frag, err = ["duplicate prompt id 'x'", "a.parquet row 0", "b.parquet row 1"], InputError
    elif case == "null_id_falls_back_to_another_id":
        # a null id's error rows get the prompt id "b.parquet:1", another row's id: two rows of
        # one (prompt_id, sample_index), which `verify` failed after a run that ended well
        w(pa.table({"prompt": ["a", "b"], "uid": pa.array(["x", "b.parquet:1"], pa.large_string())}), data / "a.parquet")
        w(pa.table({"prompt": ["c", "d"], "uid": pa.array(["z", None], pa.large_string())}), data / "b.parquet")
        cfg["input"].update(path=str(data), id_column="uid")
        frag, err = ["b.parquet row 1: prompt id is null (input.id_column 'uid')", "'b.parquet:1', is the id of "
                     "a.parquet row 1"], InputError
    elif case == "truncated_parquet":
        w(_tables())
        raw = p.read_bytes()
        p.write_bytes(raw[: len(raw) // 2])
        frag, err = ["p.parquet: not a readable Parquet file"], InputError
    elif case == "not_parquet":
        p.write_text("prompt\na\nb\n")
        frag, err = ["p.parquet: not a readable Parquet file"], InputError
    elif case == "mixed_schemas":
        w(pa.table({"prompt": ["a"], "answer": [1]}), data / "a.parquet")
        w(pa.table({"prompt": ["b"], "answer": ["one"]}), data / "b.parquet")
        cfg["input"].update(path=str(data), passthrough=["answer"])
        frag, err = ["b.parquet: column 'answer' has type string, but a.parquet has int64"], InputError
    elif case == "input_missing":
        cfg["input"]["path"] = str(data / "nope.parquet")
        frag, err = ["input.path", "nope.parquet: no such file or directory"], InputError
    elif case == "empty_directory":
        (data / "readme.txt").write_text("no parquet here")
        cfg["input"]["path"] = str(data)
        frag, err = ["directory holds no *.parquet files"], InputError
    elif case == "glob_no_match":
        cfg["input"]["path"] = str(data / "part-*.parquet")
        frag, err = ["the pattern matches no files"], InputError
    elif case == "unknown_package_file":
        cfg["input"]["path"] = "package://nope.parquet"
        frag, err = ["package://nope.parquet: no such packaged file", "demo_prompts.parquet"], InputError
    elif case == "model_path_missing":
        w(_tables())
        cfg["model"] = {"path": str(tmp_path / "no_checkpoint")}
        frag, err = ["model.path", "does not exist"], SpecError
    elif case == "unknown_key":
        w(_tables())
        cfg["sampling"] = {"temprature": 0.5}
        frag, err = ["job.yaml: unknown key sampling.temprature"], SpecError
    elif case == "bad_value":
        w(_tables())
        cfg["sampling"] = {"top_p": 1.5}
        frag, err = ["job.yaml: sampling.top_p: must be in (0, 1], got 1.5"], SpecError
    elif case == "passthrough_shadows_output":
        w(pa.table({"prompt": ["a"], "tokens": [[1]]}))
        cfg["input"]["passthrough"] = ["tokens"]
        frag, err = ["job.yaml: input.passthrough: column 'tokens' would overwrite"], SpecError
    elif case == "output_other_job":
        w(_tables())
        other = JobSpec.from_dict({**cfg, "sampling": {"seed": 99}})
        OutputDir(str(out)).prepare(plan_job(other), other)
        frag, err = ["holds another job's output", "sampling.seed: 99 -> 0"], OutputError
    elif case == "output_not_directory":
        w(_tables())
        (tmp_path / "afile").write_text("x")
        cfg["output"]["path"] = str(tmp_path / "afile" / "out")
        out = tmp_path / "afile" / "out"
        frag, err = ["output.path", "cannot create directory"], OutputError
    elif case == "output_is_input_directory":
        w(_tables())
        cfg["input"]["path"] = cfg["output"]["path"] = str(data)
        frag, err = [f"output.path {data} is the input directory (input.path {data})", "would sit among"], InputError
    elif case == "output_is_glob_directory":
        w(_tables())
        cfg["input"]["path"], cfg["output"]["path"] = str(data / "*.parquet"), str(data)
        frag, err = [f"output.path {data} is the directory input.path {data}/*.parquet searches"], InputError
    elif case == "output_foreign_files":
        w(_tables())
        out.mkdir()
        (out / "results.csv").write_text("x")
        frag, err = ["is not empty and has no batchgen manifest", "results.csv"], OutputError
    else:
        raise AssertionError(case)
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), err, frag


JOB_CASES = ["missing_column", "text_wrong_type", "chat_is_string", "chat_struct_no_content", "tokens_wrong_type",
             "id_column_missing", "id_column_wrong_type", "passthrough_missing", "duplicate_ids_across_files",
             "null_id_falls_back_to_another_id",
             "truncated_parquet", "not_parquet", "mixed_schemas", "input_missing", "empty_directory",
             "glob_no_match", "unknown_package_file", "model_path_missing", "unknown_key", "bad_value",
             "passthrough_shadows_output", "output_other_job", "output_not_directory", "output_foreign_files",
             # an output.path that is the input directory: its part files would be read as input on a rerun
             "output_is_input_directory", "output_is_glob_directory"]


def _start(cfg: str) -> None:
    """What a run does before any unit: validate the spec, plan, prepare the output."""
    spec = load_spec(cfg)
    plan = plan_job(spec)
    OutputDir(spec.output.path).prepare(plan, spec)


def _part_files(tmp_path: Path) -> list[str]:
    return [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith(("part-", ".tmp-part-"))]


@pytest.mark.parametrize("case", JOB_CASES)
def test_job_level_problem_stops_before_work(tmp_path, case):
    cfg, err, fragments = setup_case(tmp_path, case)
    with pytest.raises(err) as e:
        _start(cfg)
    assert e.value.exit_code == 2
    for frag in fragments:
        assert frag in str(e.value), str(e.value)
    assert _part_files(tmp_path) == []


@pytest.mark.parametrize("case", ["missing_column", "duplicate_ids_across_files", "bad_value", "output_other_job",
                                  "output_is_input_directory"])
def test_job_level_problem_exit_code_through_cli(tmp_path, case, monkeypatch, capsys):
    """`batchgen run` with the real runner: exit 2, "error: ..." on stderr, the pool never starts."""
    cfg, err, fragments = setup_case(tmp_path, case)
    pytest.importorskip("jobs.runner")
    import cluster.dispatcher

    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(cluster.dispatcher, "run_units", no_work)
    assert main(["run", cfg]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and fragments[0] in stderr
    assert _part_files(tmp_path) == []


# ---------------------------------------------------------------- row-level problems

ROW_CASES = [
    # (case, format, column type, bad value, error fragment)
    ("text_null", "text", pa.string(), None, "column 'prompt': prompt is null"),
    ("text_empty", "text", pa.string(), "", "column 'prompt': prompt is an empty string"),
    ("text_untokenizable", "text", pa.string(), "a\x00b", "column 'prompt': cannot tokenize the prompt: NUL byte"),
    ("chat_null", "chat", CHAT, None, "column 'messages': messages is null"),
    ("chat_empty", "chat", CHAT, [], "column 'messages': messages is empty"),
    ("chat_missing_content", "chat", CHAT, [{"role": "user", "content": None}], "message 0 (user) has no content"),
    ("chat_missing_role", "chat", CHAT, [{"role": None, "content": "hi"}], "message 0 has no role"),
    ("chat_empty_role", "chat", CHAT, [{"role": "", "content": "hi"}], "message 0 role must be a non-empty string"),
    ("chat_null_message", "chat", CHAT, [None], "message 0 is not a {role, content} struct"),
    ("tokens_null", "tokens", pa.list_(pa.int64()), None, "column 'prompt': token list is null"),
    ("tokens_empty", "tokens", pa.list_(pa.int64()), [], "column 'prompt': token list is empty"),
    ("tokens_negative", "tokens", pa.list_(pa.int64()), [5, -1], "token 1 is -1: token ids must be >= 0"),
    ("tokens_out_of_range", "tokens", pa.list_(pa.int64()), [5, 6, 300],
     "token 2 is 300: outside the tokenizer's vocabulary (size 300)"),
    ("tokens_null_element", "tokens", pa.list_(pa.int32()), [5, None], "token 1 is null"),
]

GOOD = {"text": "ok", "chat": [{"role": "user", "content": "ok"}], "tokens": [11, 12]}


def _row_task(tmp_path, fmt, typ, bad, id_values=None):
    col = "messages" if fmt == "chat" else "prompt"
    cols = {col: pa.array([GOOD[fmt], bad, GOOD[fmt]], type=typ)}
    spec_input = {"path": str(tmp_path / "rows.parquet"), "format": fmt}
    if id_values is not None:
        cols["uid"] = pa.array(id_values, type=pa.string())
        spec_input["id_column"] = "uid"
    pq.write_table(pa.table(cols), tmp_path / "rows.parquet")
    spec = JobSpec.from_dict({"input": spec_input, "output": {"path": str(tmp_path / "out")}}, "job.yaml")
    plan = plan_job(spec)
    return JobTask(spec, plan), plan


@pytest.mark.parametrize("case, fmt, typ, bad, fragment", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_row_level_problem_becomes_error_request(tmp_path, case, fmt, typ, bad, fragment):
    task, plan = _row_task(tmp_path, fmt, typ, bad)
    reqs = task.read_unit(plan.units[0], FakeTok())
    assert len(reqs) == 3
    good, broken, good2 = reqs
    assert broken.prompt_tokens is None
    assert broken.error.startswith("rows.parquet row 1 column "), broken.error
    assert fragment in broken.error, broken.error
    assert broken.prompt_id == "rows.parquet:1"
    expected_good = {"text": [1, 10 + ord("o"), 10 + ord("k")], "chat": [1, 2, 10 + ord("o"), 10 + ord("k"), 3, 4],
                     "tokens": [11, 12]}[fmt]
    assert good.prompt_tokens == expected_good and good.error is None
    assert good2.prompt_tokens == expected_good and good2.error is None


def test_null_prompt_id_is_an_error_row(tmp_path):
    task, plan = _row_task(tmp_path, "text", pa.string(), "fine", id_values=["a", None, "c"])
    reqs = task.read_unit(plan.units[0], FakeTok())
    assert [r.prompt_id for r in reqs] == ["a", "rows.parquet:1", "c"]
    assert reqs[1].prompt_tokens is None and reqs[1].error == "rows.parquet row 1 column 'uid': prompt id is null"


def test_error_rows_written_one_per_sample(tmp_path):
    from engine.params import error_output

    task, plan = _row_task(tmp_path, "text", pa.string(), None)
    OutputDir(task.output_path).prepare(plan, JobSpec.from_dict(
        {"input": {"path": str(tmp_path / "rows.parquet")}, "output": {"path": str(tmp_path / "out")}}))
    reqs = task.read_unit(plan.units[0], FakeTok())
    outs = [error_output(None, r.prompt_id, r.prompt_tokens, task.params, r.error or "engine said no") for r in reqs]
    res = task.write_unit(plan.units[0], reqs, outs, FakeTok())
    assert res.rows == 3 * task.params.num_samples and res.error_rows == res.rows
    rows = pq.read_table(res.path).to_pylist()
    assert [r["error"] for r in rows if r["prompt_id"] == "rows.parquet:1"] == [reqs[1].error] * task.params.num_samples


# Roles and their order are the chat format's rule, judged by the tokenizer's render_chat
# (here nanochat's layout); jobs.task only checks the structure.
NANOCHAT_ORDER_CASES = [
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "message 1 has unknown role 'bot'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 1 is from user but should be from assistant"),
    ([{"role": "assistant", "content": "a"}], "message 0 is from assistant but should be from user"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
     "message 1 is a system message; only the first"),
    ([{"role": "system", "content": "be nice"}], "message 0 is a system message, so message 1 must be a user message"),
]


@pytest.mark.parametrize("bad_messages, fragment", NANOCHAT_ORDER_CASES)
def test_chat_problems_with_the_real_tokenizer(tmp_path, bad_messages, fragment):
    """With the nanochat-format tokenizer (engine.tokenizers.base.Tokenizer.demo()): a
    conversation its format refuses becomes an error row carrying render_chat's message; a
    well-formed one renders in nanochat's layout (starts with <|bos|>, ends with
    <|assistant_start|>); a text prompt gets <|bos|> prepended."""
    tokmod = pytest.importorskip("engine.tokenizers.base")
    tok = tokmod.Tokenizer.demo()
    task, plan = _row_task(tmp_path, "chat", CHAT, bad_messages)
    good, bad, _ = task.read_unit(plan.units[0], tok)
    assert good.prompt_tokens[0] == tok.special("<|bos|>") and good.prompt_tokens[-1] == tok.special("<|assistant_start|>")
    assert bad.prompt_tokens is None and bad.error.startswith("rows.parquet row 1 column 'messages': cannot render")
    assert fragment in bad.error, bad.error
    (tmp_path / "t").mkdir()
    task, plan = _row_task(tmp_path / "t", "text", pa.string(), "")
    good, bad, _ = task.read_unit(plan.units[0], tok)
    assert good.prompt_tokens == [tok.bos_token_id] + tok.encode("ok")
    assert bad.prompt_tokens is None and "prompt is an empty string" in bad.error


def test_gpt2_style_tokenizer_gets_no_bos(tmp_path):
    """A tokenizer without a "<|bos|>" special (GPT-2: bos_token_id is <|endoftext|>) gets no BOS."""

    class Gpt2Like:
        vocab_size = 300
        bos_token_id = 299

        def special(self, name):
            return {"<|endoftext|>": 299}.get(name)

        def encode(self, s):
            return [b + 10 for b in s.encode()]

    task, plan = _row_task(tmp_path, "text", pa.string(), "x")
    assert task.read_unit(plan.units[0], Gpt2Like())[0].prompt_tokens == [10 + ord("o"), 10 + ord("k")]


def _unchecked_text(values, typ=pa.string()):
    """A string array holding bytes that may not be UTF-8, as a writer that does not validate
    (pyarrow's own Parquet writer, for one) can store them."""
    b = pa.array(values, type=pa.binary())
    return pa.Array.from_buffers(typ, len(b), b.buffers(), null_count=b.null_count)


def test_text_that_is_not_utf8_is_an_error_row(tmp_path):
    """A string value that is not valid UTF-8 makes its row an error row naming the row and the
    column (prompt, id, passthrough or a sampling struct's field), and the rows around it run:
    the unit's read raised UnicodeDecodeError, so the unit failed on every attempt and the job
    with it (exit 1), and an id column holding one failed the plan with a traceback. Such an id
    is treated as a null id; the sampling row keeps its num_samples (the planned rows)."""
    from engine.params import error_output

    text = _unchecked_text([b"ok", b"bad\xff", b"fine", b"yes"])
    params = pa.StructArray.from_arrays([pa.array([2, 3, 4, 1]), _unchecked_text([b"x", b"y", b"\xfe", None])],
                                        names=["num_samples", "stop"])
    pq.write_table(pa.table({"prompt": text, "uid": text, "params": params, "meta": pa.StructArray.from_arrays(
        [text], names=["t"])}), tmp_path / "rows.parquet")
    spec = JobSpec.from_dict({"input": {"path": str(tmp_path / "rows.parquet"), "id_column": "uid",
                                        "sampling_column": "params", "passthrough": ["meta"]},
                              "output": {"path": str(tmp_path / "out")}}, "job.yaml")
    plan = plan_job(spec)
    assert plan.expected_rows == {0: 10}
    OutputDir(spec.output.path).prepare(plan, spec)
    task = JobTask(spec, plan)
    reqs = task.read_unit(plan.units[0], FakeTok())
    assert [r.prompt_id for r in reqs] == ["ok", "rows.parquet:1", "fine", "yes"]
    assert reqs[1].error.startswith("rows.parquet row 1 column 'uid': prompt id is text that is not valid UTF-8")
    assert reqs[1].passthrough == {"meta": None} and reqs[1].params.num_samples == 3
    assert reqs[2].error.startswith("rows.parquet row 2 column 'params' field 'stop': must be a non-empty string")
    assert "not valid UTF-8" in reqs[2].error and reqs[2].params.num_samples == 4
    assert [r.error for r in (reqs[0], reqs[3])] == [None, None] and reqs[0].passthrough == {"meta": {"t": "ok"}}
    assert reqs[3].prompt_tokens == [1] + [10 + b for b in b"yes"]
    outs = [error_output(None, r.prompt_id, r.prompt_tokens, r.params, r.error or "engine said no") for r in reqs]
    assert task.write_unit(plan.units[0], reqs, outs, FakeTok()).rows == 10
    from jobs.runner import show_examples  # the run's closing examples read the prompts again: no crash

    assert spec.model.path != "tiny-random" and show_examples(spec, plan, OutputDir(spec.output.path)) == ""
    spec = JobSpec.from_dict({"input": {"path": str(tmp_path / "rows.parquet")},
                              "output": {"path": str(tmp_path / "out2")}}, "job.yaml")
    plan = plan_job(spec)
    reqs = JobTask(spec, plan).read_unit(plan.units[0], FakeTok())
    assert [r.error is None for r in reqs] == [True, False, True, True]
    assert reqs[1].error.startswith("rows.parquet row 1 column 'prompt': text that is not valid UTF-8")


def test_input_changed_after_planning_fails_the_unit(tmp_path):
    """Rows that vanished since planning: read_unit raises (the unit is retried, then the job fails)."""
    task, plan = _row_task(tmp_path, "text", pa.string(), "x")
    pq.write_table(pa.table({"prompt": ["only one"]}), tmp_path / "rows.parquet")
    with pytest.raises(RuntimeError, match="was the input file changed after the job started"):
        task.read_unit(plan.units[0], FakeTok())


# ---------------------------------------------------------------- batchgen prepare

@pytest.mark.parametrize("data, fragment", [
    # bytes that are not UTF-8: a traceback (exit 1) naming no line
    (b'{"q": "a"}\n{"q": "b\xff"}\n', "in.jsonl:2: not UTF-8 text"),
    # nested deeper than json can recurse: a RecursionError traceback (exit 1)
    (b'{"q": "a"}\n{"q": "b", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", "in.jsonl:2: invalid JSON: nested too deeply"),
], ids=["not_utf8", "nested_too_deeply"])
def test_prepare_undecodable_line_exits_2_naming_it(tmp_path, capsys, data, fragment):
    (tmp_path / "in.jsonl").write_bytes(data)
    assert main(["prepare", str(tmp_path / "in.jsonl"), str(tmp_path / "p.parquet"), "--column", "q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err, err
    assert not (tmp_path / "p.parquet").exists()


def test_prepare_reads_a_byte_order_mark_and_crlf(tmp_path):
    """A UTF-8 file that starts with a byte order mark (as Windows tools write it), with CRLF
    line ends, is prepared as without them (it stopped at line 1: "Unexpected UTF-8 BOM"), as
    `run-batch` reads such a file."""
    (tmp_path / "in.jsonl").write_bytes(b'\xef\xbb\xbf{"q": "a", "id": 7}\r\n\r\n{"q": "b\\u00e9", "id": 8}\r\n')
    assert main(["prepare", str(tmp_path / "in.jsonl"), str(tmp_path / "p.parquet"), "--column", "q",
                 "--id-column", "id"]) == 0
    assert pq.read_table(tmp_path / "p.parquet").to_pylist() == [{"prompt": "a", "id": 7}, {"prompt": "b\u00e9", "id": 8}]
