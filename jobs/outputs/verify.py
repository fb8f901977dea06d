"""`verify`: an output directory checked against its manifest, in bounded memory.

Checks: manifest present and readable; every part file readable, with the manifest's
schema, this job's fingerprint, its own unit index, the expected row count, its unit's
prompts (as many prompt ids as the unit has prompts; with default ids, exactly the unit's
`<file>:<row>` ids) and counts metadata that `status` can read and that agree with its
rows; no (prompt_id, sample_index) twice, within a file or across units; no orphan
temporary files or probes; no unexpected files (a part name that is not the canonical
`part_name` of its index included); a readable _SUCCESS, and none while units are missing.
Files are read in parallel; a 40,000-file output holds one 64-bit key per prompt
(jobs/ids.py), not every row.

verify() is integrity, not completion: a partial output (an interrupted job) with nothing
wrong in what is there has no problems; `completion()` says how far the job got (`batchgen
verify` prints it; `--complete` counts an unfinished output as a problem).

`OutputChecks` is mixed into jobs.outputs.output_dir.OutputDir: it reads the directory
through OutputDir's helpers (`fs`, `_p`, `_entries`, `_exists`, `read_manifest`).
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs.errors import OutputError
from jobs.ids import find_duplicates, keys_of
from jobs.outputs.layout import LEFTOVER_RE, MANIFEST, SUCCESS, part_index, part_name
from jobs.outputs.schema import COUNT_KEYS, META_COUNTS, META_FINGERPRINT, META_UNIT, type_str

READ_THREADS = 16
BATCH_ROWS = 8192  # rows of prompt_tokens decoded at a time (a part's prompts may be long)


def is_count(v: Any) -> bool:
    """A non-negative integer, bool excluded (JSON's `true` is no count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def part_counts(kv: dict | None) -> dict[str, int]:
    """The counts of a part's batchgen.counts metadata that `status` sums: those of
    COUNT_KEYS it holds (`status` takes an absent one as 0: a writer may predate it). Raises
    ValueError saying what is wrong (no such metadata, not JSON, not an object of
    non-negative integers): `status` lists the part as unreadable and `verify` reports it,
    with the same words."""
    raw = (kv or {}).get(META_COUNTS)
    if raw is None:
        raise ValueError(f"it has no {META_COUNTS.decode()} metadata")
    try:
        c = json.loads(raw)
    except ValueError:
        c = None
    if not isinstance(c, dict) or not all(is_count(c.get(k, 0)) for k in COUNT_KEYS):
        raise ValueError(f"its {META_COUNTS.decode()} metadata is not an object of counts: {raw[:100]!r}")
    return {k: c[k] for k in COUNT_KEYS if k in c}


def _default_ids(m: dict) -> bool:
    """Whether the job's prompt ids are all `<file>:<row>` (no input.id_column; an
    openai_batch job's are its custom_ids)."""
    inp = (m.get("spec") or {}).get("input") or {}
    return isinstance(inp, dict) and inp.get("id_column") is None and inp.get("format", "text") != "openai_batch"


class OutputChecks:
    """verify() of an OutputDir (see the module docstring)."""

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
                try:
                    recorded: dict[str, int] | None = part_counts(md.metadata)
                except ValueError as e:  # `status` lists it as unreadable
                    problems.append(f"{rel}: {e}")
                    recorded = None
                got = [[fld.name, type_str(fld.type)] for fld in schema]
                if expected_schema and got != expected_schema:
                    exp_s = ", ".join(f"{n}: {t}" for n, t in expected_schema)
                    got_s = ", ".join(f"{n}: {t}" for n, t in got)
                    problems.append(f"{rel}: schema mismatch: expected [{exp_s}], got [{got_s}]")
                fp = kv.get(META_FINGERPRINT, b"").decode(errors="replace")
                if fp != m["fingerprint"]:
                    problems.append(f"{rel}: fingerprint {fp[:12] or '<none>'} does not match the manifest's "
                                    f"{m['fingerprint'][:12]} (written by another job)")
                try:
                    meta_unit = json.loads(kv.get(META_UNIT, b"{}"))
                except ValueError:
                    meta_unit = {}
                if not isinstance(meta_unit, dict):  # (a file rewritten by another tool): named below
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
                enc = t.column("prompt_id").combine_chunks().dictionary_encode()
                ids = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
                if recorded is not None and not (expected_schema and got != expected_schema) and \
                        {"num_tokens", "finish_reason", "error", "prompt_tokens"} <= set(schema.names):
                    problems += self._counts_disagree(rel, pf, recorded, len(enc.dictionary), ids)
        except (OSError, pa.ArrowException) as e:
            return problems + [f"{rel}: unreadable Parquet file: {e}"], None
        problems += self._foreign_prompts(rel, m, units[idx], enc.dictionary)
        # within the file: (prompt, sample_index) pairs must be distinct
        si = t.column("sample_index").to_numpy().astype(np.int64)
        pairs = ids * (int(si.max(initial=0)) + 1) + si
        uniq, first, counts = np.unique(pairs, return_index=True, return_counts=True)
        for k in np.flatnonzero(counts > 1)[:20]:
            j = first[k]
            problems.append(f"{rel}: duplicate row prompt_id={enc.dictionary[ids[j]].as_py()!r} "
                            f"sample_index={int(si[j])} (twice in this file)")
        return problems, keys_of(enc.dictionary)

    @staticmethod
    def _counts_disagree(rel: str, pf: pq.ParquetFile, recorded: dict[str, int], prompts: int,
                         ids: np.ndarray) -> list[str]:
        """The counts of a part's batchgen.counts metadata (those `status` sums) that its rows
        contradict: `status` reports the metadata without reading rows, so a part rewritten by
        another tool, its metadata kept, would have it report numbers the dataset does not
        hold. Counted as jobs/task.py counts them; input_rows_decoded has no trace in the rows."""
        t = pf.read(columns=["num_tokens", "finish_reason", "error"])
        calls = [c.path for c in pf.schema if c.path.startswith("tool_calls.list.") and c.path.endswith(".error")]
        errors = pf.read(columns=calls).column(0).combine_chunks() if calls else None
        first = np.zeros(len(ids), dtype=bool)  # each prompt's first row: its prompt_tokens are counted once
        first[np.unique(ids, return_index=True)[1]] = True
        prompt_tokens, at = 0, 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=["prompt_tokens"]):
            lengths = pc.list_value_length(batch.column(0)).fill_null(0).to_numpy(zero_copy_only=False)
            prompt_tokens += int(lengths[first[at:at + len(lengths)]].sum())
            at += len(lengths)

        def total(values: Any) -> int:
            return int(pc.sum(values).as_py() or 0)

        actual = {
            "prompts": prompts, "rows": pf.metadata.num_rows,
            "generated_tokens": total(t.column("num_tokens")),
            "prompt_tokens": prompt_tokens,
            "tool_calls": 0 if errors is None else total(pc.list_value_length(errors)),
            "tool_errors": 0 if errors is None else total(pc.is_valid(pc.struct_field(pc.list_flatten(errors), [0]))),
            "error_rows": total(pc.or_kleene(pc.equal(t.column("finish_reason"), "error").fill_null(False),
                                             pc.is_valid(t.column("error")))),
        }
        return [f"{rel}: its {META_COUNTS.decode()} metadata says {k} {recorded[k]}, its rows hold {v} "
                f"(`batchgen status` reports the metadata)" for k, v in actual.items() if recorded.get(k, v) != v]

    @staticmethod
    def _foreign_prompts(rel: str, m: dict, unit: dict, dictionary: pa.Array) -> list[str]:
        """A part holding other prompts than its unit's: as many distinct prompt ids as the unit
        has prompts, and with default ids exactly its `<file>:<row>` ids (rows of another unit
        under this unit's name and metadata, which the row count and the duplicate check pass
        while that unit is absent)."""
        want = unit["row_end"] - unit["row_start"]
        where = f"{unit.get('file', '?')} rows {unit['row_start']}..{unit['row_end'] - 1}"
        if _default_ids(m) and isinstance(unit.get("file"), str):
            rows = re.compile(re.escape(unit["file"]) + r":(\d+)")
            for pid in dictionary.to_pylist():
                hit = rows.fullmatch(pid or "")
                if hit is None or not unit["row_start"] <= int(hit.group(1)) < unit["row_end"]:
                    return [f"{rel}: prompt_id {pid!r} is not a prompt of its unit ({where})"]
        if len(dictionary) != want:
            return [f"{rel}: {len(dictionary)} distinct prompt ids, expected its unit's {want} prompts ({where})"]
        return []

    def _prompt_ids(self, rel: str) -> pa.Array:
        """The distinct prompt ids of one part file."""
        with self.fs.open_input_file(self._p(rel)) as f:
            t = pq.ParquetFile(f).read(columns=["prompt_id"])
        return t.column(0).combine_chunks().dictionary_encode().dictionary

    def verify(self) -> list[str]:
        """Check the directory against its manifest; returns the problems found ([] if clean).
        Raises OutputError (exit code 2: nothing verified) when the output cannot be read or
        there is no directory at its path.

        Checks: manifest present and readable; every part file readable, with the manifest's
        schema, this job's fingerprint, its own unit index, the expected row count (unit
        rows x num_samples, or the per-request num_samples summed), its unit's prompts and
        counts metadata that `status` reads and the rows agree with; no (prompt_id,
        sample_index) twice, within a file or across units (a prompt's samples all belong to
        one unit, so a prompt id in two files is a duplicate); no orphan temporary files; no
        unexpected files; a readable _SUCCESS, and none while units are missing. Everything
        `status` lists as unreadable is a problem here. Files are read in parallel; memory
        holds one 64-bit key per prompt.
        """
        try:
            m = self.read_manifest()
            kind = self.fs.get_file_info(self.base).type if m is None else None
        except OutputError as e:
            return [str(e)]
        except OSError as e:  # a store that does not answer: nothing was verified (exit code 2)
            raise OutputError(f"{self.shown}: cannot read the output: {e}") from None
        if kind in (pafs.FileType.NotFound, pafs.FileType.File):
            raise OutputError(f"{self.shown}: not a batchgen output directory "
                              f"({'a file' if kind == pafs.FileType.File else 'no such directory'})")
        if m is None:
            return [f"{self.shown}: manifest {MANIFEST} is missing (not a batchgen output directory?)"]
        problems: list[str] = []
        units = {u["index"]: u for u in m["units"]}
        m["_units_by_index"] = units
        expected_schema = [[n, t] for n, t in m.get("output_schema", [])]
        parts: list[tuple[str, int]] = []
        for rel, _ in self._entries():
            if LEFTOVER_RE.match(rel):  # a temporary file or a probe, _batchgen/'s included (as status counts them)
                problems.append(f"{rel}: orphan temporary file (an interrupted write; resuming the job removes it)")
                continue
            if rel.startswith("_batchgen/") or rel == SUCCESS:
                continue
            idx = part_index(rel)
            if idx is None or idx not in units:
                problems.append(f"{rel}: unexpected file (not a unit of this job)")
                continue
            parts.append((rel, idx))
        committed = {idx for _, idx in parts}
        keys: list[Any] = [None] * len(parts)
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(parts)))) as ex:
            for i, (found, k) in enumerate(ex.map(lambda p: self._check_part(p[0], p[1], m, expected_schema), parts)):
                problems.extend(found)
                keys[i] = k
        problems.extend(self._cross_file_duplicates(parts, keys))
        missing = sorted(set(units) - committed)
        if self._exists(SUCCESS):
            try:  # `status` shows an unreadable one as {"unreadable": true}
                if not isinstance(json.loads(self._read_text(SUCCESS)), dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                problems.append(f"{SUCCESS}: unreadable summary ({e}); the job writes it when every unit is in")
        if self._exists(SUCCESS) and missing:
            problems.append(f"{SUCCESS} is present but {len(missing)} of {len(units)} units are missing "
                            f"(first: {part_name(missing[0])})")
        return problems

    def completion(self) -> tuple[int, int, bool]:
        """(units committed, units of the job, whether _SUCCESS is present): how far the job
        got, for `verify`'s verdict. An output without _SUCCESS is a job that has not finished
        (interrupted, failed or still running), whatever verify() finds in what is there.
        Raises OutputError for an unreadable manifest (verify() reports it first)."""
        try:
            m = self.read_manifest()
            if m is None:
                return 0, 0, self._exists(SUCCESS)
            units = {u["index"] for u in m["units"]}
            return len(self.committed_units() & units), len(units), self._exists(SUCCESS)
        except OSError as e:  # a store that stopped answering (exit code 2, as verify())
            raise OutputError(f"{self.shown}: cannot read the output: {e}") from None

    def _cross_file_duplicates(self, parts: list[tuple[str, int]], keys: list[Any]) -> list[str]:
        """Prompt ids present in more than one part file: jobs.ids.find_duplicates over each
        file's distinct-id keys (8 bytes per prompt); only files holding a candidate are read
        again. The first 20 are described."""
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
