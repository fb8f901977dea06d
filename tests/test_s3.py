"""Input and output on S3: the demo job against a real S3 API server (moto, in its own
process on 127.0.0.1) through pyarrow's S3 filesystem, URIs in pyarrow's form with options
(`s3://bucket/prefix?endpoint_override=127.0.0.1:PORT&scheme=http`) and credentials from
the standard AWS environment variables.

The driver (`batchgen run` in a subprocess, its own Ray instance) is SIGKILLed once a unit
is on the store; the same command resumes and completes, and the dataset equals a clean
local run of the same job (its units run in this process by one worker, local input and
output), row for row and bit for bit (CPU, batch-invariant). `status` and
`verify` read the S3 output, and `verify` still finds a stray object there.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("moto")
pytest.importorskip("ray")
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from test_cluster import ROOT  # noqa: E402
from conftest import child_env, free_port, kill_driver_once  # noqa: E402

pytestmark = pytest.mark.slow
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "batchgen-test", "AWS_SECRET_ACCESS_KEY": "batchgen-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
# tiny-random: the object store, the kill and the resume are under test, not the model (SmolLM2's
# prefill of the 64 prompts would take 20 s a run here)
JOB = ["--set", "sampling.num_samples=2", "--set", "sampling.max_tokens=8", "--set", "cluster.unit_rows=16",
       "--set", "model.path=tiny-random"]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with bucket `bkt`; yields (options query, env)."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "RAY_ADDRESS"}, **CREDENTIALS}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = []
    for line in proc.stdout:  # the server prints its address once it listens
        log.append(line)
        if f"Running on http://127.0.0.1:{port}" in line:
            break
    else:
        pytest.fail("moto server did not start:\n" + "".join(log[-20:]))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain its request log
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", allow_bucket_creation=True,
                          access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                          secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).create_dir("bkt")
        yield f"endpoint_override=127.0.0.1:{port}&scheme=http", env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _rows(fs: pafs.FileSystem, base: str) -> list[dict]:
    rows = []
    for info in sorted(fs.get_file_info(pafs.FileSelector(base)), key=lambda i: i.path):
        if info.path.rsplit("/", 1)[-1].startswith("part-"):
            with fs.open_input_file(info.path) as f:
                rows.extend(pq.read_table(f).to_pylist())
    return sorted(rows, key=lambda r: (r["prompt_id"], r["sample_index"]))


def _local_clean_run(out) -> None:
    """The same demo job with local input and output, uninterrupted: every unit in order
    through one GenerationWorker in this process."""
    from cluster.worker import GenerationWorker
    from jobs.config import load_spec
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job
    from jobs.task import JobTask

    spec = load_spec(ROOT / "configs" / "demo.yaml", [a for a in JOB if a != "--set"] + [f"output.path={out}"])
    plan = plan_job(spec)
    OutputDir(str(out)).prepare(plan, spec)
    w = GenerationWorker(JobTask(spec, plan), "local", num_threads=1)
    for u in plan.units:
        w.run_unit(u)
    w.shutdown()


def test_demo_job_on_s3_killed_and_resumed_equals_a_local_run(s3, tmp_path):
    from jobs.uri import filesystem_for

    options, env = s3
    env = {**env, "PYTHONPATH": child_env()["PYTHONPATH"]}
    inp, outp = f"s3://bkt/prompts/?{options}", f"s3://bkt/runs/demo?{options}"
    fs, _ = filesystem_for(outp)
    with open(ROOT / "jobs" / "data" / "gsm8k_demo.parquet", "rb") as src, \
            fs.open_output_stream("bkt/prompts/gsm8k_demo.parquet") as dst:
        dst.write(src.read())

    cmd = [sys.executable, "-m", "jobs.cli", "run", "configs/demo.yaml", "--set", f"input.path={inp}",
           "--set", f"output.path={outp}", *JOB]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    kill_driver_once(proc, lambda: any(i.path.rsplit("/", 1)[-1].startswith("part-")  # the first commit
                                       for i in fs.get_file_info(pafs.FileSelector("bkt/runs/demo",
                                                                                   allow_not_found=True))),
                     timeout_s=240, poll_s=0.2)
    names = [i.path.rsplit("/", 1)[-1] for i in fs.get_file_info(pafs.FileSelector("bkt/runs/demo", recursive=True))]
    committed = [n for n in names if n.startswith("part-")]
    assert 1 <= len(committed) < 4 and "_SUCCESS" not in names
    assert not any(n.startswith(".tmp") for n in names)  # an object store commit has no temporary objects
    assert "lease.json" in names  # the killed driver's; the rerun on this host takes it over

    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "taking over the output lease of pid" in rerun.stderr and "is gone" in rerun.stderr
    assert f"units:            4 ({4 - len(committed)} run now)" in rerun.stdout

    local = tmp_path / "local"
    _local_clean_run(local)
    on_s3, here = _rows(fs, "bkt/runs/demo"), _rows(pafs.LocalFileSystem(), str(local))
    assert len(on_s3) == 64 * 2 and on_s3 == here  # every column, bit for bit

    for verb, expect in [("status", "units:            4/4 committed"), ("verify", "ok: ")]:
        r = subprocess.run([sys.executable, "-m", "jobs.cli", verb, outp], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr
    with fs.open_output_stream("bkt/runs/demo/stray.bin") as f:
        f.write(b"x")
    r = subprocess.run([sys.executable, "-m", "jobs.cli", "verify", outp], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "stray.bin: unexpected file" in r.stdout


def test_object_keys_with_query_and_escape_characters(s3, tmp_path):
    """Object keys holding "?", "#", "%" or a space are read and written: a URI's path is
    percent-decoded as pyarrow's from_uri does (`a%3Fb` is the key `a?b`), and the URIs batchgen
    makes for the files it lists encode them again. (A listed key with "?" used to be cut at it,
    the rest taken for options: a directory holding one failed with "cannot open this URI", and
    no spelling of its URI reached it.)"""
    from jobs import uri

    options, env = s3
    env = {**env, "PYTHONPATH": child_env()["PYTHONPATH"]}
    key = "a?b #c%41.parquet"
    fs, _ = uri.filesystem_for(f"s3://bkt/odd/?{options}")
    with open(ROOT / "jobs" / "data" / "gsm8k_demo.parquet", "rb") as src, fs.open_output_stream(f"bkt/odd/{key}") as dst:
        dst.write(src.read())
    encoded = f"s3://bkt/odd/a%3Fb%20%23c%2541.parquet?{options}"
    assert uri.filesystem_for(encoded)[1] == f"bkt/odd/{key}"
    assert uri.uri_for(f"s3://bkt/odd/?{options}", f"bkt/odd/{key}") == encoded.replace("%20", " ")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    from jobs.config import load_spec
    from jobs.plan.report import describe_plan

    for inp in (f"s3://bkt/odd/?{options}", encoded):  # the directory that holds it, and the file itself
        report, code = describe_plan(load_spec(ROOT / "configs" / "demo.yaml", [f"input.path={inp}",
                                                                                  f"output.path={tmp_path / 'p'}"]))
        assert code == 0 and f"  {key}: 64 rows in 4 row groups" in report, report
    out = f"s3://bkt/runs/x%3Fy?{options}"  # an output prefix with "?" in it
    r = cli("run", "configs/demo.yaml", "--set", f"input.path=s3://bkt/odd/?{options}", "--set", f"output.path={out}",
            *JOB)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(i.path == "bkt/runs/x?y/_SUCCESS" for i in fs.get_file_info(pafs.FileSelector("bkt/runs/x?y")))
    r = cli("verify", out)
    assert r.returncode == 0 and "ok: " in r.stdout, r.stdout + r.stderr
