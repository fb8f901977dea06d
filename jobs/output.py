"""The output directory: unit files, manifest, success marker, status and verify.

Layout of `output.path` (a local directory or a pyarrow.fs URI such as s3://bucket/run):

    part-000000.parquet          one file per committed unit, OUTPUT_SCHEMA + passthrough columns
    .tmp-part-000000-<uuid>.parquet   a unit being written (renamed to part-... when complete)
    _batchgen/manifest.json      the job: fingerprint, spec, input files, units, expected rows
    _SUCCESS                     JSON summary, written once every unit is committed

A unit file is written under a temporary name in the same directory and renamed, so a
reader never sees a partial part file; it carries the job fingerprint and its unit's
index and row range in its Parquet key-value metadata (keys "batchgen.*").

Errors: OutputError (exit code 2) when the directory cannot be created or written, or holds
another job's output (the message names the keys whose values differ) or unrelated files.
"""
from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

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
    pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_tokens", pa.int32()),
    pa.field("seed", pa.int64()),
    pa.field("error", pa.string()),
])
"""Columns of every output row (one row per sample); passthrough columns follow them."""

MANIFEST = "_batchgen/manifest.json"
SUCCESS = "_SUCCESS"
META_FINGERPRINT = b"batchgen.fingerprint"
META_UNIT = b"batchgen.unit"
META_COUNTS = b"batchgen.counts"
META_VERSION = b"batchgen.version"
PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
TMP_RE = re.compile(r"^\.tmp-part-(\d{6,})-[0-9a-f]+\.parquet$")
COUNT_KEYS = ("prompts", "rows", "generated_tokens", "prompt_tokens", "tool_calls", "tool_errors", "error_rows")


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
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowException, ValueError, OSError) as e:
            raise OutputError(f"output.path {path}: cannot open this URI: {e}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def canonical_output(path: str) -> str:
    """The output path as workers should use it: absolute local path or the URI itself."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if base else name


def write_part(output_path: str, index: int, table: pa.Table) -> str:
    """Commit one unit's table atomically: write `.tmp-part-<index>-<uuid>.parquet` in the
    output directory, then rename it to part-<index>.parquet (os.replace locally, fs.move
    elsewhere). A crash before the rename leaves only the temporary file, which readers
    ignore and OutputDir.cleanup_temp_files removes. Returns the committed file's path.
    Raises OSError / pyarrow errors if the write fails (the temporary file is removed).
    """
    fs, base = resolve_output(output_path)
    tmp = _join(base, f".tmp-part-{index:06d}-{uuid.uuid4().hex}.parquet")
    final = _join(base, part_name(index))
    try:
        with fs.open_output_stream(tmp) as f:
            pq.write_table(table, f, compression="zstd")
        if isinstance(fs, pafs.LocalFileSystem):
            os.replace(tmp, final)
        else:
            fs.move(tmp, final)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except Exception:
            pass
        raise
    return final if isinstance(fs, pafs.LocalFileSystem) else _join(output_path.rstrip("/"), part_name(index))


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
        self.fs, self.base = resolve_output(str(path))

    # ------------------------------------------------------------ helpers
    def _p(self, name: str) -> str:
        return _join(self.base, name)

    def _exists(self, name: str) -> bool:
        return self.fs.get_file_info(self._p(name)).type != pafs.FileType.NotFound

    def _read_text(self, name: str) -> str:
        with self.fs.open_input_stream(self._p(name)) as f:
            return f.read().decode("utf-8")

    def _write_atomic(self, name: str, text: str) -> None:
        final = self._p(name)
        parent = final.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        tmp = _join(parent, f".tmp-{uuid.uuid4().hex}")
        with self.fs.open_output_stream(tmp) as f:
            f.write(text.encode("utf-8"))
        if isinstance(self.fs, pafs.LocalFileSystem):
            os.replace(tmp, final)
        else:
            self.fs.move(tmp, final)

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
            raise OutputError(f"{self.path}: {MANIFEST} is unreadable: {e}") from None
        if not isinstance(data, dict) or "fingerprint" not in data or "units" not in data:
            raise OutputError(f"{self.path}: {MANIFEST} is not a batchgen manifest (no fingerprint/units)")
        return data

    def _remove_batchgen_files(self) -> None:
        for rel, _ in self._entries():
            name = rel.split("/")[-1]
            if rel.startswith("_batchgen/") or rel == SUCCESS or PART_RE.match(rel) or TMP_RE.match(rel) \
                    or (name.startswith(".tmp-") and "/" not in rel):
                self.fs.delete_file(self._p(rel))

    # ------------------------------------------------------------ lifecycle
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
        try:
            self.fs.create_dir(self.base, recursive=True)
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {self.path}: cannot create directory: {e}") from None
        info = self.fs.get_file_info(self.base)
        if info.type == pafs.FileType.File:
            raise OutputError(f"output.path {self.path}: is a file, expected a directory")
        probe = f".batchgen-probe-{uuid.uuid4().hex}"
        try:
            with self.fs.open_output_stream(self._p(probe)) as f:
                f.write(b"probe")
            self.fs.delete_file(self._p(probe))
        except (OSError, pa.ArrowException) as e:
            raise OutputError(f"output.path {self.path}: directory is not writable: {e}") from None

        mode = "new"
        try:
            old = self.read_manifest()
        except OutputError:
            if not overwrite:
                raise OutputError(f"output.path {self.path}: {MANIFEST} is unreadable; pass --overwrite to start "
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
                    f"output.path {self.path} holds another job's output (fingerprint {str(old['fingerprint'])[:12]} "
                    f"!= this job's {plan.fingerprint[:12]}); differences: {detail}. Use another output.path, or "
                    f"--overwrite to delete the previous output")
            self._remove_batchgen_files()
            mode = "overwrite"
        else:
            entries = [rel for rel, _ in self._entries()]
            if entries:
                if not overwrite:
                    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                    raise OutputError(f"output.path {self.path} is not empty and has no batchgen manifest "
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
            "input_root": plan.root,
            "files": [{"path": f.path, "name": f.name, "size": f.size, "num_rows": f.num_rows} for f in plan.files],
            "output_schema": [[fld.name, type_str(fld.type)] for fld in output_schema(plan.passthrough_fields)],
            "units": [{"index": u.index, "file": names.get(u.source, u.source), "row_start": u.row_start,
                       "row_end": u.row_end, "expected_rows": u.num_rows * n} for u in plan.units],
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

    def _part_metadata(self, rel: str) -> pq.FileMetaData:
        with self.fs.open_input_file(self._p(rel)) as f:
            return pq.ParquetFile(f).metadata

    def status(self) -> dict[str, Any]:
        """Progress computed from the directory alone (manifest + Parquet footers).

        Keys: path, fingerprint, units_done, units_total, prompts_total, rows, rows_expected,
        prompts, generated_tokens, prompt_tokens, error_rows, tool_calls, tool_errors,
        temp_files, unreadable_units, success, summary (the _SUCCESS JSON or None).
        Raises OutputError if the directory has no (readable) manifest.
        """
        m = self.read_manifest()
        if m is None:
            raise OutputError(f"{self.path}: not a batchgen output directory (no {MANIFEST})")
        total = len(m["units"])
        counts = {k: 0 for k in COUNT_KEYS}
        done, unreadable = 0, []
        for rel, _ in self._entries():
            mm = PART_RE.match(rel)
            if not mm or int(mm.group(1)) >= total:
                continue
            try:
                md = self._part_metadata(rel)
            except (OSError, pa.ArrowException) as e:
                unreadable.append(f"{rel}: {e}")
                continue
            done += 1
            kv = md.metadata or {}
            c = json.loads(kv.get(META_COUNTS, b"{}"))
            c["rows"] = md.num_rows
            for k in COUNT_KEYS:
                counts[k] += int(c.get(k, 0))
        summary = None
        if self._exists(SUCCESS):
            try:
                summary = json.loads(self._read_text(SUCCESS))
            except (OSError, ValueError):
                summary = {"unreadable": True}
        return {"path": self.path, "fingerprint": m["fingerprint"], "units_done": done, "units_total": total,
                "prompts_total": m.get("num_prompts"), "rows_expected": sum(u["expected_rows"] for u in m["units"]),
                **counts, "temp_files": len(self.temp_files()), "unreadable_units": unreadable,
                "success": summary is not None, "summary": summary}

    def verify(self) -> list[str]:
        """Check the directory against its manifest; returns the problems found ([] if clean).

        Checks: manifest present and readable; every part file readable, with the manifest's
        schema, this job's fingerprint, its own unit index and the expected row count
        (unit rows x num_samples); no (prompt_id, sample_index) twice across units; no
        orphan temporary files; no unexpected files; no _SUCCESS while units are missing.
        """
        try:
            m = self.read_manifest()
        except OutputError as e:
            return [str(e)]
        if m is None:
            return [f"{self.path}: manifest {MANIFEST} is missing (not a batchgen output directory?)"]
        problems: list[str] = []
        units = {u["index"]: u for u in m["units"]}
        expected_schema = [[n, t] for n, t in m.get("output_schema", [])]
        seen: dict[tuple[str, int], str] = {}
        committed: set[int] = set()
        dupes = 0
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
            idx = int(mm.group(1))
            committed.add(idx)
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
                        problems.append(f"{rel}: {md.num_rows} rows, expected {exp_rows} "
                                        f"({units[idx]['row_end'] - units[idx]['row_start']} prompts x "
                                        f"{m.get('num_samples')} samples)")
                    if "prompt_id" in schema.names and "sample_index" in schema.names:
                        t = pf.read(columns=["prompt_id", "sample_index"])
                        for pid, si in zip(t.column(0).to_pylist(), t.column(1).to_pylist()):
                            key = (pid, si)
                            if key in seen:
                                dupes += 1
                                if dupes <= 20:
                                    problems.append(f"{rel}: duplicate row prompt_id={pid!r} sample_index={si} "
                                                    f"(also in {seen[key]})")
                            else:
                                seen[key] = rel
            except (OSError, pa.ArrowException) as e:
                problems.append(f"{rel}: unreadable Parquet file: {e}")
        if dupes > 20:
            problems.append(f"{dupes} duplicate (prompt_id, sample_index) rows in all (first 20 listed)")
        missing = sorted(set(units) - committed)
        if self._exists(SUCCESS) and missing:
            problems.append(f"{SUCCESS} is present but {len(missing)} of {len(units)} units are missing "
                            f"(first: {part_name(missing[0])})")
        return problems
