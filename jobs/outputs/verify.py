"""`verify`: an output directory checked against its manifest, in bounded memory.

Checks: manifest present and readable; every part file readable, with the manifest's
schema, this job's fingerprint, its own unit index and the expected row count; no
(prompt_id, sample_index) twice, within a file or across units; no orphan temporary files
or probes; no unexpected files; no _SUCCESS while units are missing. Files are read in
parallel; a 40,000-file output holds one 64-bit key per prompt (jobs/ids.py), not every row.

`OutputChecks` is mixed into jobs.outputs.output_dir.OutputDir: it reads the directory
through OutputDir's helpers (`fs`, `_p`, `_entries`, `_exists`, `read_manifest`).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.errors import OutputError
from jobs.ids import find_duplicates, keys_of
from jobs.outputs.layout import LEFTOVER_RE, MANIFEST, PART_RE, SUCCESS, part_name
from jobs.outputs.schema import META_FINGERPRINT, META_UNIT, type_str

READ_THREADS = 16


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
            if LEFTOVER_RE.match(rel):  # a temporary file or a probe, _batchgen/'s included (as status counts them)
                problems.append(f"{rel}: orphan temporary file (an interrupted write; resuming the job removes it)")
                continue
            if rel.startswith("_batchgen/") or rel == SUCCESS:
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
