"""`batchgen submit`: run a job on a Ray cluster through its job server (the dashboard port).

    batchgen submit configs/demo.yaml --address http://HEAD:8265 [--set KEY=VALUE ...]

The config is validated here first (exit 2 before anything is submitted). The job's
entrypoint is `python -m jobs.cli run <config> [--set ...]`, run on the head node inside a
`runtime_env` whose working_dir is this project directory (engine/, cluster/, jobs/,
configs/... minus .git, .venv, outputs, what git ignores and other bulk), so the cluster needs batchgen's
dependencies (torch, ray, pyarrow, pydantic, tiktoken, ...; e.g. a Ray image with
`pip install batchgen`'s requirements) but not batchgen itself, and the driver and every
worker import the submitted code. Consequences:
- the config file must lie inside the project directory (it travels with it);
- relative paths in the config resolve inside the shipped directory on the head node, so
  input.path / output.path should be absolute paths on storage every node shares, or URIs
  (s3://..., gs://...); cluster.address is forced to "auto" (the submitting cluster).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from jobs.errors import JobError, SpecError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
EXCLUDES = [".git", ".venv", "venv", "out", "**/__pycache__", ".pytest_cache", "bench", "*.egg-info"]


def git_ignored(root: Path) -> list[str]:
    """What git ignores in the checkout at `root`, as Ray `excludes` patterns anchored at the
    working_dir ("/.dev", "/data/big.bin"): Ray leaves out what `.gitignore` files name, but
    not `.git/info/exclude` or the user's global excludes, and the job server refuses a
    working_dir over 100 MB (a model or dataset kept beside the code used to make `submit`
    fail with "Maximum request body size exceeded"). [] when `root` is not a git checkout,
    git is missing, or RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 (Ray's own switch: ship ignored
    files too)."""
    if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE") == "1" or not (root / ".git").exists():
        return []
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--others", "--ignored",
                                 "--exclude-standard", "--directory"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return ["/" + p.rstrip("/") for p in listed.stdout.decode(errors="surrogateescape").split("\0") if p]


def build_entrypoint(config_rel: str, overrides: Sequence[str], overwrite: bool) -> str:
    args = ["python", "-m", "jobs.cli", "run", config_rel]
    for o in list(overrides) + ["cluster.address=auto"]:
        args += ["--set", o]
    if overwrite:
        args.append("--overwrite")
    return " ".join(shlex.quote(a) for a in args)


def submit_job(config_path: str, address: str, overrides: Sequence[str] = (), overwrite: bool = False,
               *, client: Any = None) -> int:
    """Validate the config, submit it, print the job id and how to follow it; returns 0.

    Raises SpecError (exit code 2) for an invalid config or one outside the project directory.
    `client`: a JobSubmissionClient-like object (tests); default JobSubmissionClient(address).
    """
    from jobs.config import load_spec

    spec = load_spec(config_path, overrides)  # exit 2 before contacting the cluster
    cfg = Path(config_path).resolve()
    try:
        config_rel = cfg.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        raise SpecError(f"{config_path}: `submit` ships the project directory {PROJECT_ROOT} to the cluster, and "
                        f"the config must be inside it; copy it there (e.g. to configs/)") from None
    # never what holds the config: the job runs it on the head node
    excludes = list(EXCLUDES) + [p for p in git_ignored(PROJECT_ROOT)
                                 if not ("/" + config_rel + "/").startswith(p + "/")]
    out = spec.output.path
    if "://" not in out:
        try:  # never upload a previous run's output
            excludes.append(Path(os.path.abspath(out)).relative_to(PROJECT_ROOT).as_posix())
        except ValueError:
            pass
    entrypoint = build_entrypoint(config_rel, overrides, overwrite)
    runtime_env = {"working_dir": str(PROJECT_ROOT), "excludes": excludes}
    try:
        if client is None:
            from ray.job_submission import JobSubmissionClient

            client = JobSubmissionClient(address)
        job_id = _submit_when_an_agent_is_up(client, entrypoint=entrypoint, runtime_env=runtime_env,
                                             metadata={"batchgen_config": config_rel, "output": str(out)})
    except Exception as e:  # noqa: BLE001 - the client's errors have no common base; name the cause
        raise JobError(_explain_client_error(e, address)) from None
    print(f"submitted job {job_id} to {address}")
    print(f"  entrypoint: {entrypoint}")
    print(f"  follow:     ray job logs --follow {job_id} --address {address}")
    print(f"  status:     ray job status {job_id} --address {address}")
    print(f"  stop:       ray job stop {job_id} --address {address}")
    return 0


AGENT_WAIT_S = 60.0  # how long a freshly started head may take to bring up its job agent


def _submit_when_an_agent_is_up(client: Any, **kwargs: Any) -> str:
    """client.submit_job(**kwargs), retried while the job server answers that no job agent is
    available yet: a head started moments ago (`ray start --head`) says so until its dashboard
    agent registers (seconds, more on a busy machine). Retries with growing pauses for up to
    AGENT_WAIT_S seconds; any other error, or the same one after that, is raised."""
    deadline = time.monotonic() + AGENT_WAIT_S
    pause = 0.5
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)  # waiting on another process's start-up: nothing to be notified by
        pause = min(pause * 2, 5.0)


def _explain_client_error(e: Exception, address: str) -> str:
    """One message for a failed submission: what failed, and for the usual causes what to do."""
    name = type(e).__name__
    first = (str(e).strip().splitlines() or [""])[0]
    msg = f"cannot submit to the Ray job server at {address}: {name}: {first}"
    if name == "AuthenticationError":
        # Ray >= 2.59 turns token auth on by default for clusters started on a machine that has
        # a token (~/.ray/auth_token), while clients send it only with RAY_AUTH_MODE=token.
        msg += ("\n  the cluster uses Ray token authentication: run with RAY_AUTH_MODE=token and the "
                "cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN "
                "(`ray get-auth-token` on the head prints it; "
                "https://docs.ray.io/en/latest/ray-security/token-auth.html)")
    elif isinstance(e, OSError):  # ConnectionError, and requests' errors, are OSErrors
        msg += ("\n  is the head running with its dashboard (`ray start --head`, ray[default] installed) "
                "and is the address its dashboard port (8265 by default)?")
    return msg
