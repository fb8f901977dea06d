"""The names in a job's output directory.

Layout of `output.path` (a local directory or a pyarrow.fs URI such as s3://bucket/run,
with filesystem options after `?`, see jobs/uri.py):

    part-000000.parquet          one file per committed unit, OUTPUT_SCHEMA + passthrough columns
                                 (jobs/outputs/schema.py), committed once (jobs/outputs/commit.py)
    .tmp-part-000000-<uuid>.parquet   a unit being written (local filesystems only)
    _batchgen/manifest.json      the job: fingerprint, spec, input files, units, expected rows
    _batchgen/lease.json         the driver running the job (jobs/outputs/lease.py)
    _batchgen/checkpoint-sha256.json  cached checkpoint hashes (jobs/plan/fingerprint.py)
    _batchgen/staged/            re-chunked copies of input files (jobs/inputs/staging.py)
    _SUCCESS                     JSON summary, written once every unit is committed
"""
from __future__ import annotations

import re

MANIFEST = "_batchgen/manifest.json"
LEASE = "_batchgen/lease.json"
CACHE_FILE = "_batchgen/checkpoint-sha256.json"
SUCCESS = "_SUCCESS"
PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-part-(\d{6,})-[0-9a-f]+\.parquet$")


def part_name(index: int) -> str:
    """File name of unit `index`'s committed output."""
    return f"part-{index:06d}.parquet"
