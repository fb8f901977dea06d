"""The names in a job's output directory.

Layout of `output.path` (a local directory or a pyarrow.fs URI such as s3://bucket/run,
with filesystem options after `?`, see jobs/uri.py):

    part-000000.parquet          one file per committed unit, OUTPUT_SCHEMA + passthrough columns
                                 (jobs/outputs/schema.py), committed once (jobs/outputs/commit.py)
    .tmp-part-000000-<uuid>.parquet   a unit being written (local filesystems only)
    .batchgen-probe-<uuid>       the driver's writability probe (written and removed at once;
    .batchgen-probe-if-none-match-<uuid>   and on S3 the conditional-write probe, commit.py)
    _batchgen/manifest.json      the job: fingerprint, spec, input files, units, expected rows
    _batchgen/lease.json         the driver running the job (jobs/outputs/lease.py)
    _batchgen/checkpoint-sha256.json  cached checkpoint hashes (jobs/plan/fingerprint.py)
    _batchgen/staged/            re-chunked copies of input files (jobs/inputs/staging.py)
    _SUCCESS                     JSON summary, written once every unit is committed

A process killed at the wrong moment can leave a temporary file or a probe (LEFTOVER_RE):
the next `run` removes them under its lease (OutputDir.cleanup_temp_files), and they never
make a directory count as holding unrelated files.
"""
from __future__ import annotations

import re

MANIFEST = "_batchgen/manifest.json"
LEASE = "_batchgen/lease.json"
CACHE_FILE = "_batchgen/checkpoint-sha256.json"
SUCCESS = "_SUCCESS"
PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-part-(\d{6,})-[0-9a-f]+\.parquet$")
PROBE_PREFIX = ".batchgen-probe-"
# Every temporary file and probe batchgen writes in an output directory, by exact name (a
# user's file of another name is never taken for one, nor deleted):
LEFTOVER_RE = re.compile(
    r"^(?:"
    r"\.tmp-part-\d{6,}-[0-9a-f]+\.parquet"                         # a unit being committed (write_part)
    r"|(?:_batchgen/)?\.tmp-[0-9a-f]+"                               # _SUCCESS, the manifest, a lease
                                                                     # heartbeat, the hash cache replaced
    r"|_batchgen/\.tmp-lease-[0-9a-f]+\.json"                        # the lease being created (commit_file)
    r"|(?:_batchgen/)?\.batchgen-probe-(?:if-none-match-)?[0-9a-f]+"  # probes (ensure_writable, S3)
    r"|_batchgen/staged/\.tmp-staged-[^/]+\.parquet"                 # a staged input copy being written
    r")$")


def part_name(index: int) -> str:
    """File name of unit `index`'s committed output."""
    return f"part-{index:06d}.parquet"


def part_index(rel: str) -> int | None:
    """The unit index of a committed part's name, or None: only the name part_name gives the
    index counts (`part-0000001.parquet` matches PART_RE, yet readers globbing `part-*.parquet`
    would read it next to `part-000001.parquet`, so it is an unexpected file, not unit 1)."""
    mm = PART_RE.match(rel)
    return int(mm.group(1)) if mm and rel == part_name(int(mm.group(1))) else None
