"""The output directory: unit files, manifest, success marker, status and verify.

Layout of `output.path` (a local directory or a pyarrow.fs URI such as s3://bucket/run,
with filesystem options after `?`, see jobs/uri.py):

    part-000000.parquet          one file per committed unit, OUTPUT_SCHEMA + passthrough columns
    .tmp-part-000000-<uuid>.parquet   a unit being written (local filesystems only)
    _batchgen/manifest.json      the job: fingerprint, spec, input files, units, expected rows
    _batchgen/lease.json         the driver running the job (jobs/outputs/lease.py)
    _batchgen/checkpoint-sha256.json  cached checkpoint hashes (jobs/plan/fingerprint.py)
    _batchgen/staged/            re-chunked copies of input files (jobs/inputs/staging.py)
    _SUCCESS                     JSON summary, written once every unit is committed

Commits: a reader sees a unit file whole or not at all, and the first copy of a unit to
commit wins (a unit may run twice: retries, deadlines):
- local filesystem: written to a temporary name in the same directory, then hard-linked to
  part-NNNNNN.parquet, which fails if it exists (then the temporary file is dropped); where
  hard links are not supported, renamed unless the part file exists;
- object store: the whole file is serialised in memory, then written with one PUT of the
  final object, which S3 makes visible whole or not at all; skipped if the object exists.
  (Two copies finishing within the same moment may both PUT: the later one replaces the
  earlier, whole, with the same rows.)
Every part file carries the job fingerprint and its unit's index and row range in its
Parquet key-value metadata (keys "batchgen.*").

`status` and `verify` read footers in parallel and keep memory bounded: `verify` of a
40,000-file output holds one 64-bit key per prompt (jobs/ids.py), not every row.

Errors: OutputError (exit code 2) when the directory cannot be created or written, or holds
another job's output (the message names the keys whose values differ) or unrelated files.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs import uri
from jobs.errors import OutputError

TOOL_CALL_TYPE = pa.struct([
    pa.field("start", pa.int32()), pa.field("end", pa.int32()), pa.field("expr", pa.string()),
    pa.field("output", pa.string()), pa.field("error", pa.string()),
])

OUTPUT_SCHEMA = pa.schema([
    pa.field("prompt_id", pa.string()),
    pa.field("sample_index", pa.int32()),
    pa.field("prompt_tokens", pa.list_(pa.int32())),
    pa.field("tokens", pa.list_(pa.int32())),
    pa.field("mask", pa.list_(pa.int8())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("stop_reason", pa.string()),
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("error", pa.string()),
])
"""Columns of every output row (one row per sample); passthrough columns follow them."""

MANIFEST = "_batchgen/manifest.json"
LEASE = "_batchgen/lease.json"
SUCCESS = "_SUCCESS"
READ_THREADS = 16
META_FINGERPRINT = b"batchgen.fingerprint"
META_UNIT = b"batchgen.unit"
META_COUNTS = b"batchgen.counts"
META_VERSION = b"batchgen.version"
PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-part-(\d{6,})-[0-9a-f]+\.parquet$")
COUNT_KEYS = ("prompts", "rows", "generated_tokens", "prompt_tokens", "tool_calls", "tool_errors", "error_rows",
              "input_rows_decoded")


def batchgen_version() -> str:
    try:
        from importlib.metadata import version

        return version("batchgen")
    except Exception:  # not installed (running from a checkout)
        return "0.1.0"


def part_name(index: int) -> str:
    """File name of unit `index`'s committed output."""
    return f"part-{index:06d}.parquet"


def output_schema(passthrough_fields: list[pa.Field] = ()) -> pa.Schema:
    """OUTPUT_SCHEMA followed by the passthrough columns (with their input types)."""
    return pa.schema(list(OUTPUT_SCHEMA) + list(passthrough_fields))


def resolve_output(path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for an output path; relative local paths resolve against
    the current working directory. Raises OutputError for a URI pyarrow cannot open."""
    try:
        return uri.filesystem_for(path)
    except (pa.ArrowException, ValueError, OSError) as e:
        raise OutputError(f"output.path {uri.redact(path)}: cannot open this URI: {e}") from None


def canonical_output(path: str) -> str:
    """The output path as workers should use it: absolute local path or the URI itself."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if base else name


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def put_whole(fs: pafs.FileSystem, path: str, data: bytes | pa.Buffer) -> None:
    """Write `data` as one object on an object store (one PUT on close: visible whole or not
    at all). Never inside `with`: closing a stream after a failed write would complete the
    upload with what was written so far."""
    f = fs.open_output_stream(path)
    f.write(data)
    f.close()


def commit_file(fs: pafs.FileSystem, final: str, data: pa.Buffer | bytes, tmp_prefix: str) -> bool:
    """Make `final` hold `data` unless it exists already (first commit wins); returns whether
    this call committed it. See the module docstring for how, per filesystem. Raises
    OSError / pyarrow errors if the write fails (a local temporary file is removed)."""
    if not uri.is_local(fs):
        if _exists(fs, final):
            return False
        put_whole(fs, final, data)
        return True
    parent = final.rsplit("/", 1)[0]
    tmp = _join(parent, f"{tmp_prefix}-{uuid.uuid4().hex}.parquet")
    try:
        with open(tmp, "wb") as f:
            f.write(memoryview(data))
        try:
            os.link(tmp, final)
            committed = True
        except FileExistsError:
            committed = False
        except OSError:  # no hard links here (some network filesystems): rename, unless it exists
            committed = not os.path.exists(final)
            if committed:
                os.replace(tmp, final)
        return committed
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def write_part(output_path: str, index: int, table: pa.Table) -> str:
    """Commit one unit's table as part-<index>.parquet (see the module docstring: whole or
    not at all, first commit wins). A crash before the commit leaves at most a local
    temporary file, which readers ignore and OutputDir.cleanup_temp_files removes. Returns
    the committed file's path (local) or URI. Raises OSError / pyarrow errors if the write
    fails."""
    fs, base = resolve_output(output_path)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    commit_file(fs, _join(base, part_name(index)), sink.getvalue(), f".tmp-part-{index:06d}")
    return _join(base, part_name(index)) if uri.is_local(fs) else uri.join(output_path, part_name(index))


def type_str(t: pa.DataType) -> str:
    """An Arrow type as text, with list item names dropped ("item" in memory, "element"
    after a Parquet round trip) so written and expected schemas compare equal."""
    return re.sub(r"list<(item|element): ", "list<", str(t))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def describe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable "key: old -> new" lines between two fingerprint dicts."""
    lines = []
    fo, fn = _flatten(old), _flatten(new)
    for key in sorted(set(fo) | set(fn)):
        if key == "input.files":
            continue
        if fo.get(key, "<absent>") != fn.get(key, "<absent>"):
            lines.append(f"{key}: {fo.get(key, '<absent>')!r} -> {fn.get(key, '<absent>')!r}")
    of = {f[0]: f[1:] for f in fo.get("input.files", []) or []}
    nf = {f[0]: f[1:] for f in fn.get("input.files", []) or []}
    for name in sorted(set(of) | set(nf)):
        if name not in nf:
            lines.append(f"input file {name}: removed")
        elif name not in of:
            lines.append(f"input file {name}: added")
        elif of[name] != nf[name]:
            lines.append(f"input file {name}: {of[name][0]} bytes/{of[name][1]} rows -> "
                         f"{nf[name][0]} bytes/{nf[name][1]} rows")
    return lines


class OutputDir:
    """A job's output directory (local path or URI)."""

    def __init__(self, path: str):
        self.path = canonical_output(str(path))
        self.shown = uri.redact(self.path)  # for messages: no credentials
        self.fs, self.base = resolve_output(str(path))

    # ------------------------------------------------------------ helpers
    def _p(self, name: str) -> str:
        return _join(self.base, name)

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
        final = self._p(name)
        parent = final.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        if not uri.is_local(self.fs):
            put_whole(self.fs, final, text.encode("utf-8"))
            return
        tmp = _join(parent, f".tmp-{uuid.uuid4().hex}")
        with self.fs.open_output_stream(tmp) as f:
            f.write(text.encode("utf-8"))
        os.replace(tmp, final)

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
        return data

    def _remove_batchgen_files(self) -> None:
        keep = (LEASE, "_batchgen/checkpoint-sha256.json")  # this driver's lease; hashes keyed by file
        for rel, _ in self._entries():
            name = rel.split("/")[-1]
            if rel in keep:
                continue
            if rel.startswith("_batchgen/") or rel == SUCCESS or PART_RE.match(rel) or TMP_RE.match(rel) \
                    or (name.startswith(".tmp-") and "/" not in rel):
                self.fs.delete_file(self._p(rel))

    # ------------------------------------------------------------ lifecycle
    def ensure_writable(self) -> None:
        """Create the directory and check that it takes a file (writes and removes a probe).
        Raises OutputError (exit code 2) naming the path and the reason."""
        shown = uri.redact(self.path)
        try:
            self.fs.create_dir(self.base, recursive=True)
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {shown}: cannot create directory: {e}") from None
        info = self.fs.get_file_info(self.base)
        if info.type == pafs.FileType.File:
            raise OutputError(f"output.path {shown}: is a file, expected a directory")
        probe = f".batchgen-probe-{uuid.uuid4().hex}"
        try:
            put_whole(self.fs, self._p(probe), b"probe")
            self.fs.delete_file(self._p(probe))
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {shown}: directory is not writable: {e}") from None

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
        except OutputError:
            if not overwrite:
                raise OutputError(f"output.path {self.shown}: {MANIFEST} is unreadable; pass --overwrite to start "
                                  f"over (this deletes the previous output)") from None
            old = {"fingerprint": None}
        if old is not None:
            if old["fingerprint"] == plan.fingerprint:
                self.cleanup_temp_files()
                return "resume"
            if not overwrite:
                diffs = describe_differences(old.get("fingerprint_data") or {}, plan.fingerprint_data)
                detail = "; ".join(diffs[:20]) if diffs else "(no stored fingerprint data to compare)"
                raise OutputError(
                    f"output.path {self.shown} holds another job's output (fingerprint {str(old['fingerprint'])[:12]} "
                    f"!= this job's {plan.fingerprint[:12]}); differences: {detail}. Use another output.path, or "
                    f"--overwrite to delete the previous output")
            self._remove_batchgen_files()
            mode = "overwrite"
        else:
            entries = [rel for rel, _ in self._entries() if rel not in (LEASE, "_batchgen/checkpoint-sha256.json")]
            if entries:
                if not overwrite:
                    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                    raise OutputError(f"output.path {self.shown} is not empty and has no batchgen manifest "
                                      f"({len(entries)} files: {shown}); use an empty directory or --overwrite")
                self._remove_batchgen_files()
                mode = "overwrite"
        self._write_atomic(MANIFEST, json.dumps(self._manifest(plan, spec), indent=1, sort_keys=True))
        return mode

    def _manifest(self, plan: Any, spec: Any) -> dict[str, Any]:
        n = spec.sampling.num_samples
        names = {f.path: f.name for f in plan.files}
        return {
            "batchgen_version": batchgen_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "fingerprint": plan.fingerprint,
            "fingerprint_data": plan.fingerprint_data,
            "spec": spec.to_dict(),
            "spec_source": getattr(spec, "source", None),
            "num_samples": n,
            "num_prompts": plan.num_prompts,
            "input_root": uri.redact(plan.root),
            "files": [{"path": uri.redact(f.path), "name": f.name, "size": f.size, "num_rows": f.num_rows,
                       "row_groups": len(f.row_groups), "staged": f.staged} for f in plan.files],
            "output_schema": [[fld.name, type_str(fld.type)] for fld in output_schema(plan.passthrough_fields)],
            "units": [{"index": u.index, "file": names.get(u.source, u.source), "row_start": u.row_start,
                       "row_end": u.row_end, "expected_rows": plan.unit_rows(u, n)} for u in plan.units],
        }

    def committed_units(self) -> set[int]:
        """Indices of the units whose part file is present (committed)."""
        return {int(m.group(1)) for rel, _ in self._entries() if (m := PART_RE.match(rel))}

    def temp_files(self) -> list[str]:
        """Relative paths of leftover temporary files (interrupted writes)."""
        return [rel for rel, _ in self._entries() if "/" not in rel and rel.startswith(".tmp-")]

    def cleanup_temp_files(self) -> int:
        """Remove leftover temporary files; returns how many. Call only when no worker of this
        job is writing (at job start)."""
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
        """(relative name, unit index) of the part files of units < total."""
        out = []
        for rel, _ in self._entries():
            mm = PART_RE.match(rel)
            if mm and int(mm.group(1)) < total:
                out.append((rel, int(mm.group(1))))
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
        m = self.read_manifest()
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
            c = json.loads((md.metadata or {}).get(META_COUNTS, b"{}"))
            c["rows"] = md.num_rows
            return rel, {k: int(c.get(k, 0)) for k in COUNT_KEYS}

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

    def _check_part(self, rel: str, idx: int, m: dict, expected_schema: list) -> tuple[list[str], Any]:
        """Problems of one part file, and the 64-bit keys of its distinct prompt ids (None if
        unreadable) for the cross-file duplicate check."""
        problems: list[str] = []
        units = m["_units_by_index"]
        try:
            with self.fs.open_input_file(self._p(rel)) as f:
                pf = pq.ParquetFile(f)
                md = pf.metadata
                schema = pf.schema_arrow
                kv = schema.metadata or {}
                got = [[fld.name, type_str(fld.type)] for fld in schema]
                if expected_schema and got != expected_schema:
                    exp_s = ", ".join(f"{n}: {t}" for n, t in expected_schema)
                    got_s = ", ".join(f"{n}: {t}" for n, t in got)
                    problems.append(f"{rel}: schema mismatch: expected [{exp_s}], got [{got_s}]")
                fp = kv.get(META_FINGERPRINT, b"").decode()
                if fp != m["fingerprint"]:
                    problems.append(f"{rel}: fingerprint {fp[:12] or '<none>'} does not match the manifest's "
                                    f"{m['fingerprint'][:12]} (written by another job)")
                try:
                    meta_unit = json.loads(kv.get(META_UNIT, b"{}"))
                except ValueError:
                    meta_unit = {}
                if meta_unit.get("index") != idx:
                    problems.append(f"{rel}: unit metadata says index {meta_unit.get('index')!r}, expected {idx}")
                exp_rows = units[idx]["expected_rows"]
                if md.num_rows != exp_rows:
                    prompts = units[idx]["row_end"] - units[idx]["row_start"]
                    how = (f"{prompts} prompts x {m.get('num_samples')} samples"
                           if prompts * (m.get("num_samples") or 0) == exp_rows else
                           f"{prompts} prompts with per-request num_samples")
                    problems.append(f"{rel}: {md.num_rows} rows, expected {exp_rows} ({how})")
                if "prompt_id" not in schema.names or "sample_index" not in schema.names:
                    return problems, None
                t = pf.read(columns=["prompt_id", "sample_index"])
        except (OSError, pa.ArrowException) as e:
            return problems + [f"{rel}: unreadable Parquet file: {e}"], None
        # within the file: (prompt, sample_index) pairs must be distinct
        enc = t.column("prompt_id").combine_chunks().dictionary_encode()
        ids = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        si = t.column("sample_index").to_numpy().astype(np.int64)
        pairs = ids * (int(si.max(initial=0)) + 1) + si
        uniq, first, counts = np.unique(pairs, return_index=True, return_counts=True)
        for k in np.flatnonzero(counts > 1)[:20]:
            j = first[k]
            problems.append(f"{rel}: duplicate row prompt_id={enc.dictionary[ids[j]].as_py()!r} "
                            f"sample_index={int(si[j])} (twice in this file)")
        from jobs.ids import keys_of

        return problems, keys_of(enc.dictionary)

    def _prompt_ids(self, rel: str) -> pa.Array:
        """The distinct prompt ids of one part file."""
        with self.fs.open_input_file(self._p(rel)) as f:
            t = pq.ParquetFile(f).read(columns=["prompt_id"])
        return t.column(0).combine_chunks().dictionary_encode().dictionary

    def verify(self) -> list[str]:
        """Check the directory against its manifest; returns the problems found ([] if clean).

        Checks: manifest present and readable; every part file readable, with the manifest's
        schema, this job's fingerprint, its own unit index and the expected row count
        (unit rows x num_samples, or the per-request num_samples summed); no (prompt_id,
        sample_index) twice, within a file or across units (a prompt's samples all belong to
        one unit, so a prompt id in two files is a duplicate); no orphan temporary files; no
        unexpected files; no _SUCCESS while units are missing. Files are read in parallel;
        memory holds one 64-bit key per prompt.
        """
        try:
            m = self.read_manifest()
        except OutputError as e:
            return [str(e)]
        if m is None:
            return [f"{self.shown}: manifest {MANIFEST} is missing (not a batchgen output directory?)"]
        problems: list[str] = []
        units = {u["index"]: u for u in m["units"]}
        m["_units_by_index"] = units
        expected_schema = [[n, t] for n, t in m.get("output_schema", [])]
        parts: list[tuple[str, int]] = []
        for rel, _ in self._entries():
            if rel.startswith("_batchgen/") or rel == SUCCESS:
                continue
            if "/" not in rel and rel.startswith(".tmp-"):
                problems.append(f"{rel}: orphan temporary file (an interrupted write; resuming the job removes it)")
                continue
            mm = PART_RE.match(rel)
            if not mm or int(mm.group(1)) not in units:
                problems.append(f"{rel}: unexpected file (not a unit of this job)")
                continue
            parts.append((rel, int(mm.group(1))))
        committed = {idx for _, idx in parts}
        keys: list[Any] = [None] * len(parts)
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(parts)))) as ex:
            for i, (found, k) in enumerate(ex.map(lambda p: self._check_part(p[0], p[1], m, expected_schema), parts)):
                problems.extend(found)
                keys[i] = k
        problems.extend(self._cross_file_duplicates(parts, keys))
        missing = sorted(set(units) - committed)
        if self._exists(SUCCESS) and missing:
            problems.append(f"{SUCCESS} is present but {len(missing)} of {len(units)} units are missing "
                            f"(first: {part_name(missing[0])})")
        return problems

    def _cross_file_duplicates(self, parts: list[tuple[str, int]], keys: list[Any]) -> list[str]:
        """Prompt ids present in more than one part file: jobs.ids.find_duplicates over each
        file's distinct-id keys (8 bytes per prompt); only files holding a candidate are read
        again. The first 20 are described."""
        from jobs.ids import find_duplicates

        have = [i for i, k in enumerate(keys) if k is not None]
        dups = find_duplicates(len(have), lambda j: iter([self._prompt_ids(parts[have[j]][0])]), limit=21,
                               keys=[keys[i] for i in have])
        out = []
        for key, (fa, _), (fb, _) in dups[:20]:
            a, b = parts[have[fa]][0], parts[have[fb]][0]
            out.append(f"{b}: duplicate row prompt_id={key!r} sample_index={self._common_sample(a, b, key)} "
                       f"(also in {a})")
        if len(dups) > 20:
            out.append("more prompt ids are in several part files (first 20 listed)")
        return out

    def _common_sample(self, a: str, b: str, prompt_id: str) -> Any:
        """A sample_index of `prompt_id` present in both part files (for the message)."""
        import pyarrow.compute as pc

        def samples(rel: str) -> set:
            try:
                with self.fs.open_input_file(self._p(rel)) as f:
                    t = pq.ParquetFile(f).read(columns=["prompt_id", "sample_index"])
            except (OSError, pa.ArrowException):
                return set()
            return set(t.filter(pc.equal(t.column("prompt_id"), prompt_id)).column("sample_index").to_pylist())

        common = sorted(samples(a) & samples(b))
        return common[0] if common else "none (the prompt's samples are split across files)"
