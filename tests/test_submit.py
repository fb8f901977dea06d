"""Cluster job submission against a real Ray head, as a cluster user runs it.

A head is started with `ray start --head` (dashboard and job server included, token
authentication on, as Ray >= 2.59 does by default), then:
- `batchgen submit` uploads the project through the Ray Jobs API and the job runs to a
  verified dataset on the cluster;
- `batchgen run --set cluster.address=HOST:PORT` joins the same cluster from outside, and
  `--set cluster.address=ray://HOST:PORT` reaches it through Ray Client (the code shipped as
  py_modules); both write the same dataset, row for row;
- a client without the cluster's token gets a message that says how to pass it, exit 1.
Everything runs in subprocesses (the CLI as users call it); waiting is `ray job logs
--follow`, which returns when the job ends.
The tests after those need no cluster: a recording client (which packs the upload with
Ray's own packager) checks what `submit` hands to the job server and prints: no URI
credentials in the job's metadata or the printout, and a config that Ray's upload would
leave out (.gitignore, .rayignore, EXCLUDES, the output directory) refused with exit 2.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp", reason="the Ray job server needs ray[default]")

from conftest import free_port, stop_shared_ray  # noqa: E402
from test_cluster import ROOT, assert_same_dataset, read_dataset  # noqa: E402

BIN = Path(sys.executable).parent
# tiny-random: submission and the cluster paths are under test, not the model (SmolLM2's prefill of
# the 64 demo prompts would take 20 s a run here)
OVERRIDES = ["--set", "sampling.num_samples=2", "--set", "sampling.max_tokens=8", "--set", "cluster.unit_rows=32",
             "--set", "model.path=tiny-random"]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head in its own process group; yields (env with the token, GCS address, job server
    URL, Ray Client address)."""
    stop_shared_ray()  # conftest.py's local instance: its dashboard agent holds the ports the head's needs
    tmp = tmp_path_factory.mktemp("head")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
               PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    env.pop("RAY_ADDRESS", None)
    # ephemeral ports: outside the worker port range (10002-19999) that `ray start` reserves; the
    # agents' too, whose fixed defaults another Ray instance on the machine may hold
    gcs_port, dash_port, client_port = free_port(), free_port(), free_port()
    agents = [a for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                             "--runtime-env-agent-port") for a in (flag, str(free_port()))]
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--port", str(gcs_port), "--num-cpus", "2",
         "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
         "--ray-client-server-port", str(client_port), "--disable-usage-stats", *agents],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, cwd=tmp)
    log = []
    for line in proc.stdout:  # `ray start --block` prints "--block" once the head is up
        log.append(line)
        if "--block" in line:
            break
    else:
        pytest.fail("ray start --head failed:\n" + "".join(log[-30:]))
    try:
        yield env, f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dash_port}", f"ray://127.0.0.1:{client_port}"
    finally:
        # SIGKILL the whole group: `ray stop` would stop every Ray instance on the machine,
        # and SIGTERM makes the head linger for about 40 s.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)  # waiting for the kernel to reap the group, not for work to happen
        # `ray stop` would also forget the head's address, which `ray.init("auto")` reads
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(f":{gcs_port}"):
            current.unlink()


def batchgen(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_submit_then_run_on_the_same_cluster(head, tmp_path):
    from jobs.outputs.output_dir import OutputDir

    env, _, url, client = head
    submitted = tmp_path / "submitted"

    r = batchgen("submit", "configs/demo.yaml", "--address", url, "--set", f"output.path={submitted}", *OVERRIDES,
                 env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"submitted job (\S+) to ", r.stdout).group(1)
    assert f"ray job logs --follow {job_id} --address {url}" in r.stdout

    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--follow", job_id, "--address", url], env=env,
                          text=True, capture_output=True, timeout=300)
    status = subprocess.run([str(BIN / "ray"), "job", "status", job_id, "--address", url], env=env,
                            text=True, capture_output=True, timeout=60)
    said = re.sub(r"\x1b\[[0-9;]*m", "", status.stdout + status.stderr)  # colours off
    assert f"Job '{job_id}' succeeded" in said, said + logs.stdout[-3000:] + logs.stderr[-3000:]
    assert "samples (rows):   128 (0 error rows)" in logs.stdout, logs.stdout[-3000:]
    assert OutputDir(str(submitted)).verify() == []

    # the same job from outside the cluster through Ray Client: the same dataset. (The
    # submitted job's own driver joined the cluster by address, `cluster.address=auto`.)
    for name, address in [("client", client)]:
        out = tmp_path / name
        r = batchgen("run", "configs/demo.yaml", "--set", f"output.path={out}", "--set", f"cluster.address={address}",
                     *OVERRIDES, env=env)
        assert r.returncode == 0, (address, r.stdout[-3000:] + r.stderr[-3000:])
        assert OutputDir(str(out)).verify() == []
        rows = read_dataset(out)
        assert len(rows) == 128
        assert_same_dataset(rows, read_dataset(submitted))


def test_submit_from_a_non_editable_install(head, tmp_path):
    """batchgen installed with `pip install .` (not -e): its packages lie in site-packages, no
    project around them. `submit` ships them as py_modules and the config alone, which may lie
    anywhere, and the job runs to a verified dataset. (PROJECT_ROOT was site-packages: every
    config was refused, "copy it there", and one put there would have had all of site-packages
    uploaded.)"""
    from jobs.outputs.output_dir import OutputDir

    env, _, url, _ = head
    site = tmp_path / "site-packages"  # what the wheel installs: pyproject.toml's packages
    for p in ("engine", "cluster", "jobs"):
        shutil.copytree(ROOT / p, site / p, ignore=shutil.ignore_patterns("__pycache__"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "job.yaml").write_text((ROOT / "configs" / "demo.yaml").read_text())
    env = {**env, "PYTHONPATH": str(site)}
    which = subprocess.run([sys.executable, "-c", "import jobs.submit as s; print(s.PROJECT_ROOT)"], cwd=mine, env=env,
                           text=True, capture_output=True, timeout=60)
    assert which.stdout.strip() == str(site), which.stdout + which.stderr
    out = tmp_path / "out"

    r = subprocess.run([sys.executable, "-m", "jobs.cli", "submit", "job.yaml", "--address", url,
                        "--set", f"output.path={out}", *OVERRIDES], cwd=mine, env=env, text=True, capture_output=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"submitted job (\S+) to ", r.stdout).group(1)
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--follow", job_id, "--address", url], env=env,
                          text=True, capture_output=True, timeout=300)
    assert "samples (rows):   128 (0 error rows)" in logs.stdout, logs.stdout[-3000:] + logs.stderr[-3000:]
    assert OutputDir(str(out)).verify() == []


def test_submit_without_the_token_says_how_to_pass_it(head, tmp_path):
    env, _, url, _ = head
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}
    no_token["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    r = batchgen("submit", "configs/demo.yaml", "--address", url, "--set", f"output.path={tmp_path / 'out'}",
                 env=no_token, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot submit to the Ray job server at {url}: AuthenticationError" in r.stderr
    assert "RAY_AUTH_MODE=token" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


# --- without a cluster: what `submit` hands to the job server and prints (a recording client)

class RecordingClient:
    """A JobSubmissionClient stand-in: records each submit_job call and packs the runtime_env's
    working_dir as Ray's job SDK does (Ray's default excludes, then the runtime_env's; .gitignore
    and .rayignore files honoured), so a test sees which files the head would get."""

    def __init__(self, tmp: Path):
        self.tmp, self.calls, self.uploaded = tmp, [], None

    def submit_job(self, entrypoint, runtime_env, metadata):
        import zipfile

        from ray._private import ray_constants
        from ray._private.runtime_env import packaging

        self.calls.append({"entrypoint": entrypoint, "runtime_env": runtime_env, "metadata": metadata})
        out = self.tmp / f"upload{len(self.calls)}.zip"
        packaging._zip_files(runtime_env["working_dir"],
                             ray_constants.get_runtime_env_default_excludes() + list(runtime_env["excludes"]),
                             str(out), include_gitignore=True)
        self.uploaded = set(zipfile.ZipFile(out).namelist())
        return f"raysubmit_{len(self.calls)}"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A small project directory standing in for batchgen's checkout (jobs.submit.PROJECT_ROOT), not
    a git repository; returns (root, put) where put(rel) writes the demo config there."""
    import jobs.submit

    root = tmp_path / "proj"
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "x.py").write_text("")
    (root / "pyproject.toml").write_text("")  # a project checkout, not an installed package
    monkeypatch.setattr(jobs.submit, "PROJECT_ROOT", root)
    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", raising=False)
    monkeypatch.delenv("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", raising=False)

    def put(rel: str, text: str | None = None) -> Path:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text is not None else (ROOT / "configs" / "demo.yaml").read_text())
        return path

    return root, put


def test_submit_keeps_uri_credentials_out_of_the_job_metadata_and_the_printout(project, tmp_path, capsys):
    """Credentials in an output or input URI (user:secret@ and ?secret_key=) reach the job (its
    entrypoint, or the shipped config) but not the job's metadata nor what `submit` prints, from a
    --set as from the config file; the printout still shows the URIs without them."""
    from jobs.submit import submit_job

    root, put = project
    text = (ROOT / "configs" / "demo.yaml").read_text().replace(
        "path: out/demo", "path: s3://AKIAFILE:FILESECRET@bkt/file-run?endpoint_override=10.0.0.5:9000&scheme=http")
    assert "FILESECRET" in text
    put("configs/job.yaml", text)
    client = RecordingClient(tmp_path)
    output = "s3://AKIAOUT:OUTSECRET@bkt/run?endpoint_override=10.0.0.5:9000&scheme=http"
    inp = "s3://AKIAIN:INSECRET@bkt/in/*.parquet?secret_key=OPTSECRET&region=x"

    assert submit_job(str(root / "configs/job.yaml"), "http://h:8265", [f"output.path={output}", f"input.path={inp}"],
                      client=client) == 0
    assert submit_job(str(root / "configs/job.yaml"), "http://h:8265", [], client=client) == 0
    printed = capsys.readouterr().out

    first, second = client.calls
    assert first["metadata"]["output"] == "s3://bkt/run?endpoint_override=10.0.0.5:9000&scheme=http"
    assert second["metadata"]["output"] == "s3://bkt/file-run?endpoint_override=10.0.0.5:9000&scheme=http"
    for secret in ("AKIAOUT", "OUTSECRET", "AKIAIN", "INSECRET", "OPTSECRET", "AKIAFILE", "FILESECRET"):
        assert secret not in printed, printed
        assert secret not in repr([c["metadata"] for c in client.calls])
    assert "output.path=s3://bkt/run?endpoint_override=10.0.0.5:9000&scheme=http" in printed
    assert "input.path=s3://bkt/in/*.parquet?region=x" in printed
    # what the job needs still reaches it: the --set values as given, the config file as it is
    assert output in first["entrypoint"] and inp in first["entrypoint"]
    assert "configs/job.yaml" in client.uploaded


@pytest.mark.parametrize("files, config, reason", [
    ({".gitignore": "local/\n"}, "local/job.yaml", ".gitignore names local/job.yaml (pattern 'local/')"),
    ({"mine/.gitignore": "*\n!.gitignore\n"}, "mine/job.yaml", "mine/.gitignore names mine (pattern '*')"),
    ({".rayignore": "private\n"}, "private/job.yaml", ".rayignore names private (pattern 'private')"),
    ({}, "bench/job.yaml", "it lies under bench, which `submit` never uploads"),
    ({}, "results/job.yaml", "it lies in the job's output directory results/"),
])
def test_submit_refuses_a_config_the_upload_would_leave_out(project, tmp_path, files, config, reason):
    """A config in a folder that a .gitignore or .rayignore names (Ray's packager leaves those out
    whatever `excludes` says), under batchgen's EXCLUDES, or in the job's output directory stops
    before anything is submitted: exit code 2 (SpecError), a message naming the config file and
    why. (It used to be submitted without its config, and the job failed on the head.)"""
    from jobs.errors import SpecError
    from jobs.submit import submit_job

    root, put = project
    for rel, text in files.items():
        put(rel, text)
    path = put(config)
    # the layout is one Ray's packager really leaves the config out of
    from jobs.submit import EXCLUDES

    ray_packs = RecordingClient(tmp_path)
    ray_packs.submit_job("true", {"working_dir": str(root), "excludes": EXCLUDES + ["results"]}, {})
    assert config not in ray_packs.uploaded and "jobs/x.py" in ray_packs.uploaded

    client = RecordingClient(tmp_path)
    with pytest.raises(SpecError) as e:
        submit_job(str(path), "http://h:8265", [f"output.path={root / 'results'}"], client=client)
    assert e.value.exit_code == 2
    assert str(e.value).startswith(f"{path}: `submit` would not upload this config"), str(e.value)
    assert reason in str(e.value), str(e.value)
    assert client.calls == []


@pytest.mark.parametrize("layout", ["configs", "ignored elsewhere", "git info/exclude"])
def test_submit_ships_a_config_in_an_uploaded_folder(project, tmp_path, layout):
    """No false refusals: a config in configs/, beside a .gitignore that names other folders, or in
    a folder that only .git/info/exclude ignores (Ray does not read it; `submit` drops that
    folder from its excludes), is submitted and is in what Ray uploads."""
    from jobs.submit import submit_job

    root, put = project
    config = "configs/job.yaml"
    if layout == "ignored elsewhere":
        put(".gitignore", "local/\n*.bin\n")
    elif layout == "git info/exclude":
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        (root / ".git" / "info").mkdir(parents=True, exist_ok=True)
        (root / ".git" / "info" / "exclude").write_text("local/\n")
        config = "local/job.yaml"
    put(config)
    client = RecordingClient(tmp_path)
    assert submit_job(str(root / config), "http://h:8265", [], client=client) == 0
    assert config in client.uploaded and "jobs/x.py" in client.uploaded


@pytest.mark.parametrize("layout", ["git ignores data[1]", "git ignores a*", "output res[1]", "output data"])
def test_submit_excludes_exactly_the_paths_it_means(project, tmp_path, layout):
    """What git ignores and the job's output directory are left out of the upload as those very
    paths: names with glob characters are escaped and the patterns anchored at the project. (They
    were patterns as given: "/data[1]" refused a config in data1/, "/a*" dropped abc/ from the
    upload, an output res[1] with a previous run was uploaded, and output.path ./data dropped
    jobs/data/, the packaged inputs.)"""
    from jobs.errors import SpecError
    from jobs.submit import submit_job

    root, put = project
    config, output, shipped, left_out = "configs/job.yaml", str(tmp_path / "elsewhere"), [], []
    if layout.startswith("git"):
        subprocess.run(["git", "init", "-q", str(root)], check=True)
        (root / ".git" / "info").mkdir(parents=True, exist_ok=True)
        ignored = "data[1]/big.bin" if "data" in layout else "a*"
        (root / ".git" / "info" / "exclude").write_text("/" + re.sub(r"([\[\]*?])", r"\\\1", ignored.split("/")[0]) + "\n")
        put(ignored, "x")
        if "data" in layout:
            config = "data1/job.yaml"
        else:
            shipped.append(put("abc/keep.py", "").relative_to(root).as_posix())
        left_out.append(ignored)
    elif layout == "output res[1]":
        output = str(root / "res[1]")
        left_out.append(put("res[1]/part-000000.parquet", "a previous run").relative_to(root).as_posix())
    else:
        output = str(root / "data")
        shipped.append(put("jobs/data/gsm8k_demo.parquet", "x").relative_to(root).as_posix())
    put(config)
    client = RecordingClient(tmp_path)
    assert submit_job(str(root / config), "http://h:8265", [f"output.path={output}"], client=client) == 0
    for rel in [config, "jobs/x.py"] + shipped:
        assert rel in client.uploaded, (rel, sorted(client.uploaded))
    for rel in left_out:
        assert rel not in client.uploaded, (rel, sorted(client.uploaded))
    if layout == "output res[1]":  # and a config in that output directory is refused, as any other's
        with pytest.raises(SpecError) as e:
            submit_job(str(put("res[1]/job.yaml")), "http://h:8265", [f"output.path={output}"], client=client)
        assert "it lies in the job's output directory res[1]/" in str(e.value)
