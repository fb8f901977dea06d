"""jobs.cli: prepare / status / verify / run / submit via main([...]) and exit codes via subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import child_env
from jobs.cli import main

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "jobs.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=child_env(), timeout=120)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prepare_text_keeps_scalar_fields(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"question": "1+1?", "answer": "2", "n": 1, "tags": ["x"]}, "",
                                             {"question": "2+2?", "answer": "4", "n": 2}])
    assert main(["prepare", str(src), str(tmp_path / "o" / "p.parquet"), "--column", "question"]) == 0
    assert "wrote 2 prompts" in capsys.readouterr().out
    t = pq.read_table(tmp_path / "o" / "p.parquet")
    assert t.column_names == ["prompt", "answer", "n"]
    assert t.to_pylist() == [{"prompt": "1+1?", "answer": "2", "n": 1}, {"prompt": "2+2?", "answer": "4", "n": 2}]


def test_prepare_chat_with_id_column(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"q": "hi", "id": "a"}, {"q": "yo", "id": "b"}])
    assert main(["prepare", str(src), str(tmp_path / "p.parquet"), "--column", "q", "--format", "chat",
                 "--id-column", "id"]) == 0
    t = pq.read_table(tmp_path / "p.parquet")
    assert t.to_pylist()[1] == {"messages": [{"role": "user", "content": "yo"}], "id": "b"}
    assert str(t.schema.field("messages").type) == "list<element: struct<role: string, content: string>>"
    # a generated id column from line numbers when no line has the field
    assert main(["prepare", str(src), str(tmp_path / "p2.parquet"), "--column", "q", "--id-column", "row"]) == 0
    assert pq.read_table(tmp_path / "p2.parquet").column("row").to_pylist() == [1, 2]


@pytest.mark.parametrize("lines, args, fragment", [
    (['{"q": "a"}', "{not json"], [], "in.jsonl:2: invalid JSON"),
    (['[1, 2]'], [], "in.jsonl:1: expected a JSON object, got list"),
    (['{"x": "a"}'], [], "in.jsonl:1: no field 'q'"),
    (['{"q": 5}'], [], "in.jsonl:1: field 'q' must be a string, got int"),
    (['{"q": "a", "id": 1}', '{"q": "b", "id": 1}'], ["--id-column", "id"], "in.jsonl:2: duplicate id 1 (also on line 1)"),
    (['{"q": "a", "id": 1}', '{"q": "b"}'], ["--id-column", "id"], "in.jsonl:2: id field 'id' is missing"),
    (['{"q": "a", "k": 1}', '{"q": "b", "k": "x"}'], [], "field 'k' has values of different types"),
    # ids `run` would refuse (a bool or float id column), or that collide as keys (True == 1)
    (['{"q": "a", "id": true}', '{"q": "b", "id": false}'], ["--id-column", "id"],
     "in.jsonl:1: id field 'id' is true (bool); ids must be strings or integers"),
    (['{"q": "a", "id": 1}', '{"q": "b", "id": true}'], ["--id-column", "id"],
     "in.jsonl:2: id field 'id' is true (bool)"),
    (['{"q": "a", "id": 1.5}'], ["--id-column", "id"], "in.jsonl:1: id field 'id' is 1.5 (float)"),
    (['{"q": "a", "id": 1e300}'], ["--id-column", "id"], "in.jsonl:1: id field 'id' is 1e+300 (float)"),
    (['{"q": "a", "id": NaN}'], ["--id-column", "id"], "in.jsonl:1: id field 'id' is missing, null, not finite"),
    (['{"q": "a", "id": "x"}', '{"q": "b", "id": 2}'], ["--id-column", "id"],
     "in.jsonl:2: id field 'id' is 2 (int), but line 1 has a str id"),
    (['{"q": "a", "id": 1}', '{"q": "b", "id": 1.0}'], ["--id-column", "id"],
     "in.jsonl:2: duplicate id 1 (also on line 1)"),
    # a field named as the column the prompt becomes: it was dropped silently
    (['{"q": "a", "prompt": "Q: a"}'], [], "in.jsonl:1: field 'prompt' is also the column the prompt field 'q' becomes"),
    (['{"q": "a"}', '{"q": "b", "messages": "m"}'], ["--format", "chat"],
     "in.jsonl:2: field 'messages' is also the column the prompt field 'q' becomes"),
])
def test_prepare_errors_exit_2(tmp_path, capsys, lines, args, fragment):
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    assert main(["prepare", str(src), str(tmp_path / "p.parquet"), "--column", "q", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err, err
    assert not (tmp_path / "p.parquet").exists()


def test_prepare_keeps_a_field_named_line(tmp_path):
    """A field named `_line` is kept like any other scalar field, and can be the id column:
    it was dropped (a name prepare used for its own line numbers), and with --id-column _line
    the file was written without its id column."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"q": "a", "_line": 7}, {"q": "b", "_line": 9}])
    assert main(["prepare", str(src), str(tmp_path / "p.parquet"), "--column", "q"]) == 0
    assert pq.read_table(tmp_path / "p.parquet").to_pylist() == [{"prompt": "a", "_line": 7}, {"prompt": "b", "_line": 9}]
    assert main(["prepare", str(src), str(tmp_path / "i.parquet"), "--column", "q", "--id-column", "_line"]) == 0
    assert pq.read_table(tmp_path / "i.parquet").column("_line").to_pylist() == [7, 9]


def test_prepare_integral_float_ids_become_integers_that_run_takes(tmp_path):
    """`prepare --id-column` writes only id columns `run` takes: integral floats (3.0, as tools
    that write every number as a float do) become integers, and the file plans with that id
    column (before the fix the column was double, which plan and run refuse)."""
    from jobs.plan.planner import plan_job
    from jobs.spec import JobSpec

    src = write_jsonl(tmp_path / "in.jsonl", [{"q": "a", "id": 3.0}, {"q": "b", "id": 4}, {"q": "c", "id": -2.0}])
    assert main(["prepare", str(src), str(tmp_path / "p.parquet"), "--column", "q", "--id-column", "id"]) == 0
    t = pq.read_table(tmp_path / "p.parquet")
    assert str(t.schema.field("id").type) == "int64" and t.column("id").to_pylist() == [3, 4, -2]
    spec = JobSpec.from_dict({"input": {"path": str(tmp_path / "p.parquet"), "id_column": "id"},
                              "output": {"path": str(tmp_path / "out")}}, "job.yaml")
    assert plan_job(spec).num_prompts == 3


def test_prepare_missing_file(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "nope.jsonl"), str(tmp_path / "p.parquet")]) == 2
    assert "nope.jsonl: cannot open" in capsys.readouterr().err


@pytest.mark.skipif(not GSM8K.exists(), reason="needs ../shared/data/gsm8k")
def test_prepare_gsm8k_then_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", str(GSM8K), "out/gsm8k_prompts.parquet", "--column", "question", "--format", "chat"]) == 0
    from jobs.config import load_spec
    from jobs.plan.planner import plan_job

    spec = load_spec(ROOT / "configs" / "gsm8k.yaml")
    plan = plan_job(spec)
    assert plan.num_prompts == 1319 and [f.name for f in plan.passthrough_fields] == ["answer"]


def _job(tmp_path):
    from test_output import make_job, run_all  # noqa: E402 - shared fixtures of the output tests

    spec, plan, task, od = make_job(tmp_path)
    run_all(spec, plan, task, od)
    return od


def test_status_and_verify_commands(tmp_path, capsys):
    od = _job(tmp_path)
    assert main(["status", od.path]) == 0
    out = capsys.readouterr().out
    assert "units:            3/3 committed (100.0%)" in out and "rows:             20/20" in out
    assert main(["status", od.path, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["units_done"] == 3 and st["error_rows"] == 2
    assert main(["verify", od.path]) == 0
    assert "ok:" in capsys.readouterr().out
    (Path(od.path) / "junk.bin").write_bytes(b"x")
    assert main(["verify", od.path]) == 1
    assert "junk.bin: unexpected file" in capsys.readouterr().out


def test_verify_exits_2_when_there_is_nothing_to_verify(tmp_path, capsys, monkeypatch):
    """`verify` of a path where nothing is (a typo), a file, or a store that does not answer
    verified nothing: exit 2 and an error naming the output, as `status` does, not exit 1 as
    if an output had been checked (a path that does not exist), nor a traceback (an OSError
    from the store); the directory of a job without its manifest is still a problem (exit 1)."""
    from jobs.outputs.output_dir import OutputDir

    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert f"error: {tmp_path / 'nowhere'}: not a batchgen output directory (no such directory)" in \
        capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["verify", str(tmp_path / "afile")]) == 2
    assert "not a batchgen output directory (a file)" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert "manifest _batchgen/manifest.json is missing" in capsys.readouterr().out

    def unreachable(self, *a, **kw):
        raise OSError("AWS Error NETWORK_CONNECTION during HeadObject operation")

    monkeypatch.setattr(OutputDir, "_exists", unreachable)  # as pyarrow's S3 filesystem raises
    for verb in ("verify", "status"):
        assert main([verb, str(tmp_path / "empty")]) == 2
        err = capsys.readouterr().err
        assert f"error: {tmp_path / 'empty'}: cannot read the output: AWS Error NETWORK_CONNECTION" in err, err


def test_verify_prints_no_credentials_of_the_output_uri(tmp_path, capsys, monkeypatch):
    """`verify`'s verdict lines name the output as messages do, without the credentials a URI
    may carry (s3://KEY:SECRET@bucket/...): they printed the URI as given."""
    from jobs.outputs.output_dir import OutputDir

    monkeypatch.setattr(OutputDir, "completion", lambda self: (1, 1, True))  # the verdict's counts
    url = "s3://AKIAKEY:SECRETKEY@bkt/run?endpoint_override=127.0.0.1:1&scheme=http"
    for problems, code, stream in (([], 0, "out"), (["part-000000.parquet: a problem"], 1, "err")):
        monkeypatch.setattr(OutputDir, "verify", lambda self, p=problems: list(p))
        assert main(["verify", url]) == code
        printed = capsys.readouterr()
        assert "bkt/run" in getattr(printed, stream) and "SECRETKEY" not in printed.out + printed.err, printed


def test_exit_codes_via_subprocess(tmp_path):
    od = _job(tmp_path)
    r = cli("verify", od.path)
    assert r.returncode == 0, r.stderr
    os.remove(Path(od.path) / "part-000001.parquet")
    od.mark_success({})
    r = cli("verify", od.path)
    assert r.returncode == 1 and "_SUCCESS is present" in r.stdout
    r = cli("status", tmp_path / "nowhere")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "not a batchgen output directory" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling: {top_p: 1.5}\n")
    r = cli("run", bad)
    assert r.returncode == 2 and f"error: {bad}: sampling.top_p: must be in (0, 1], got 1.5" in r.stderr
    r = cli("run", bad, "--set", "sampling.top_p=0.9", "--set", "sampling.nope=1")
    assert r.returncode == 2 and "unknown key sampling.nope" in r.stderr
    r = cli("prepare", write_jsonl(tmp_path / "x.jsonl", ["{"]), tmp_path / "x.parquet")
    assert r.returncode == 2 and "x.jsonl:1: invalid JSON" in r.stderr
    r = cli("frobnicate")
    assert r.returncode == 2  # argparse usage error


def test_run_calls_run_job(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("jobs.runner")
    fake.run_job = lambda spec, overwrite=False: calls.append((spec, overwrite)) or 0
    monkeypatch.setitem(sys.modules, "jobs.runner", fake)
    cfg = tmp_path / "j.yaml"
    cfg.write_text("sampling: {num_samples: 1}\n")
    assert main(["run", str(cfg), "--set", "sampling.seed=3", "--overwrite"]) == 0
    spec, overwrite = calls[0]
    assert spec.sampling.seed == 3 and spec.sampling.num_samples == 1 and overwrite is True

    from jobs.errors import JobFailed

    def failing(spec, overwrite=False):
        raise JobFailed("unit 3 failed 3 times")

    fake.run_job = failing
    assert main(["run", str(cfg)]) == 1


def test_submit_validates_first(tmp_path, monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("jobs.submit")
    fake.submit_job = lambda config, address, overrides=(), overwrite=False: calls.append((config, address, overrides)) or 0
    monkeypatch.setitem(sys.modules, "jobs.submit", fake)
    cfg = tmp_path / "j.yaml"
    cfg.write_text("sampling: {num_samples: 0}\n")
    assert main(["submit", str(cfg), "--address", "http://h:8265"]) == 2
    assert calls == []
    cfg.write_text("")
    assert main(["submit", str(cfg), "--address", "http://h:8265", "--set", "sampling.seed=1"]) == 0
    assert calls == [(str(cfg), "http://h:8265", ["sampling.seed=1"])]


def _plan_config(tmp_path, **extra):
    import pyarrow as pa

    inp = tmp_path / "in.parquet"
    if not inp.exists():
        pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(10)]}), inp, row_group_size=4)
    cfg = tmp_path / "job.yaml"
    cluster = {"unit_rows": 4, **extra}
    cfg.write_text(json.dumps({"input": {"path": str(inp)}, "output": {"path": str(tmp_path / "out")},
                               "cluster": cluster}))
    return cfg


def test_plan_prints_the_plan_without_ray_or_a_model(tmp_path, capsys, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("plan started Ray"))
    cfg = _plan_config(tmp_path)
    assert main(["plan", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "input:" in out and "(1 file, 10 prompts)" in out and "in.parquet: 10 rows in 3 row groups" in out
    assert "units:         3 (cluster.unit_rows 4)" in out and "rows decoded:  10 for 10 prompts (1.00x)" in out
    assert "model:         smollm2 (cpu, auto)" in out and f"output:        {tmp_path / 'out'}: new" in out
    assert "lease:         free" in out and "fingerprint:   " in out
    assert not (tmp_path / "out").exists()  # plan writes nothing


def test_plan_reports_resume_and_refuses_another_jobs_output(tmp_path, capsys):
    import pyarrow as pa

    from jobs.config import load_spec
    from jobs.outputs.commit import write_part
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job

    cfg = _plan_config(tmp_path)
    spec = load_spec(cfg)
    OutputDir(spec.output.path).prepare(plan_job(spec), spec)
    write_part(spec.output.path, 1, pa.table({"x": [1]}))
    assert main(["plan", str(cfg)]) == 0
    assert ": resume, 1 of 3 units committed" in capsys.readouterr().out
    write_part(spec.output.path, 99, pa.table({"x": [1]}))  # no unit of this job: not counted (it said 2 of 3)
    assert main(["plan", str(cfg)]) == 0
    assert ": resume, 1 of 3 units committed" in capsys.readouterr().out
    assert main(["plan", str(cfg), "--set", "sampling.seed=5"]) == 2
    out = capsys.readouterr().out
    assert "holds another job's output" in out and "sampling.seed: 0 -> 5" in out
    r = cli("plan", cfg, "--set", "sampling.top_p=2")
    assert r.returncode == 2 and "sampling.top_p: must be in (0, 1], got 2" in r.stderr


def test_local_run_asking_for_more_gpus_than_the_machine_has_exits_2(tmp_path):
    """Ray would otherwise be told of GPUs that are not there, and the extra actors would
    run on CPU in another dtype. 64 GPUs: more than any test machine has."""
    cfg = _plan_config(tmp_path, num_workers=64, gpus_per_worker=1)
    for verb in ("plan", "run"):
        r = cli(verb, cfg)
        assert r.returncode == 2, r.stderr
        assert "cluster.gpus_per_worker: the job asks for 64 GPU(s) (num_workers 64 x gpus_per_worker 1) but this " \
               "machine has" in r.stderr
    assert not (tmp_path / "out").exists()


def test_cuda_device_without_gpus_per_worker_exits_2(tmp_path):
    """model.device cuda (or cuda:N) with cluster.gpus_per_worker 0: Ray reserves no GPU for
    the workers and hides none from them, so every worker would land on the same GPU. `plan`
    and `run` refuse it with exit 2 naming both keys, locally and for a cluster (address
    set: refused before Ray is contacted), and write nothing; GenerationPool refuses it too."""
    from jobs.errors import SpecError
    from jobs.pool import pool_setup

    for device, address in (("cuda", None), ("cuda:1", "ray://127.0.0.1:1")):
        cfg = _plan_config(tmp_path, gpus_per_worker=0, **({"address": address} if address else {}))
        data = json.loads(cfg.read_text())
        data["model"] = {"device": device}
        cfg.write_text(json.dumps(data))
        for verb in ("plan", "run"):
            r = cli(verb, cfg)
            assert r.returncode == 2, (verb, device, r.stdout, r.stderr)
            assert f"model.device: {device!r} with cluster.gpus_per_worker 0" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError, match=r"model.device: 'cuda' with cluster.gpus_per_worker 0"):
        pool_setup({"model": {"device": "cuda", "path": "tiny-random"}})
    r = cli("plan", _plan_config(tmp_path, gpus_per_worker=0))  # device auto: cpu, as before
    assert r.returncode == 0, r.stderr


def test_run_batch_reads_a_config_whose_tools_are_a_list(tmp_path, monkeypatch):
    """`run-batch --config` reads the config as `run` and `plan` do: a valid `tools:` list
    (three keys per tool, which crashed with a traceback; two keys, which were mangled into
    a wrong "unknown key tools.function") reaches the job's spec whole, the config's other
    keys kept and openai_batch's defaults where it sets none."""
    from jobs.cli import batch_spec

    calls = []
    fake = types.ModuleType("jobs.runner")
    fake.run_job = lambda spec, overwrite=False, progress=None: calls.append(spec) or 0
    monkeypatch.setitem(sys.modules, "jobs.runner", fake)
    monkeypatch.setattr("jobs.outputs.batch_responses.write_responses", lambda path, out: 0)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                "body": {"prompt": "hi"}}])
    cfg = tmp_path / "cfg.yaml"
    for tool in ({"name": "add", "function": "operator:add", "description": "add two numbers"},
                 {"name": "add", "function": "operator:add"}):
        cfg.write_text(json.dumps({"model": {"path": "tiny-random"}, "sampling": {"temperature": 0.5},
                                   "tools": [tool]}))
        assert main(["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--config", str(cfg)]) == 0
        spec = calls.pop()
        assert [f.model_dump(exclude_unset=True) for f in spec.tools.functions] == [tool]
        assert spec.input.format == "openai_batch" and spec.sampling.temperature == 0.5
        assert (spec.sampling.num_samples, spec.sampling.top_k) == (1, 0)
        assert spec.output.path == str(tmp_path / "out.parquet")
    spec = batch_spec(str(inp), str(tmp_path / "out.jsonl"), config=str(cfg), overrides=["tools.max_turns=2"])
    assert spec.tools.max_turns == 2 and [f.name for f in spec.tools.functions] == ["add"]


def test_plan_exits_2_where_run_refuses_the_output(tmp_path, capsys):
    """`plan` makes run's output checks without writing: a directory of other files and no
    manifest, an output.path that is a file, or one below a file are reported with run's
    message and exit 2 (they were "new", exit 0), and nothing changes on disk; `run`
    refuses each with exit 2 before any work, leaving nothing of its own. Emptied, the directory is "new" again."""
    cfg = _plan_config(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("hello")
    a_file = tmp_path / "afile"
    a_file.write_text("i am a file")
    cases = ((out, "is not empty and has no batchgen manifest (1 files: notes.txt)"),
             (a_file, "is a file, expected a directory"),
             (a_file / "sub", f"cannot create directory: {a_file} is a file"))
    for path, fragment in cases:
        assert main(["plan", str(cfg), "--set", f"output.path={path}"]) == 2
        report = capsys.readouterr().out
        assert f"output:        output.path {path}" in report and fragment in report, report
        assert "`run` refuses it (exit 2)" in report
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and a_file.read_text() == "i am a file"
    for path, fragment in cases:
        assert main(["run", str(cfg), "--set", f"output.path={path}"]) == 2
        assert fragment in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # refused before the lease: no _batchgen/ left
    (out / "notes.txt").unlink()
    assert main(["plan", str(cfg)]) == 0
    assert f"output:        {out}: new" in capsys.readouterr().out


def test_function_tools_on_a_model_without_a_chat_template_exit_2(tmp_path):
    """Function tools need a chat template that renders tool messages. tiny-random has none:
    `plan` and `run` refuse the job with exit 2 naming tools.functions before any work (the
    workers refused it after the output directory was written, exit 1), and GenerationPool
    refuses it too; with model.tokenizer naming a directory whose tokenizer has a template
    (a small word-level tokenizer written here with `tokenizers`, and a ChatML template), the
    same job plans."""
    from jobs.errors import SpecError
    from jobs.pool import pool_setup

    tokenizers = pytest.importorskip("tokenizers")
    cfg = _plan_config(tmp_path)
    data = json.loads(cfg.read_text())
    data["model"] = {"path": "tiny-random"}
    data["tools"] = [{"name": "add", "function": "operator:add"}]
    cfg.write_text(json.dumps(data))
    for verb in ("plan", "run"):
        r = cli(verb, cfg)
        assert r.returncode == 2, (verb, r.stdout, r.stderr)
        assert "tools.functions (add): tokenizer" in r.stderr and "has no chat template" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError, match=r"tools.functions \(add\): .*no chat template"):
        pool_setup({"model": {"path": "tiny-random"}, "tools": [{"name": "add", "function": "operator:add"}]})
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    vocab = {f"t{i}": i for i in range(250)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(tok_dir / "tokenizer.json"))
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml, "eos_token": "t1"}))
    data["model"]["tokenizer"] = str(tok_dir)
    cfg.write_text(json.dumps(data))
    r = cli("plan", cfg)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ --version

def test_version_prints_batchgen_torch_and_python_without_importing_them(tmp_path):
    """`batchgen --version` prints `batchgen <version> (torch <v>, python <v>)` from the
    installed distributions' metadata, and imports neither torch nor the engine (it did not
    exist: exit 2, "the following arguments are required: COMMAND")."""
    import platform
    import re
    from importlib import metadata

    r = cli("--version")
    assert r.returncode == 0, r.stderr
    want = metadata.version("batchgen")  # pyproject.toml's, as installed
    torch = metadata.version("torch")
    assert r.stdout == f"batchgen {want} (torch {torch}, python {platform.python_version()})\n"
    assert re.search(r'^version = "' + re.escape(want) + '"$', (ROOT / "pyproject.toml").read_text(), re.M)
    probe = ("import sys\nfrom jobs.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
             "    print(e.code, sorted(m for m in ('torch', 'engine', 'pyarrow', 'ray') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=child_env(),
                       timeout=120)
    assert r.stdout.splitlines()[-1] == "0 []", r.stdout + r.stderr


def test_version_falls_back_to_the_checkouts_pyproject(monkeypatch, capsys):
    """Run from a checkout that is not installed (PYTHONPATH=.), the version is the
    pyproject.toml's beside the package; with neither, "unknown"; torch "not installed"."""
    import re

    import jobs.cli as cli_module

    monkeypatch.setattr(cli_module, "_distribution_version", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    want = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert capsys.readouterr().out.startswith(f"batchgen {want} (torch not installed, python ")
    monkeypatch.setattr(cli_module, "_source_version", lambda: None)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("batchgen unknown (torch not installed, python ")


# ------------------------------------------------------------------ --set errors name the override

def test_set_value_errors_name_the_override_not_the_file(tmp_path):
    """A bad value given by `--set` is reported as the override's, not the YAML file's (it
    said `configs/x.yaml: sampling.temperature: ...` for a file that never set it); an error
    from the file still names the file; exit 2 either way (the real CLI, `plan`: no Ray)."""
    cfg = _plan_config(tmp_path)
    r = cli("plan", cfg, "--set", "sampling.temperature=abc")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("error: --set 'sampling.temperature=abc': sampling.temperature: must be a finite number "
                        ">= 0 (0 is greedy), got 'abc'\n"), r.stderr
    r = cli("plan", cfg, "--set", "model.device=gpu", "--set", "cluster.unit_rows=0")
    assert r.returncode == 2 and str(cfg) not in r.stderr, r.stderr
    assert "--set 'model.device=gpu': model.device: must be auto, cpu" in r.stderr
    assert "--set 'cluster.unit_rows=0': cluster.unit_rows: must be an integer >= 1, got 0" in r.stderr
    # the file's own error names the file, the override's the override, in one message
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({**json.loads(cfg.read_text()), "sampling": {"top_p": 1.5}}))
    r = cli("plan", bad, "--set", "sampling.temperature=abc")
    assert r.returncode == 2
    assert f"{bad}: sampling.top_p: must be in (0, 1], got 1.5" in r.stderr
    assert "--set 'sampling.temperature=abc': sampling.temperature: must be" in r.stderr
    # an override that fixes the file's value: no error; a later --set of the same key wins
    assert cli("plan", bad, "--set", "sampling.top_p=0.9").returncode == 0
    r = cli("plan", cfg, "--set", "sampling.seed=x", "--set", "sampling.seed=y")
    assert r.returncode == 2 and "error: --set 'sampling.seed=y': sampling.seed: must be a 64-bit integer" in r.stderr


def test_override_errors_name_the_override_in_python_and_run_batch(tmp_path):
    """load_job_spec (run_job, GenerationPool) and run-batch attribute an override's bad value
    to it too: a string override as `--set`, a mapping's as `override KEY=VALUE`, run-batch's
    --model as `--model`."""
    from jobs.cli import batch_spec
    from jobs.config import load_job_spec
    from jobs.errors import SpecError

    cfg = _plan_config(tmp_path)
    with pytest.raises(SpecError, match=r"^--set 'sampling.top_p=2': sampling.top_p: must be in \(0, 1\], got 2$"):
        load_job_spec(str(cfg), ["sampling.top_p=2"])
    with pytest.raises(SpecError, match=r"^override sampling.top_k=-1: sampling.top_k: must be an integer >= 0"):
        load_job_spec(str(cfg), {"sampling.top_k": -1})
    with pytest.raises(SpecError, match=r"^--set 'sampling.min_p=1': sampling.min_p: must be in \[0, 1\)"):
        batch_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), config=str(cfg), overrides=["sampling.min_p=1"])
    with pytest.raises(SpecError, match=r"^--model 's3://b/m': model.path: 's3://b/m': object store URIs"):
        batch_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), model="s3://b/m")


# ------------------------------------------------------------------ verify: integrity and completion

def test_verify_says_an_interrupted_jobs_output_is_incomplete(tmp_path, capsys):
    """A partial output (an interrupted job: some units committed, no _SUCCESS) verifies ok,
    as integrity goes, but the verdict says it is unfinished (it said `ok: out (1 unit files
    verified)`, which a script took for a finished job), and `verify --complete` counts it as
    a problem, exit 1. A finished output is ok either way."""
    from test_output import make_job, run_unit

    spec, plan, task, od = make_job(tmp_path)
    od.prepare(plan, spec)
    run_unit(task, plan.units[0])  # interrupted after its first unit
    unfinished = "1 of 3 units committed; incomplete: no _SUCCESS, the job has not finished: run it again to resume"
    assert main(["verify", od.path]) == 0
    assert capsys.readouterr().out == f"ok: {od.path} ({unfinished})\n"
    assert main(["verify", "--complete", od.path]) == 1
    printed = capsys.readouterr()
    assert printed.out == f"{od.path}: {unfinished}\n" and "1 problem(s)" in printed.err
    # every unit in, but the job stopped before writing its summary: still not finished
    for u in plan.units[1:]:
        run_unit(task, u)
    assert main(["verify", od.path, "--complete"]) == 1
    assert "3 of 3 units committed; incomplete: no _SUCCESS" in capsys.readouterr().out
    od.mark_success({"prompts": 10})
    for args in (["verify", od.path], ["verify", "--complete", od.path]):
        assert main(args) == 0
        assert capsys.readouterr().out == f"ok: {od.path} (3 of 3 units committed; complete)\n"
    # a problem is reported as before, with or without --complete
    os.remove(Path(od.path) / "part-000001.parquet")
    assert main(["verify", "--complete", od.path]) == 1
    out = capsys.readouterr().out
    assert "_SUCCESS is present but 1 of 3 units are missing" in out and "incomplete" not in out


def test_verify_complete_via_subprocess_on_a_copy_with_parts_removed(tmp_path):
    """The exit codes a pipeline script sees: a finished job's output 0, a copy of it with a
    part and the success marker removed (as an interrupted run leaves it) 0 with an
    incomplete verdict, and 1 with --complete."""
    import shutil

    od = _job(tmp_path)
    od.mark_success({})
    assert cli("verify", "--complete", od.path).returncode == 0
    partial = tmp_path / "partial"
    shutil.copytree(od.path, partial)
    os.remove(partial / "part-000002.parquet")
    os.remove(partial / "_SUCCESS")
    r = cli("verify", partial)
    assert r.returncode == 0 and "(2 of 3 units committed; incomplete: no _SUCCESS" in r.stdout, r.stdout
    r = cli("verify", partial, "--complete")
    assert r.returncode == 1 and "2 of 3 units committed; incomplete" in r.stdout, r.stdout


# ------------------------------------------------------------------ bounded echoes

def test_a_huge_set_value_is_not_echoed_whole(tmp_path, capsys):
    """A 5 MB `--set` value (for a number, or of an unknown key) is echoed as its first 200
    characters and its length, not whole: the message was megabytes."""
    cfg = _plan_config(tmp_path)
    huge = "a" * 5_000_000
    for ov in (f"sampling.temperature={huge}", f"sampling.tempx={huge}", f"model.batch_invariant={huge}",
               f"model.device={huge}", "sampling.seed=" + "9" * 5000):
        assert main(["plan", str(cfg), "--set", ov]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --set '") and len(err) < 1200, (len(err), err[:300])
        assert "characters)" in err, err


def test_version_of_a_checkout_is_its_own_not_the_installed_ones(tmp_path):
    """A checkout run with PYTHONPATH=. (or installed editable, then bumped) says its own
    pyproject.toml's version: it said the installed distribution's (0.1.0 for a checkout at
    0.2.0), the version of other code than the one running."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "jobs", checkout / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    text = (ROOT / "pyproject.toml").read_text()
    (checkout / "pyproject.toml").write_text(text.replace('\nversion = "', '\nversion = "99.0.0+checkout.', 1))
    assert 'version = "99.0.0+checkout.' in (checkout / "pyproject.toml").read_text()
    probe = ("import sys\nimport jobs.cli\nassert jobs.cli.__file__.startswith(sys.argv[1]), jobs.cli.__file__\n"
             "jobs.cli.main(['--version'])\n")
    r = subprocess.run([sys.executable, "-c", probe, str(checkout)], capture_output=True, text=True, cwd=checkout,
                       env={**os.environ, "PYTHONPATH": str(checkout)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("batchgen 99.0.0+checkout."), r.stdout


def test_errors_of_the_checks_after_validation_name_the_override_too(tmp_path):
    """The checks `plan` (and `run`) make after the config validates (model.path exists,
    model.device against cluster.gpus_per_worker) and a section's check across its keys
    (input.column with format openai_batch) name the override that gave the value: they named
    the YAML file, which never set it (`job.yaml: model.path: '/nope/m' does not exist`)."""
    from jobs.cli import batch_spec
    from jobs.config import load_job_spec
    from jobs.errors import SpecError
    from jobs.plan.planner import check_device, check_model_path

    cfg = _plan_config(tmp_path)
    r = cli("plan", cfg, "--set", f"model.path={tmp_path / 'nope'}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: --set 'model.path={tmp_path / 'nope'}': model.path: "
                               f"'{tmp_path / 'nope'}' does not exist"), r.stderr
    r = cli("plan", cfg, "--set", "model.tokenizer=/nope/tok")
    assert r.returncode == 2 and r.stderr == ("error: --set 'model.tokenizer=/nope/tok': model.tokenizer: "
                                              "'/nope/tok' does not exist\n"), r.stderr
    # a check of two keys, one from the file (the default gpus_per_worker 0), one from --set
    with pytest.raises(SpecError, match=rf"^{cfg}, --set 'model.device=cuda': model.device: 'cuda' with "):
        check_device(load_job_spec(str(cfg), ["model.device=cuda"]))
    with pytest.raises(SpecError, match=r"^--set 'model.device=cuda', --set 'cluster.gpus_per_worker=0': "):
        check_device(load_job_spec(str(cfg), ["model.device=cuda", "cluster.gpus_per_worker=0"]))
    cuda_cfg = tmp_path / "cuda.yaml"  # both from the file: the file alone is named
    cuda_cfg.write_text(json.dumps({"model": {"device": "cuda"}}))
    with pytest.raises(SpecError, match=rf"^{cuda_cfg}: model.device: 'cuda' with "):
        check_device(load_job_spec(str(cuda_cfg), ["sampling.seed=1"]))
    with pytest.raises(SpecError, match=r"^override model.path='/nope/m': model.path: '/nope/m' does not exist"):
        check_model_path(load_job_spec(str(cfg), {"model.path": "/nope/m"}))
    # a JobSpec given to run_job keeps what set its keys
    spec = load_job_spec(str(cfg), ["model.path=/nope/m"])
    with pytest.raises(SpecError, match=r"^--set 'model.path=/nope/m': model.path: '/nope/m' does not exist"):
        check_model_path(load_job_spec(spec, {"sampling.seed": 3}))
    # run-batch: --model (with a config that does not give it)
    with pytest.raises(SpecError, match=r"^--model '/nope/m': model.path: '/nope/m' does not exist"):
        check_model_path(batch_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), config=str(cfg),
                                    model="/nope/m"))
    # a section's own check across its keys: the file gave format openai_batch, --set the column
    batch_cfg = tmp_path / "batch.yaml"
    batch_cfg.write_text(json.dumps({"input": {"path": "in.jsonl", "format": "openai_batch"}}))
    r = cli("plan", batch_cfg, "--set", "input.column=q")
    assert r.returncode == 2 and r.stderr.startswith(f"error: {batch_cfg}, --set 'input.column=q': input: column "
                                                     f"is not used with format openai_batch"), r.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`batchgen status OUT | head -3`: the reader closes the pipe, the next write fails with
    EPIPE. That printed a BrokenPipeError traceback (and another as Python flushed stdout at
    exit); now nothing on stderr and exit 141 (128 + SIGPIPE, as a shell reports it). The pipe's
    read end is closed before the child starts, so every write fails, whatever the timing."""
    od = _job(tmp_path)
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(od.path)], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=child_env(), timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 141, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


def test_a_toolbox_given_to_a_job_is_refused_naming_the_config_keys():
    """run_job(tools=ToolBox(...)) and GenerationPool(tools=ToolBox(...)) raised a bare TypeError
    ('ToolBox' object is not iterable): a ToolBox is an Engine's; a job's tool settings are its
    config's, and the message says which keys."""
    from engine.tool_runner import ToolBox
    from jobs.config import load_job_spec
    from jobs.errors import SpecError

    def add(a: int, b: int) -> int:
        return a + b

    spec = load_job_spec({"model": None})
    with pytest.raises(SpecError, match="tools.parallel_calls") as e:
        spec.with_python_tools(ToolBox([add], parallel_calls=True))
    assert e.value.exit_code == 2
