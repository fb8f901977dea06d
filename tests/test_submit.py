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
"""
from __future__ import annotations

import os
import re
import secrets
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
    # ephemeral ports: outside the worker port range (10002-19999) that `ray start` reserves
    gcs_port, dash_port, client_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--port", str(gcs_port), "--num-cpus", "2",
         "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash_port),
         "--ray-client-server-port", str(client_port), "--disable-usage-stats"],
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
