"""`batchgen submit`: run a job on a Ray cluster through its job server (the dashboard port).

    batchgen submit configs/demo.yaml --address http://HEAD:8265 [--set KEY=VALUE ...]

The config is validated here first (exit 2 before anything is submitted). The job's
entrypoint is `python -m jobs.cli run <config> [--set ...]`, run on the head node inside a
`runtime_env` whose working_dir is this project directory (engine/, cluster/, jobs/,
configs/... minus .git, .venv, outputs, what git ignores and other bulk), so the cluster needs batchgen's
dependencies (torch, ray, pyarrow, pydantic, tiktoken, ...; e.g. a Ray image with
`pip install batchgen`'s requirements) but not batchgen itself, and the driver and every
worker import the submitted code. Consequences:
- the config file must lie inside the project directory (it travels with it), in a folder
  that is uploaded: one that a .gitignore or .rayignore file names (Ray's packager leaves
  those out), or that lies under EXCLUDES or the job's output, is refused (exit 2);
- credentials in URIs (s3://KEY:SECRET@bucket/..., ?secret_key=...) are left out of the job's
  metadata and of what is printed; the entrypoint given to Ray carries the --set values as
  given (the job needs them), so Ray's job server holds them as the entrypoint;
- relative paths in the config resolve inside the shipped directory on the head node, so
  input.path / output.path should be absolute paths on storage every node shares, or URIs
  (s3://..., gs://...); cluster.address is forced to "auto" (the submitting cluster).
- batchgen installed without its project (`pip install .`, not `pip install -e .`: no
  pyproject.toml beside the packages, which lie in site-packages): its packages engine/,
  cluster/, jobs/ are shipped as the runtime_env's py_modules and the config file alone as the
  working_dir, from wherever it lies.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from jobs.errors import JobError, SpecError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "cluster", "jobs")  # what an install of batchgen holds (pyproject.toml's packages)
EXCLUDES = [".git", ".venv", "venv", "out", "**/__pycache__", ".pytest_cache", "bench", "*.egg-info"]
RAY_DEFAULT_EXCLUDES = [".git", ".venv", "venv", "__pycache__"]  # Ray 2.60's, where Ray does not say
URI_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\",\]}]*")


def literal_pattern(rel: str) -> str:
    """The gitwildmatch pattern (Ray `excludes`) for exactly the path `rel` under the working_dir:
    anchored at it, glob characters escaped ("data[1]" -> "/data\\[1\\]", not "data1" at any depth)."""
    return "/" + re.sub(r"([\\\[\]*?])", r"\\\1", rel.strip("/"))


def git_ignored(root: Path) -> list[str]:
    """What git ignores in the checkout at `root`, as Ray `excludes` patterns for exactly those
    paths (literal_pattern: "/.dev", "/data/big.bin"): Ray leaves out what `.gitignore` files name, but
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
    return [literal_pattern(p) for p in listed.stdout.decode(errors="surrogateescape").split("\0") if p]


def build_entrypoint(config_rel: str, overrides: Sequence[str], overwrite: bool) -> str:
    args = ["python", "-m", "jobs.cli", "run", config_rel]
    for o in list(overrides) + ["cluster.address=auto"]:
        args += ["--set", o]
    if overwrite:
        args.append("--overwrite")
    return " ".join(shlex.quote(a) for a in args)


def redact_override(override: str) -> str:
    """A --set KEY=VALUE as it may be printed: every URI in it without credentials (uri.redact)."""
    from jobs import uri

    return URI_RE.sub(lambda m: uri.redact(m.group(0)), override)


def _path_spec() -> Any:
    """The gitwildmatch matcher Ray's packager uses (its vendored pathspec), or None."""
    try:
        from ray._private.thirdparty.pathspec import PathSpec
    except ImportError:
        try:
            from pathspec import PathSpec  # type: ignore[no-redef]
        except ImportError:
            return None
    return PathSpec


def _matching_pattern(spec_cls: Any, lines: Sequence[str], rel: str) -> str | None:
    """The pattern of `lines` (gitwildmatch, the last match wins) that excludes `rel`, or None."""
    if not spec_cls.from_lines("gitwildmatch", lines).match_file(rel):
        return None
    for line in reversed(lines):
        s = line.strip()
        if s and not s.startswith(("#", "!")) and spec_cls.from_lines("gitwildmatch", [line]).match_file(rel):
            return s
    return "?"


def why_not_uploaded(root: Path, config_rel: str, excludes: Sequence[str], output_rel: str | None = None) -> str | None:
    """Why Ray's packager would leave the file `config_rel` (relative to the working_dir `root`)
    out of the upload, or None when it ships. As ray._private.runtime_env.packaging walks the
    tree: going from `root` down to the file, a path is skipped when it matches (gitwildmatch)
    Ray's default excludes or `excludes`, relative to `root`, or the .gitignore (unless
    RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) or .rayignore file of a folder on the way (the path's
    own included), relative to that folder. `output_rel`: the pattern that stands for the
    job's output directory, for the message."""
    spec_cls = _path_spec()
    if spec_cls is None:  # no Ray to upload with either: the client says so
        return None
    try:
        from ray._private.ray_constants import get_runtime_env_default_excludes

        defaults = list(get_runtime_env_default_excludes())
    except (ImportError, AttributeError):
        defaults = list(RAY_DEFAULT_EXCLUDES)
    names = [".rayignore"]
    if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1":
        names.insert(0, ".gitignore")
    ignore_files: list[tuple[Path, Path, list[str]]] = []  # (folder, file, lines), outermost first
    parts = config_rel.split("/")
    for i in range(len(parts) + 1):
        p = root.joinpath(*parts[:i])
        if p.is_dir():
            for name in names:
                f = p / name
                if f.is_file():
                    with f.open("r") as fh:  # as Ray reads it
                        ignore_files.append((p, f, fh.readlines()))
        rel = "/".join(parts[:i]) or "."
        pattern = _matching_pattern(spec_cls, defaults + list(excludes), rel)
        if pattern is not None:
            if output_rel is not None and pattern == output_rel:
                return f"it lies in the job's output directory {rel}/, which `submit` never uploads"
            return f"it lies under {rel}, which `submit` never uploads (exclude pattern {pattern!r})"
        for folder, f, lines in ignore_files:
            pattern = _matching_pattern(spec_cls, lines, p.relative_to(folder).as_posix())
            if pattern is not None:
                where = f.relative_to(root).as_posix()
                return (f"{where} names {rel} (pattern {pattern!r}), and Ray's job upload leaves out what "
                        f"{f.name} files name")
    return None


def submit_job(config_path: str, address: str, overrides: Sequence[str] = (), overwrite: bool = False,
               *, client: Any = None) -> int:
    """Validate the config, submit it, print the job id and how to follow it; returns 0.

    Raises SpecError (exit code 2) for an invalid config, or, from a project checkout, one outside
    the project directory or in a part of it that is not uploaded (why_not_uploaded).
    `client`: a JobSubmissionClient-like object (tests); default JobSubmissionClient(address).
    """
    from jobs.config import load_spec

    spec = load_spec(config_path, overrides)  # exit 2 before contacting the cluster
    cfg = Path(config_path).resolve()
    out = spec.output.path
    if not (PROJECT_ROOT / "pyproject.toml").is_file():
        # installed (`pip install .`): PROJECT_ROOT is site-packages, not a project to upload
        with tempfile.TemporaryDirectory(prefix="batchgen-submit-") as shipped:
            shutil.copyfile(cfg, Path(shipped) / cfg.name)
            runtime_env = {"working_dir": shipped, "py_modules": [str(PROJECT_ROOT / p) for p in PACKAGES],
                           "excludes": ["**/__pycache__"]}
            return _submit(address, cfg.name, overrides, overwrite, runtime_env, str(out), client)
    try:
        config_rel = cfg.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        raise SpecError(f"{config_path}: `submit` ships the project directory {PROJECT_ROOT} to the cluster, and "
                        f"the config must be inside it; copy it there (e.g. to configs/)") from None
    # never what holds the config: the job runs it on the head node
    excludes = list(EXCLUDES) + [p for p in git_ignored(PROJECT_ROOT)
                                 if not (literal_pattern(config_rel) + "/").startswith(p + "/")]
    output_rel = None
    if "://" not in out:
        try:  # never upload a previous run's output
            output_rel = literal_pattern(Path(os.path.abspath(out)).relative_to(PROJECT_ROOT).as_posix())
            excludes.append(output_rel)
        except ValueError:
            pass
    # Ray's packager also leaves out what .gitignore / .rayignore files name, the config with it:
    # the job would then fail on the head after `submit` said it was submitted
    why = why_not_uploaded(PROJECT_ROOT, config_rel, excludes, output_rel)
    if why is not None:
        raise SpecError(f"{config_path}: `submit` would not upload this config to the cluster with the project "
                        f"(the job would fail there): {why}; move it to a folder that is uploaded, e.g. configs/")
    return _submit(address, config_rel, overrides, overwrite, {"working_dir": str(PROJECT_ROOT), "excludes": excludes},
                   str(out), client)


def _submit(address: str, config_rel: str, overrides: Sequence[str], overwrite: bool, runtime_env: dict[str, Any],
            out: str, client: Any) -> int:
    """Submit `python -m jobs.cli run config_rel` with `runtime_env`; print the job id and how to follow it."""
    from jobs import uri

    entrypoint = build_entrypoint(config_rel, overrides, overwrite)
    shown = build_entrypoint(config_rel, [redact_override(o) for o in overrides], overwrite)  # for the record
    try:
        if client is None:
            from ray.job_submission import JobSubmissionClient

            client = JobSubmissionClient(address)
        job_id = _submit_when_an_agent_is_up(client, entrypoint=entrypoint, runtime_env=runtime_env,
                                             metadata={"batchgen_config": config_rel, "output": uri.redact(out)})
    except Exception as e:  # noqa: BLE001 - the client's errors have no common base; name the cause
        raise JobError(_explain_client_error(e, address)) from None
    print(f"submitted job {job_id} to {address}")
    print(f"  entrypoint: {shown}")
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
