"""Job-level errors and the exit codes the CLI turns them into.

Exit code 2: the job cannot start (bad config, bad input schema, output belongs to another
job); raised before any unit runs, and the message names the key, file, column or row.
Exit code 1: the job started and failed (a unit kept failing, workers kept dying).

`shown(value)` is how a message echoes a value it refuses: its repr, bounded.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # `shown`, `shown_key` and MAX_SHOWN_CHARS are engine.params' (one rule for both layers; engine/ imports
    # nothing from jobs/), re-exported on first use: importing jobs.errors (every CLI command,
    # `batchgen --version` included) imports no engine
    if name in ("shown", "shown_key", "MAX_SHOWN_CHARS"):
        from engine import params

        return getattr(params, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class JobError(Exception):
    exit_code = 1


class SpecError(JobError):
    """Invalid job config: unknown key, bad value, bad --set override."""
    exit_code = 2


class InputError(JobError):
    """Input files that cannot be read or do not fit the config (missing column, wrong type...)."""
    exit_code = 2


class OutputError(JobError):
    """Output path not writable, or holding another job's output (fingerprint mismatch)."""
    exit_code = 2


class JobFailed(JobError):
    """The job ran and could not finish: a unit failed too many times."""
    exit_code = 1
