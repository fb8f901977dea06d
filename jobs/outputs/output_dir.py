"""The output directory: its manifest, success marker and status, from the directory alone.

    out = OutputDir("out/demo")        # a local directory or a URI (s3://bucket/run?...)
    out.prepare(plan, spec)            # "new", "resume" or "overwrite"; refuses another job's output
    out.committed_units(); out.status(); out.verify()

The names in the directory are jobs/outputs/layout.py's; unit files are committed by
jobs/outputs/commit.py (whole or not at all, first commit wins), and hold
jobs/outputs/schema.py's columns and metadata. `status` reads footers in parallel (the
counts in their metadata); `verify` (jobs/outputs/verify.py) checks every file against the
manifest in bounded memory.

Errors: OutputError (exit code 2) when the directory cannot be created or written, or holds
another job's output (the message names the keys whose values differ) or unrelated files.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs import uri
from jobs.errors import OutputError
from jobs.outputs.commit import canonical_output, conditional_writes, join, put_whole, replace_whole, resolve_output
from jobs.outputs.layout import (CACHE_FILE, LEASE, LEFTOVER_RE, MANIFEST, PART_RE, PROBE_PREFIX, SUCCESS, part_index,
                                  part_name)
from jobs.outputs.schema import COUNT_KEYS, batchgen_version, output_schema, type_str
from jobs.outputs.verify import READ_THREADS, OutputChecks, is_count, part_counts

log = logging.getLogger("batchgen")
PARQUET_MAGIC = b"PAR1"
CHECK_CHUNK = 256  # part files per task when their tails are checked (committed_units)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


UNIT_KEYS = ("index", "row_start", "row_end", "expected_rows")
AUTO_DTYPES = ("float32", "bfloat16", "float16")  # what model.dtype "auto" can resolve to
KERNELS = ("compiled", "torch")  # which CPU kernels an output's rows were computed with


def manifest_problem(m: dict[str, Any]) -> str | None:
    """What is wrong with the values of a manifest that status, verify, plan and resume read
    (None if nothing): a hand-edited or half-written manifest is named, key and unit entry,
    in an OutputError (exit code 2; verify reports it as its problem) rather than met as a
    KeyError or TypeError halfway through reading the parts."""
    if not isinstance(m["fingerprint"], str):
        return f"fingerprint must be a string, got {m['fingerprint']!r}"[:200]
    if not isinstance(m.get("fingerprint_data", {}), (dict, type(None))):
        return f"fingerprint_data must be an object, got {type(m['fingerprint_data']).__name__}"
    for key in ("num_samples", "num_prompts"):
        if m.get(key) is not None and not is_count(m[key]):
            return f"{key} must be a non-negative integer, got {m[key]!r}"[:200]
    schema = m.get("output_schema", [])
    if not isinstance(schema, list) or not all(isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
                                               for f in schema):
        return "output_schema must be a list of [column, type] pairs of strings"
    for key, allowed in (("auto_dtype", AUTO_DTYPES), ("kernels", KERNELS)):
        if m.get(key) is not None and m[key] not in allowed:
            return f"{key} must be one of {', '.join(allowed)}, got {m[key]!r}"[:200]
    if not isinstance(m.get("checkpoint_sha256", {}), (dict, type(None))):
        return f"checkpoint_sha256 must be an object, got {type(m['checkpoint_sha256']).__name__}"
    units = m["units"]
    if not isinstance(units, list):
        return f"units must be a list, got {type(units).__name__}"
    seen: set[int] = set()
    for i, u in enumerate(units):
        if not isinstance(u, dict):
            return f"units[{i}] must be an object with {', '.join(UNIT_KEYS)}, got {u!r}"[:200]
        for key in UNIT_KEYS:
            if key not in u:
                return f"units[{i}] has no {key}"
            if not is_count(u[key]):
                return f"units[{i}] {key} must be a non-negative integer, got {u[key]!r}"[:200]
        if u["row_end"] < u["row_start"]:
            return f"units[{i}] row_end {u['row_end']} is before its row_start {u['row_start']}"
        if u["index"] in seen:
            return f"units[{i}] index {u['index']} is also the index of an earlier unit"
        seen.add(u["index"])
    return None


def weights_problem(m: dict[str, Any], plan: Any) -> str | None:
    """Why an output whose manifest is `m` must not be resumed by `plan` though their
    fingerprints agree (None if nothing): its rows came from other weights. Only for jobs
    whose fingerprint leaves the checkpoint's content hashes out (openai_batch: the manifest
    keeps them, JobPlan.checkpoint_sha256), so that existing outputs still resume; an output
    written before the manifest kept them is not checked."""
    from jobs.plan.fingerprint import changed_files

    old = m.get("checkpoint_sha256")
    if plan.checkpoint_sha256 is None or not isinstance(old, dict) or old == plan.checkpoint_sha256:
        return None
    changed = changed_files(old, plan.checkpoint_sha256)
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return (f"its rows were generated with other weights: the content of {shown or 'the checkpoint'} changed "
            f"since (SHA-256 in {MANIFEST} checkpoint_sha256)")


def _redacted(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec dump (JobSpec.to_dict) with the credentials of its input and output URIs
    left out (jobs/uri.py redact), as the manifest keeps it."""
    out = dict(spec)
    for section in ("input", "output"):
        if isinstance(out.get(section), dict) and isinstance(out[section].get("path"), str):
            out[section] = {**out[section], "path": uri.redact(out[section]["path"])}
    return out


def describe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable "key: old -> new" lines between two fingerprint dicts."""
    lines = []
    fo, fn = _flatten(old), _flatten(new)
    for key in sorted(set(fo) | set(fn)):
        if key == "input.files":
            continue
        if key == "version" and fo.get(key) != fn.get(key):
            lines.append(f"the output was written by another batchgen release, whose rows differ (output layout "
                         f"version {fo.get(key, '<absent>')} -> {fn.get(key)}): it cannot be resumed")
        elif fo.get(key, "<absent>") != fn.get(key, "<absent>"):
            lines.append(f"{key}: {fo.get(key, '<absent>')!r} -> {fn.get(key, '<absent>')!r}")
    of = {f[0]: f[1:] for f in fo.get("input.files", []) or []}
    nf = {f[0]: f[1:] for f in fn.get("input.files", []) or []}
    for name in sorted(set(of) | set(nf)):
        if name not in nf:
            lines.append(f"input file {name}: removed")
        elif name not in of:
            lines.append(f"input file {name}: added")
        elif of[name][:2] != nf[name][:2]:
            lines.append(f"input file {name}: {of[name][0]} bytes/{of[name][1]} rows -> "
                         f"{nf[name][0]} bytes/{nf[name][1]} rows")
        elif of[name] != nf[name]:
            old_c, new_c = (of[name][2:] or [None])[0], (nf[name][2:] or [None])[0]
            what = [k for k in sorted(set(old_c or {}) | set(new_c or {}))
                    if (old_c or {}).get(k) != (new_c or {}).get(k)] if isinstance(old_c, dict) else ["content"]
            lines.append(f"input file {name}: changed since the output was written, with the same size and "
                         f"rows ({', '.join(what) or 'content'} differ): restore it, or write to another "
                         f"output.path")
    return lines



class OutputDir(OutputChecks):
    """A job's output directory (local path or URI); `verify` comes from OutputChecks."""

    def __init__(self, path: str):
        self.path = canonical_output(str(path))
        self.shown = uri.redact(self.path)  # for messages: no credentials
        self.fs, self.base = resolve_output(str(path))
        # temporary files this object is writing now (_write_atomic: the lease's heartbeats run
        # in a thread while the driver cleans up leftovers): never taken for leftovers
        self._writing: set[str] = set()
        self._writing_lock = threading.Lock()

    # ------------------------------------------------------------ helpers
    def _p(self, name: str) -> str:
        return join(self.base, name)

    def fs_path(self, name: str) -> str:
        """The path of `name` (relative to the directory) inside `self.fs`."""
        return self._p(name)

    def _exists(self, name: str) -> bool:
        return self.fs.get_file_info(self._p(name)).type != pafs.FileType.NotFound

    def _read_text(self, name: str) -> str:
        with self.fs.open_input_stream(self._p(name)) as f:
            return f.read().decode("utf-8")

    def _write_atomic(self, name: str, text: str) -> None:
        """Replace `name` whole: a temporary file and a rename locally, one PUT on a store."""
        tmp = f".tmp-{uuid.uuid4().hex}"
        rel = f"{name.rsplit('/', 1)[0]}/{tmp}" if "/" in name else tmp
        with self._writing_lock:  # registered before the file exists, dropped once it is renamed
            self._writing.add(rel)
        try:
            replace_whole(self.fs, self._p(name), text.encode("utf-8"), tmp_name=tmp)
        finally:
            with self._writing_lock:
                self._writing.discard(rel)

    def _in_flight(self, rel: str) -> bool:
        with self._writing_lock:
            return rel in self._writing

    def read_text(self, name: str) -> str | None:
        """The text of `name` (relative to the directory), or None if it does not exist."""
        try:
            return self._read_text(name)
        except FileNotFoundError:
            return None
        except OSError:
            if not self._exists(name):
                return None
            raise

    def write_text(self, name: str, text: str) -> None:
        """Write `name` whole (see _write_atomic)."""
        self._write_atomic(name, text)

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self._p(name))
        except FileNotFoundError:
            pass

    def _entries(self) -> list[tuple[str, pafs.FileInfo]]:
        """(path relative to the directory, info) of every file below it; [] if it does not exist."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.base, recursive=True, allow_not_found=True))
        except (OSError, pa.ArrowException):
            return []
        return sorted(((i.path[len(self.base):].lstrip("/"), i) for i in infos if i.type == pafs.FileType.File),
                      key=lambda t: t[0])

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest dict, or None if there is none. Raises OutputError if it is unreadable."""
        if not self._exists(MANIFEST):
            return None
        try:
            data = json.loads(self._read_text(MANIFEST))
        except (OSError, ValueError) as e:
            raise OutputError(f"{self.shown}: {MANIFEST} is unreadable: {e}") from None
        if not isinstance(data, dict) or "fingerprint" not in data or "units" not in data:
            raise OutputError(f"{self.shown}: {MANIFEST} is not a batchgen manifest (no fingerprint/units)")
        why = manifest_problem(data)
        if why is not None:
            raise OutputError(f"{self.shown}: {MANIFEST} is damaged: {why}")
        return data

    def has_manifest(self) -> bool:
        """Whether a manifest file exists (readable or not)."""
        return self._exists(MANIFEST)

    def manifest_or_none(self) -> dict[str, Any] | None:
        """The manifest dict, or None if there is none or it is unreadable (`prepare` says
        why when it matters)."""
        try:
            return self.read_manifest()
        except OutputError:
            return None

    def _remove_batchgen_files(self) -> None:
        keep = (LEASE, CACHE_FILE)  # this driver's lease; hashes keyed by file
        for rel, _ in self._entries():
            if rel in keep or self._in_flight(rel):  # (a heartbeat being written)
                continue
            if rel.startswith("_batchgen/") or rel == SUCCESS or PART_RE.match(rel) or LEFTOVER_RE.match(rel):
                try:
                    self.fs.delete_file(self._p(rel))
                except FileNotFoundError:  # a temporary file renamed or removed meanwhile
                    pass

    # ------------------------------------------------------------ lifecycle
    def check_can_be_directory(self) -> None:
        """Raise OutputError (exit code 2) when output.path is a file, or (locally) below one,
        so it cannot be the output directory. Reads only: `batchgen plan` makes this check of
        ensure_writable without creating anything."""
        try:
            info = self.fs.get_file_info(self.base)
        except (OSError, pa.ArrowException):
            return  # ensure_writable says why when it tries to create the directory
        if info.type == pafs.FileType.File:
            raise OutputError(f"output.path {self.shown}: is a file, expected a directory")
        if info.type != pafs.FileType.NotFound or not uri.is_local(self.fs):
            return  # an object store has no directories: a key "above" does not block it
        parent = self.base.rstrip("/").rsplit("/", 1)[0]
        while parent:
            try:
                kind = self.fs.get_file_info(parent).type
            except (OSError, pa.ArrowException):
                return
            if kind == pafs.FileType.File:
                raise OutputError(f"output.path {self.shown}: cannot create directory: {parent} is a file")
            if kind != pafs.FileType.NotFound:
                return
            parent = parent.rsplit("/", 1)[0]

    def check_no_unrelated_files(self) -> None:
        """For a directory without a manifest: raise OutputError (exit code 2) when it holds
        files that are not batchgen's (any but an output lease, the checkpoint hash cache and
        batchgen's temporary files and probes, which a crash may leave: layout.LEFTOVER_RE),
        which `run` refuses to write beside without --overwrite. Reads only (`batchgen plan`)."""
        entries = self._unrelated_entries()
        if entries:
            raise self._unrelated_error(entries)

    def _unrelated_entries(self) -> list[str]:
        return [rel for rel, _ in self._entries() if rel not in (LEASE, CACHE_FILE) and not LEFTOVER_RE.match(rel)]

    def _unrelated_error(self, entries: list[str]) -> OutputError:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        return OutputError(f"output.path {self.shown} is not empty and has no batchgen manifest "
                           f"({len(entries)} files: {shown}); use an empty directory or --overwrite")

    def ensure_writable(self) -> None:
        """Create the directory and check that it takes a file (writes and removes a probe);
        on an object store, learn whether it takes conditional writes (a warning if not:
        jobs/outputs/commit.py). Raises OutputError (exit code 2) naming the path and the reason,
        also when the store fails to answer that probe."""
        shown = uri.redact(self.path)
        self.check_can_be_directory()  # the reason in words, before create_dir's errno
        try:
            self.fs.create_dir(self.base, recursive=True)
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {shown}: cannot create directory: {e}") from None
        info = self.fs.get_file_info(self.base)
        if info.type == pafs.FileType.File:
            raise OutputError(f"output.path {shown}: is a file, expected a directory")
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            put_whole(self.fs, self._p(probe), b"probe")
            try:
                self.fs.delete_file(self._p(probe))
            except FileNotFoundError:
                pass  # written, which is what this checks; a driver holding the lease removed it
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {shown}: directory is not writable: {e}") from None
        if not uri.is_local(self.fs):
            try:
                conditional_writes(self.fs, self._p(probe))
            except OSError as e:  # the store failed to answer (commits would ask again)
                raise OutputError(f"output.path {shown}: {e}") from None

    def prepare(self, plan: Any, spec: Any, overwrite: bool = False) -> str:
        """Make the directory ready for `plan`; returns "new", "resume" or "overwrite".

        Creates the directory and checks that it is writable (writes and removes a probe
        file). With a manifest of the same fingerprint the job resumes (committed units are
        kept, orphan temporary files removed). Raises OutputError (exit code 2) when the
        directory cannot be created or written, when it holds another job's output
        (different fingerprint; the message lists which keys differ) or files that are not
        batchgen's and no manifest — unless `overwrite`, which removes the previous part
        files, temporary files, manifest and success marker (other files are left alone).
        """
        self.ensure_writable()
        mode = "new"
        try:
            old = self.read_manifest()
        except OutputError as e:
            if not overwrite:
                raise OutputError(f"{e}; pass --overwrite to start over (this deletes the previous output)") from None
            old = {"fingerprint": None}
        if old is not None:
            same = old["fingerprint"] == plan.fingerprint
            why = weights_problem(old, plan) if same else None
            if same and why is None:
                if plan.checkpoint_sha256 is not None and old.get("checkpoint_sha256") is None:
                    # an output from before the manifest kept them: later resumes are checked
                    self._write_atomic(MANIFEST, json.dumps({**old, "checkpoint_sha256": plan.checkpoint_sha256},
                                                            indent=1, sort_keys=True))
                self.cleanup_temp_files()
                return "resume"
            if why is not None and not overwrite:
                raise OutputError(f"output.path {self.shown}: {why}. Use another output.path, or --overwrite "
                                  f"to delete the previous output")
            if not overwrite:
                diffs = describe_differences(old.get("fingerprint_data") or {}, plan.fingerprint_data)
                detail = "; ".join(diffs[:20]) if diffs else "(no stored fingerprint data to compare)"
                raise OutputError(
                    f"output.path {self.shown} holds another job's output (fingerprint {str(old['fingerprint'])[:12]} "
                    f"!= this job's {plan.fingerprint[:12]}); differences: {detail}. Use another output.path, or "
                    f"--overwrite to delete the previous output")
            self._remove_batchgen_files()
            mode = "overwrite"
        elif entries := self._unrelated_entries():
            if not overwrite:
                raise self._unrelated_error(entries)  # as check_no_unrelated_files (`batchgen plan`)
            self._remove_batchgen_files()
            mode = "overwrite"
        self._write_atomic(MANIFEST, json.dumps(self._manifest(plan, spec), indent=1, sort_keys=True))
        return mode

    def recorded(self) -> dict[str, str | None]:
        """What this output's rows are bound to, from one read of its manifest: `auto_dtype`,
        what model.dtype "auto" resolved to (record_auto_dtype), and `kernels`, the CPU
        kernels they are computed with (record_kernels); each None where not recorded (a
        dtype set explicitly, a GPU job, no worker ready yet, an output written before batchgen
        recorded it and not resumed since). Raises OutputError as read_manifest."""
        m = self.read_manifest() or {}
        return {"auto_dtype": m.get("auto_dtype"), "kernels": m.get("kernels")}

    def record_auto_dtype(self, dtype: str) -> None:
        """Record in the manifest that this output's rows are computed in `dtype` (what
        model.dtype "auto" resolved to), so that a resume on another kind of machine runs in
        it too instead of mixing dtypes in one output (the fingerprint holds "auto"). Call
        under the output lease, before the first unit of the run starts. Raises OutputError
        when there is no manifest, or it already records another dtype."""
        self._record("auto_dtype", dtype, "this run's workers resolved model.dtype auto to")

    def record_kernels(self, kernels: str) -> None:
        """Record in the manifest that this output's rows are computed with `kernels`
        ("compiled" or "torch"), so that a resume refuses workers of the other kind
        (cluster/health.py refuse_kernels): their rows differ in the last bits. As
        record_auto_dtype."""
        self._record("kernels", kernels, "this run's workers compute with the kernels")

    def _record(self, key: str, value: str, what: str) -> None:
        m = self.read_manifest()
        if m is None:
            raise OutputError(f"{self.shown}: no {MANIFEST} to record {key} {value} in")
        if m.get(key) == value:
            return
        if m.get(key) is not None:
            raise OutputError(f"{self.shown}: its rows are computed with {key} {m[key]} ({MANIFEST}), but {what} "
                              f"{value}")
        m[key] = value
        self._write_atomic(MANIFEST, json.dumps(m, indent=1, sort_keys=True))

    def _manifest(self, plan: Any, spec: Any) -> dict[str, Any]:
        n = spec.sampling.num_samples
        names = {f.path: f.name for f in plan.files}
        return {
            "batchgen_version": batchgen_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "fingerprint": plan.fingerprint,
            "fingerprint_data": plan.fingerprint_data,
            "spec": _redacted(spec.to_dict()),
            "spec_source": getattr(spec, "source", None),
            "num_samples": n,
            "num_prompts": plan.num_prompts,
            "input_root": uri.redact(plan.root),
            "files": [{"path": uri.redact(f.path), "name": f.name, "size": f.size, "num_rows": f.num_rows,
                       "row_groups": len(f.row_groups), "staged": f.staged} for f in plan.files],
            "output_schema": [[fld.name, type_str(fld.type)]
                              for fld in output_schema(plan.passthrough_fields, spec.top_logprobs_columns())],
            "units": [{"index": u.index, "file": names.get(u.source, u.source), "row_start": u.row_start,
                       "row_end": u.row_end, "expected_rows": plan.unit_rows(u, n)} for u in plan.units],
            **({} if plan.checkpoint_sha256 is None else {"checkpoint_sha256": plan.checkpoint_sha256}),
        }

    def committed_units(self, remove_damaged: bool = False) -> set[int]:
        """Indices of the units whose part file is committed: present and, on a local
        filesystem, not damaged (see damaged_parts). remove_damaged: also remove the damaged
        parts, each logged by name, so that their units run again (a unit's rows are a
        function of the job; its commit, a link, could never replace the damaged file). Only
        under the output lease: a commit makes a part visible once it is whole, so a damaged
        part is never one still being written."""
        committed, damaged = self.check_parts()
        for rel, why in damaged if remove_damaged else []:
            log.warning("%s: part file %s is damaged, %s: removing it; its unit runs again", self.shown, rel, why)
            try:
                self.fs.delete_file(self._p(rel))
            except FileNotFoundError:
                pass
        return committed

    def damaged_parts(self) -> list[tuple[str, str]]:
        """(relative name, what is wrong) of the part files that cannot be Parquet files: on a
        local filesystem, empty or not ending in a Parquet footer (its length and magic
        bytes), as a power loss can leave a part linked before its data reached the disk
        (commit.py fsyncs it first; not every filesystem honours that). On an object store a
        part is one PUT, whole or absent: only an empty one is listed."""
        return self.check_parts()[1]

    def check_parts(self) -> tuple[set[int], list[tuple[str, str]]]:
        """(committed unit indices, damaged parts as damaged_parts lists them), from one look
        at the parts. The sizes come with the listing; locally each part's last 8 bytes are
        read too, never its footer: 40,000 parts take under a second, listing included (status, reading footers: 16 s), read in threads over
        chunks of files, which hide a network filesystem's latency without a task per file."""
        parts = [(rel, idx, info.size) for rel, info in self._entries() if (idx := part_index(rel)) is not None]
        local = uri.is_local(self.fs)

        def damage(part: tuple[str, int, int | None]) -> str | None:
            """What is wrong with a part; None for a committed one, "" for one gone meanwhile."""
            rel, _, size = part
            if size == 0:
                return "empty file (0 bytes)"
            if not local:
                return None  # one PUT: whole or absent
            try:
                fd = os.open(self._p(rel), os.O_RDONLY)
            except FileNotFoundError:
                return ""
            except OSError:
                return None  # never judged (nor removed) on a failed read: status and verify report it
            try:
                size = os.fstat(fd).st_size
                if size < 12:
                    return f"{size} bytes, too small for a Parquet file" if size else "empty file (0 bytes)"
                tail = os.pread(fd, 8, size - 8)
            except OSError:
                return None
            finally:
                os.close(fd)
            footer_len = int.from_bytes(tail[:4], "little")
            if tail[4:] != PARQUET_MAGIC or footer_len + 12 > size:
                return f"no Parquet footer at its end ({size} bytes: cut short, or its data never reached the disk)"
            return None

        chunks = [parts[i:i + CHECK_CHUNK] for i in range(0, len(parts), CHECK_CHUNK)]
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(chunks)))) as ex:
            verdicts = [v for chunk in ex.map(lambda c: [damage(p) for p in c], chunks) for v in chunk]
        committed = {idx for (_, idx, _), why in zip(parts, verdicts) if why is None}
        return committed, [(rel, why) for (rel, _, _), why in zip(parts, verdicts) if why]

    def temp_files(self) -> list[str]:
        """Relative paths of leftover temporary files and probes (interrupted writes:
        layout.LEFTOVER_RE), less those this object is writing now."""
        return [rel for rel, _ in self._entries() if LEFTOVER_RE.match(rel) and not self._in_flight(rel)]

    def cleanup_temp_files(self) -> int:
        """Remove leftover temporary files and probes; returns how many.

        Call only under the output lease while no worker of this job writes (before its units
        start, after they end). Nothing else writes them then: this driver's heartbeats are
        skipped (_writing); another driver writes only a probe and, on S3, a conditional-write
        probe before it meets the lease and is refused, and both survive losing it (its probe
        counts as written; the conditional one is retried under a new name); and another
        driver creating the lease as this one took it is refused either way (its link finds
        the lease, or fails for lack of its temporary file)."""
        n = 0
        for rel in self.temp_files():
            try:
                self.fs.delete_file(self._p(rel))
                n += 1
            except (OSError, pa.ArrowException):
                pass
        return n

    def mark_success(self, summary: dict[str, Any]) -> None:
        """Write the _SUCCESS marker holding `summary` as JSON (atomically)."""
        self._write_atomic(SUCCESS, json.dumps(summary, indent=1, sort_keys=True, default=str))

    def clear_success(self) -> None:
        """Remove a _SUCCESS marker if present."""
        if self._exists(SUCCESS):
            self.fs.delete_file(self._p(SUCCESS))

    # ------------------------------------------------------------ inspection
    def read_part(self, index: int, columns: list[str] | None = None) -> pa.Table:
        """Unit `index`'s committed part file (only `columns`, default all). Raises
        FileNotFoundError when the unit is not committed."""
        with self.fs.open_input_file(self._p(part_name(index))) as f:
            return pq.read_table(f, columns=columns)

    def _parts(self, total: int) -> list[tuple[str, int]]:
        """(relative name, unit index) of the part files of units < total (by their canonical
        names: layout.part_index)."""
        out = []
        for rel, _ in self._entries():
            idx = part_index(rel)
            if idx is not None and idx < total:
                out.append((rel, idx))
        return out

    def _part_metadata(self, rel: str) -> pq.FileMetaData:
        with self.fs.open_input_file(self._p(rel)) as f:
            return pq.ParquetFile(f).metadata

    def status(self) -> dict[str, Any]:
        """Progress computed from the directory alone (manifest + Parquet footers, read in
        parallel).

        Keys: path, fingerprint, units_done, units_total, prompts_total, rows, rows_expected,
        prompts, generated_tokens, prompt_tokens, error_rows, tool_calls, tool_errors,
        input_rows_decoded (input rows the committed units decoded), temp_files,
        unreadable_units, lease (the lease JSON or None), success, summary (the _SUCCESS
        JSON or None). Raises OutputError if the directory has no (readable) manifest.
        """
        try:
            m = self.read_manifest()
        except OSError as e:  # a store that does not answer (exit code 2, not a traceback)
            raise OutputError(f"{self.shown}: cannot read the output: {e}") from None
        if m is None:
            raise OutputError(f"{self.shown}: not a batchgen output directory (no {MANIFEST})")
        total = len(m["units"])
        counts = {k: 0 for k in COUNT_KEYS}
        done, unreadable = 0, []

        def footer(rel: str) -> tuple[str, Any]:
            # reduced to its counts here, in the thread: 40,000 FileMetaData objects waiting
            # for the main thread would take most of a gigabyte
            try:
                md = self._part_metadata(rel)
            except (OSError, pa.ArrowException) as e:
                return rel, e
            try:  # a part rewritten by another tool: named as unreadable (verify reports it), never a traceback
                c = part_counts(md.metadata)
            except ValueError as e:
                return rel, e
            return rel, {**{k: c.get(k, 0) for k in COUNT_KEYS}, "rows": md.num_rows}

        parts = [rel for rel, _ in self._parts(total)]
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(parts)))) as ex:
            for rel, c in ex.map(footer, parts):
                if isinstance(c, BaseException):
                    unreadable.append(f"{rel}: {c}")
                    continue
                done += 1
                for k in COUNT_KEYS:
                    counts[k] += c[k]
        summary = None
        if self._exists(SUCCESS):
            try:
                summary = json.loads(self._read_text(SUCCESS))
            except (OSError, ValueError):
                summary = {"unreadable": True}
        lease = None
        try:
            text = self.read_text(LEASE)
            lease = json.loads(text) if text else None
        except (OSError, ValueError):
            lease = {"unreadable": True}
        return {"path": uri.redact(self.path), "fingerprint": m["fingerprint"], "units_done": done,
                "units_total": total, "prompts_total": m.get("num_prompts"),
                "rows_expected": sum(u["expected_rows"] for u in m["units"]),
                **counts, "temp_files": len(self.temp_files()), "unreadable_units": unreadable,
                "lease": lease, "success": summary is not None, "summary": summary}
