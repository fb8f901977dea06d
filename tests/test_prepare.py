"""jobs.inputs.prepare streams: `batchgen prepare` reads the JSONL file twice (checks and
column types, then batches of row groups) and never holds it whole. Its output and its errors
are those of the version that held every row in memory (`_reference_prepare` below, copied
from it), on files whose field types change after the first batch, fields first seen late,
ids repeated across batches and errors on late lines."""
from __future__ import annotations

import codecs
import json
import math
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.errors import InputError
from jobs.inputs import prepare as prep
from jobs.inputs.prepare import prepare_jsonl


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def outcome(fn, src, out, **kw):
    """("ok", rows, the file's bytes) or ("error", the InputError's text), and that a failure
    left nothing beside the input."""
    before = set(os.listdir(os.path.dirname(src)))
    try:
        n = fn(src, out, **kw)
    except InputError as e:
        assert set(os.listdir(os.path.dirname(src))) == before, "a failing prepare left a file behind"
        return ("error", str(e))
    with open(out, "rb") as f:
        data = f.read()
    os.remove(out)
    return ("ok", n, data)


def same_as_reference(tmp_path, rows, batch_rows=4, **kw):
    src = write_lines(tmp_path / "in.jsonl", rows)
    want = outcome(_reference_prepare, src, str(tmp_path / "ref.parquet"), **kw)
    got = outcome(prepare_jsonl, src, str(tmp_path / "new.parquet"), batch_rows=batch_rows, **kw)
    if want[0] == "ok" and got[0] == "ok" and want != got:  # say how they differ
        open(tmp_path / "a.parquet", "wb").write(want[2])
        open(tmp_path / "b.parquet", "wb").write(got[2])
        a, b = pq.ParquetFile(tmp_path / "a.parquet"), pq.ParquetFile(tmp_path / "b.parquet")
        assert a.schema_arrow == b.schema_arrow
        assert [a.metadata.row_group(i).num_rows for i in range(a.num_row_groups)] == \
               [b.metadata.row_group(i).num_rows for i in range(b.num_row_groups)]
        assert a.read().to_pylist() == b.read().to_pylist()
    assert got == want, (got[:2], want[:2])
    return got


# ------------------------------------------------------------- types decided by the whole file

@pytest.mark.parametrize("rows, kw, fragment", [
    # an int field that becomes a float after the first batch: a double column, not int64
    ([{"q": f"p{i}", "x": i} for i in range(9)] + [{"q": "f", "x": 0.5}], {}, None),
    # null in the first batches only: the type comes from a later one (and back to null after)
    ([{"q": f"p{i}", "x": None} for i in range(9)] + [{"q": "f", "x": "s"}, {"q": "g"}], {}, None),
    # a column all null, and one missing from most lines
    ([{"q": f"p{i}", "x": None, **({"y": 1} if i == 3 else {})} for i in range(10)], {}, None),
    # a field first seen on the last line: a column of nulls until then, after the others
    ([{"q": f"p{i}", "a": 1} for i in range(10)] + [{"q": "z", "late": True, "a": 2}], {}, None),
    # bools then an int: the first kind decides (bool), and the int is the error
    ([{"q": f"p{i}", "x": True} for i in range(6)] + [{"q": "z", "x": 1}], {},
     "field 'x' has values of different types: Could not convert 1 with type int: tried to convert to boolean"),
    # an int then bools: int64, and a bool is the error
    ([{"q": f"p{i}", "x": i} for i in range(6)] + [{"q": "z", "x": False}], {},
     "field 'x' has values of different types: Expected integer, got bool"),
    # a float and then a bool: the bool is 1.0
    ([{"q": f"p{i}", "x": 0.5} for i in range(6)] + [{"q": "z", "x": True}], {}, None),
    # strings, then a number after the first batch
    ([{"q": f"p{i}", "x": "s"} for i in range(6)] + [{"q": "z", "x": 3}], {},
     "field 'x' has values of different types: Expected bytes, got a 'int' object"),
    # an int beyond 2**53 and, a batch later, a float: not exactly a double
    ([{"q": "a", "x": 2 ** 53 + 1}] + [{"q": f"p{i}", "x": 2} for i in range(6)] + [{"q": "z", "x": 0.5}], {},
     "Integer value 9007199254740993 is outside of the range exactly representable"),
    # beyond int64: an OverflowError, wherever it is
    ([{"q": f"p{i}", "x": i} for i in range(6)] + [{"q": "z", "x": 2 ** 64}], {}, "too large"),
    # a lone surrogate (JSON "\ud800") in a late prompt, and in another field
    ([{"q": f"p{i}"} for i in range(6)] + ['{"q": "a\\ud800b"}'], {}, "surrogates not allowed"),
    ([{"q": f"p{i}", "x": "s"} for i in range(6)] + ['{"q": "z", "x": "\\udfff"}'], {"fmt": "chat"},
     "field 'x' has values of different types: 'utf-8' codec can't encode"),
    # a field named messages beside a text prompt is a list column: a scalar is an error
    ([{"q": f"p{i}"} for i in range(6)] + [{"q": "z", "messages": "m"}], {}, "field 'messages' has values"),
    # the error of the first column (in first-seen order), not of the first line
    ([{"q": "a", "x": 1, "y": 1}] + [{"q": f"p{i}", "y": "s"} for i in range(6)] + [{"q": "z", "x": "s"}], {},
     "field 'x' has values of different types"),
], ids=["int_then_float", "null_then_str", "all_null", "late_field", "bool_then_int", "int_then_bool",
        "float_then_bool", "str_then_int", "wide_int_then_float", "huge_int", "surrogate_prompt",
        "surrogate_field_chat", "messages_field", "first_column_first"])
def test_prepare_types_from_the_whole_file(tmp_path, rows, kw, fragment):
    got = same_as_reference(tmp_path, rows, column="q", **kw)
    if fragment is None:
        assert got[0] == "ok"
    else:
        assert got[0] == "error" and fragment in got[1], got[1]


def test_prepare_late_field_and_type_change_in_the_file(tmp_path):
    """What a naive stream would get wrong, read back: a field first seen on the last line is a
    column (nulls before it), and a column's type is the whole file's (double), not the first
    batch's (int64)."""
    rows = [{"q": f"p{i}", "n": i} for i in range(20)] + [{"q": "z", "n": 0.5, "late": "x"}]
    src = write_lines(tmp_path / "in.jsonl", rows)
    assert prepare_jsonl(src, str(tmp_path / "p.parquet"), column="q", row_group_rows=4, batch_rows=8) == 21
    f = pq.ParquetFile(tmp_path / "p.parquet")
    assert [str(t) for t in f.schema_arrow.types] == ["string", "double", "string"]
    assert f.schema_arrow.names == ["prompt", "n", "late"]
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [4, 4, 4, 4, 4, 1]
    t = f.read()
    assert t.column("n").to_pylist() == [float(i) for i in range(20)] + [0.5]
    assert t.column("late").to_pylist() == [None] * 20 + ["x"]


# ------------------------------------------------------------- ids across batches

@pytest.mark.parametrize("rows, fragment", [
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": 3}],
     "in.jsonl:11: duplicate id 3 (also on line 4)"),
    ([{"q": f"p{i}", "id": f"s{i}"} for i in range(10)] + [{"q": "z", "id": "s0"}],
     "in.jsonl:11: duplicate id 's0' (also on line 1)"),
    # the first repeated line wins, not the first id repeated
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": 7}, {"q": "y", "id": 1}],
     "in.jsonl:11: duplicate id 7 (also on line 8)"),
    # 3.0 is 3; ids beyond int64 are not the negative ones of the same bits
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": 3.0}], "in.jsonl:11: duplicate id 3"),
    ([{"q": "a", "id": -1}, {"q": "b", "id": 2 ** 64 - 1}] + [{"q": f"p{i}", "id": 10 + i} for i in range(6)]
     + [{"q": "z", "id": 2 ** 64 - 1}], "in.jsonl:9: duplicate id 18446744073709551615 (also on line 2)"),
    # a duplicate before another id error wins; after it, the other error
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": 2}, {"q": "y", "id": "s"}],
     "in.jsonl:11: duplicate id 2"),
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "y", "id": "s"}, {"q": "z", "id": 2}],
     "in.jsonl:11: id field 'id' is \"s\" (str), but line 1 has a int id"),
    # lines without the id before the first with it: the first of them is the error
    ([{"q": f"p{i}"} for i in range(10)] + [{"q": "z", "id": 1}], "in.jsonl:1: id field 'id' is missing"),
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z"}], "in.jsonl:11: id field 'id' is missing"),
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": None}], "in.jsonl:11: id field 'id' is missing"),
    ([{"q": f"p{i}", "id": i} for i in range(10)] + [{"q": "z", "id": 1.5}], "in.jsonl:11: id field 'id' is 1.5"),
    # a read error anywhere comes before any id error
    ([{"q": "a", "id": 1}, {"q": "b", "id": 1}] + [{"q": f"p{i}", "id": 9 + i} for i in range(8)] + ["{bad"],
     "in.jsonl:11: invalid JSON"),
    # ids fine, then the type error of a later column
    ([{"q": f"p{i}", "id": i, "x": 1} for i in range(10)] + [{"q": "z", "id": 99, "x": "s"}], "field 'x' has values"),
    # ids made from line numbers (blank lines counted), ids that are the prompts, wide ints
    ([{"q": f"p{i}"} for i in range(5)] + ["", {"q": "z"}], None),
    ([{"q": f"p{i}", "id": "x"} for i in range(5)] + [{"q": "z", "id": "x"}], None),
    ([{"q": f"p{i}", "id": 2 ** 53 + i} for i in range(10)], None),
], ids=["int", "str", "first_repeat_line", "float_int", "uint64", "dup_before_kind", "kind_before_dup",
        "absent_first", "absent_late", "null_late", "fraction_late", "read_error_first", "type_after_ids",
        "line_numbers", "prompt_ids", "wide_ints"])
def test_prepare_ids_across_batches(tmp_path, rows, fragment, request):
    id_column = {"line_numbers": "row", "prompt_ids": "prompt"}.get(request.node.callspec.id, "id")
    got = same_as_reference(tmp_path, rows, column="q", id_column=id_column, row_group_rows=2)
    if fragment is None:
        assert got[0] == "ok"
    else:
        assert got[0] == "error" and fragment in got[1], got[1]


# ------------------------------------------------------------- late errors leave nothing

@pytest.mark.parametrize("last, args", [
    ("{not json", {}), ('{"q": 5}', {}), ('{"q": "z", "x": "s"}', {}), ('{"q": "z", "id": 0}', {"id_column": "id"}),
], ids=["invalid_json", "prompt_not_str", "type_change", "duplicate_id"])
def test_prepare_late_error_leaves_no_output(tmp_path, last, args):
    src = write_lines(tmp_path / "in.jsonl", [{"q": f"p{i}", "x": i, "id": i} for i in range(50)] + [last])
    out = tmp_path / "out" / "p.parquet"
    with pytest.raises(InputError, match="in.jsonl"):
        prepare_jsonl(src, str(out), column="q", row_group_rows=4, batch_rows=8, **args)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no output directory, file or temporary file


def test_prepare_file_changed_between_passes_leaves_no_output(tmp_path, monkeypatch):
    """A file that changes between the two passes (a field's type) is an error, and the
    temporary file goes."""
    src = write_lines(tmp_path / "in.jsonl", [{"q": f"p{i}", "x": i} for i in range(20)])
    real = prep._rows
    passes = []

    def rows(*a):
        passes.append(1)
        for r, length in real(*a):
            if len(passes) == 2 and r[prep.LINE] == 15:
                r["x"] = "changed"
            yield r, length
    monkeypatch.setattr(prep, "_rows", rows)
    with pytest.raises(InputError, match="changed while it was read"):
        prepare_jsonl(src, str(tmp_path / "p.parquet"), column="q", row_group_rows=2, batch_rows=4)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


# ------------------------------------------------------------- memory: a batch at a time

def test_prepare_holds_a_batch_of_rows_at_most(tmp_path, monkeypatch):
    """The rows written at once are one batch of whole row groups (batch_rows rounded down to
    row_group_rows, at least one group; fewer groups once the batch's lines hold BATCH_BYTES),
    and the first pass keeps no rows."""
    src = write_lines(tmp_path / "in.jsonl", [{"q": f"p{i}", "x": i} for i in range(100)])
    sizes = []
    real = pq.ParquetWriter.write_table

    def write_table(self, table, row_group_size=None):
        sizes.append(table.num_rows)
        return real(self, table, row_group_size=row_group_size)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)
    real_add = prep._Scan.add
    kept = []

    def add(self, row):
        real_add(self, row)
        kept.append(sum(len(v) for v in vars(self).values() if isinstance(v, list)))
    monkeypatch.setattr(prep._Scan, "add", add)
    assert prepare_jsonl(src, str(tmp_path / "p.parquet"), column="q", row_group_rows=3, batch_rows=10) == 100
    assert sizes == [9] * 11 + [1] and max(kept) == 0
    sizes.clear()
    assert prepare_jsonl(src, str(tmp_path / "p.parquet"), column="q", row_group_rows=40, batch_rows=10) == 100
    assert sizes == [40, 40, 20]
    assert [pq.ParquetFile(tmp_path / "p.parquet").metadata.row_group(i).num_rows for i in range(3)] == [40, 40, 20]
    sizes.clear()
    monkeypatch.setattr(prep, "BATCH_BYTES", 5 * len('{"q": "p10", "x": 10}\n'))  # about 5 lines
    assert prepare_jsonl(src, str(tmp_path / "p.parquet"), column="q", row_group_rows=3, batch_rows=10) == 100
    assert sizes == [6] * 16 + [4]


# ------------------------------------------------------------- the same file as before, any input

def test_prepare_kinds_give_the_whole_columns_type_and_error():
    """The first pass's premise: pa.array on the first value of each _kind, in the order they
    first appear (and a null anywhere), gives the type or the error that pa.array gives on the
    whole column, with no type given, and with the prompt columns' types."""
    pool = [None, True, False, 0, 1, -7, 2 ** 53, -2 ** 53, 2 ** 53 + 1, -2 ** 53 - 2, 2 ** 63 - 1, -2 ** 63,
            2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63 - 1, 0.5, -0.0, 1e300, "", "s", "é", "a\ud800", "\udfff"]
    rnd = random.Random(7)

    def result(values, **kw):
        try:
            return str(pa.array(values, **kw).type)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            return f"{type(e).__name__}: {e}"

    def sample(values, kind=prep._kind):
        seen = {}
        for v in values:
            seen.setdefault(kind(v), v)
        out = [v for k, v in seen.items() if k != prep._NONE]
        if prep._NONE in seen:  # (where a null sits makes no difference)
            out.insert(rnd.randint(0, len(out)), None)
        return out

    for _ in range(3000):
        values = [rnd.choice(pool) for _ in range(rnd.randint(0, 8))]
        assert result(sample(values)) == result(values), values
        texts = [v for v in values if v is None or isinstance(v, str)]
        assert result(sample(texts), type=pa.string()) == result(texts, type=pa.string()), texts
        msgs = [None if v is None else [{"role": "user", "content": v}] for v in texts]
        assert result(sample(msgs, prep._kind_text), type=prep.MESSAGES) == result(msgs, type=prep.MESSAGES), msgs


def test_prepare_random_files_match_the_in_memory_version(tmp_path):
    """Random files (fields of every scalar kind, appearing, disappearing and changing type
    line to line, ids good and bad, errors): the same bytes, or the same error, as the version
    that read the whole file into memory, at small batches."""
    rnd = random.Random(11)
    scalars = [None, True, False, 0, 3, -5, 2 ** 53 + 1, 2 ** 63, 0.25, 3.0, "a", "é", "x\ud800", [1], {"k": 1},
               float("nan")]
    groups = [[None, 0, 3, -5, 3.0, 0.25], [0, 7, 2 ** 53 + 1], [None, "a", "é"], [True, False, None], [None],
              [[1], {"k": 1}, None, float("nan")], [0.25, True]]
    outcomes = []
    for case in range(300):
        n = rnd.randint(0, 30)
        fields = rnd.sample(["a", "b", "c", "d", "_line"] + (["messages", "prompt"] if rnd.random() < 0.2 else []),
                            rnd.randint(0, 4))
        surrogates = rnd.random() < 0.1
        weights = {f: rnd.random() for f in fields}
        pick = {f: rnd.choice(groups) if rnd.random() < 0.8 else rnd.sample(scalars, rnd.randint(1, 3)) for f in fields}
        ids = rnd.choice(["int", "str", "float", "mixed", "none"])
        rows = []
        for i in range(n):
            r = {"q": rnd.choice(["p%d" % i] * 20 + [None, "é", "\ud800" if surrogates else "s"])}
            for f in fields:
                if rnd.random() < weights[f]:
                    r[f] = rnd.choice(pick[f])
            if ids != "none" and rnd.random() < 0.97:
                k = rnd.randrange(4 * n + 1) if rnd.random() < 0.1 else i
                r["id"] = {"int": k, "str": f"s{k}", "float": float(k)}.get(ids, rnd.choice([k, f"s{k}"]))
            bad = i > 0 and rnd.random() < 0.02
            rows.append(rnd.choice(["", "[]", "{x"]) if bad else json.dumps(r, allow_nan=True))
        fmt = rnd.choice(["text", "chat"])
        id_column = rnd.choice([None, "id", "id", "a", "row"])
        got = same_as_reference(tmp_path, rows, batch_rows=rnd.choice([1, 2, 3, 5, 8]), column="q", fmt=fmt,
                          id_column=id_column, row_group_rows=rnd.choice([1, 2, 3]))
        outcomes.append(got[0] if got[0] == "ok" else got[1].split(": ", 1)[1].split(" ")[0])
    # (the files cover both: written ones, and errors of each stage)
    assert outcomes.count("ok") >= 30 and {"field", "duplicate", "id"} <= set(outcomes), outcomes


# ------------------------------------------------------------- the version that held the file in memory
# jobs/inputs/prepare.py before it streamed (commit a10cdbf), unchanged but for names: the reference.

_LINE = object()


def _reference_prepare(input_path, output_path, column="prompt", id_column=None, fmt="text", row_group_rows=256):
    if row_group_rows < 1:
        raise InputError(f"--row-group-rows must be >= 1, got {row_group_rows}")
    target = "messages" if fmt == "chat" else "prompt"
    rows, extra = _ref_read_rows(input_path, column, target, fmt)
    if id_column is not None:
        _ref_add_ids(rows, extra, id_column, input_path)
    table = _ref_table(rows, extra, target, input_path)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = f"{output_path}.tmp-{os.getpid()}"
    pq.write_table(table, tmp, row_group_size=row_group_rows)
    os.replace(tmp, output_path)
    return table.num_rows


def _ref_read_rows(input_path, column, target, fmt):
    rows, extra = [], {}
    with open(input_path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{input_path}:{lineno}: not UTF-8 text: {e}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{input_path}:{lineno}: invalid JSON: {e}") from None
            except RecursionError:
                raise InputError(f"{input_path}:{lineno}: invalid JSON: nested too deeply") from None
            if not isinstance(obj, dict):
                raise InputError(f"{input_path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            if column not in obj:
                raise InputError(f"{input_path}:{lineno}: no field {column!r} (fields: {', '.join(obj) or 'none'})")
            text = obj[column]
            if text is not None and not isinstance(text, str):
                raise InputError(f"{input_path}:{lineno}: field {column!r} must be a string, got {type(text).__name__}")
            if target != column and target in obj:
                raise InputError(f"{input_path}:{lineno}: field {target!r} is also the column the prompt field "
                                 f"{column!r} becomes; rename it (or use --column {target})")
            row = {_LINE: lineno}
            row[target] = text if fmt == "text" else (None if text is None else [{"role": "user", "content": text}])
            for k, v in obj.items():
                if k == column:
                    continue
                if v is None or isinstance(v, (str, int, float, bool)):
                    if isinstance(v, float) and not math.isfinite(v):
                        v = None
                    row[k] = v
                    extra.setdefault(k)
            rows.append(row)
    return rows, extra


def _ref_add_ids(rows, extra, id_column, input_path):
    have = [r for r in rows if id_column in r]
    if not have:
        for r in rows:
            r[id_column] = r[_LINE]
        extra.setdefault(id_column)
        return
    seen, kind = {}, None
    for r in rows:
        v = r.get(id_column)
        where = f"{input_path}:{r[_LINE]}"
        if v is None:
            raise InputError(f"{where}: id field {id_column!r} is missing, null, not finite, a list or an object; "
                             f"ids must be strings or integers")
        if isinstance(v, float) and v.is_integer() and abs(v) <= 2 ** 53:
            v = r[id_column] = int(v)
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise InputError(f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}); "
                             f"ids must be strings or integers")
        if not isinstance(v, str) and not -2 ** 63 <= v < 2 ** 64:
            raise InputError(f"{where}: id field {id_column!r} is {v}, outside the 64-bit integer range")
        if kind is None:
            kind = (type(v), r[_LINE])
        elif type(v) is not kind[0]:
            raise InputError(f"{where}: id field {id_column!r} is {json.dumps(v)} ({type(v).__name__}), but line "
                             f"{kind[1]} has a {kind[0].__name__} id; ids must all be strings or all integers")
        if v in seen:
            raise InputError(f"{where}: duplicate id {v!r} (also on line {seen[v]})")
        seen[v] = r[_LINE]


def _ref_table(rows, extra, target, input_path):
    names = [target] + [k for k in extra if k != target]
    arrays = {}
    for name in names:
        values = [r.get(name) for r in rows]
        try:
            if name == "messages":
                arrays[name] = pa.array(values, type=pa.list_(pa.struct([("role", pa.string()),
                                                                         ("content", pa.string())])))
            elif name == "prompt":
                arrays[name] = pa.array(values, type=pa.string())
            else:
                arrays[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            raise InputError(f"{input_path}: field {name!r} has values of different types: {e}") from None
    return pa.table(arrays) if arrays else pa.table({target: pa.array([], type=pa.string())})
