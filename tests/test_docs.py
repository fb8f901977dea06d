"""The documentation holds together: README.md stays short, every relative link in README.md
and docs/*.md reaches an existing file and every #anchor an existing heading of its target
(GitHub's heading slugs), the two commands the README gives a fresh machine are the ones
the Makefile and CI run, and the reference tables follow the code: docs/config.md's keys and
defaults are jobs/spec.py's, its Commands block has every verb and option of jobs/cli.py, and
the output columns of README.md and docs/output.md are jobs/outputs/schema.py's.

No network, no install: these tests read files, import jobs.spec, jobs.cli and
jobs.outputs.schema (no torch, no Ray) and, where `make` is present, ask it what it would run
(`make -n`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_MAX_LINES = 250
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
# an inline link or image: [text](target "title"), target without spaces or in <...>
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
            else:
                out.append((no, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
            fence = None
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped (code spans keep their text,
    links their label), lowercased, every character that is not a letter, digit, space,
    hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [label](url) -> label
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    text = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 ... for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside
    code (fenced blocks and inline code spans)."""
    out = []
    for no, line in _outside_fences(path.read_text(encoding="utf-8")):
        line = re.sub(r"(`+)(?:(?!\1).)+?\1", "", line)  # inline code spans
        for m in INLINE_LINK.finditer(line):
            out.append((no, m.group(1).strip("<>")))
        m = REFERENCE_DEF.match(line)
        if m:
            out.append((no, m.group(1).strip("<>")))
    return out


def test_github_slug_follows_githubs_rules():
    """The slug function itself: lowercase, spaces to '-', punctuation dropped, '-' and '_'
    and code-span text kept (the cases this repository's headings use)."""
    assert github_slug("Training on the output (verl, TRL)") == "training-on-the-output-verl-trl"
    assert github_slug("Rollouts in a loop: GenerationPool") == "rollouts-in-a-loop-generationpool"
    assert github_slug("2026-11-25: AMD EPYC (Zen 5, AVX-512 BF16), the compiled GEMM") == \
        "2026-11-25-amd-epyc-zen-5-avx-512-bf16-the-compiled-gemm"
    assert github_slug("`model.dtype` and max_seq_len") == "modeldtype-and-max_seq_len"


def test_docs_folder_exists():
    """docs/ holds the pages the README links to (the link test below would pass vacuously
    on an empty folder)."""
    names = {p.name for p in DOCS}
    assert {"config.md", "output.md", "formats.md", "failures.md", "cpus.md",
            "architecture.md", "performance.md"} <= names


def test_readme_is_short():
    """README.md stays under 250 lines: the reference material lives in docs/."""
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines; move detail to docs/ (limit {README_MAX_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    """Every relative link in README.md and docs/*.md names a file or folder that exists, and
    every #anchor (same page or another Markdown file) names a heading of its target, as
    GitHub slugs headings. External links (http:, mailto:, ...) are not followed."""
    problems = []
    for no, target in links(page):
        if not target or EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{no}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where}: an anchor into a file that is not Markdown")
            elif unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def _readme_commands() -> list[str]:
    """The `make ...` commands of the README's first fenced block (the quick start)."""
    text = README.read_text(encoding="utf-8")
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no fenced code block"
    cmds = []
    for line in m.group(1).splitlines():
        cmd = line.split("#", 1)[0].strip()
        if cmd:
            cmds.append(cmd)
    return cmds


def test_readme_gives_make_demo_and_make_test():
    """The README's first commands are exactly `make demo` and `make test`, and the Makefile
    has both targets."""
    assert _readme_commands() == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no '{target}' target"


def test_ci_runs_make_test():
    """.ci/run, what CI executes, runs `make test`, the command the README gives."""
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in lines


def _make_n(*args: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # a make of its own: under `make test` the inherited MAKEFLAGS/MAKELEVEL would make this
    # a sub-make, which prints "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "-n", *args, "VENV=/nonexistent/venv"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env)
    return [ln for ln in res.stdout.splitlines() if ln.strip()]


def test_make_demo_installs_without_test_extras_and_stamps_last():
    """`make demo` on a fresh machine installs batchgen without the test extras, and its
    install is recorded by a stamp written after every install step (so an install that
    failed halfway is redone by the next `make`), before the demo runs."""
    lines = _make_n("demo")
    assert not any(".[test]" in ln for ln in lines), lines
    stamp = [i for i, ln in enumerate(lines) if ln == "touch /nonexistent/venv/.installed"]
    installs = [i for i, ln in enumerate(lines) if " -m pip install " in ln]
    assert stamp and installs and max(installs) < stamp[0], lines
    assert "batchgen run configs/demo.yaml" in lines[-1]


def test_make_test_installs_test_extras_then_runs_pytest():
    """`make test` adds the test extras (with their own stamp, written last) and runs pytest."""
    lines = _make_n("test")
    extras = [i for i, ln in enumerate(lines) if "-e '.[test]'" in ln]
    stamp = [i for i, ln in enumerate(lines) if ln == "touch /nonexistent/venv/.installed-test"]
    assert extras and stamp and extras[0] < stamp[0], lines
    assert "-m pytest" in lines[-1]


def test_torch_index_reaches_only_the_torch_install():
    """TORCH_INDEX (PyTorch's CPU wheel index, for CPU-only machines) adds --index-url to the
    torch install and to no other pip command; without it no index is named."""
    url = "https://download.pytorch.org/whl/cpu"
    with_index = [ln for ln in _make_n("install", f"TORCH_INDEX={url}") if "--index-url" in ln]
    assert len(with_index) == 1 and "torch==" in with_index[0] and url in with_index[0]
    assert not any("--index-url" in ln for ln in _make_n("install"))


# ------------------------------------------------------------------ docs against the code

def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of every body row of the tables under `heading` (up to the next heading of
    the same or a higher level), `\\|` kept inside a cell."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == heading)
    level = len(heading) - len(heading.lstrip("#"))
    rows = []
    for ln in lines[start + 1:]:
        m = HEADING.match(ln)
        if m and len(m.group(1)) <= level:
            break
        if ln.startswith("|") and not re.match(r"^\|[\s:|-]+\|$", ln):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
            rows.append(cells)
    return rows[1:] if rows and rows[0][0] in ("key", "column") else rows


def _doc_default(value) -> str:
    """A spec default as docs/config.md writes it."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    if value == []:
        return "`[]`"
    return str(int(value)) if isinstance(value, float) and value.is_integer() and value >= 10 else str(value)


def test_config_reference_lists_every_key_with_its_default():
    """docs/config.md's config reference has one row per key of the spec (jobs/spec.py, the
    function tools' fields included), no row for a key the spec lacks, and each row's default
    (before any parenthesis: `256 (null for openai_batch)`) is the spec's."""
    from jobs.spec import DEFAULT_COLUMNS, FunctionToolSpec, spec_sections

    want = {}
    for section, model in spec_sections().items():
        for name, field in model.model_fields.items():
            want[f"{section}.{name}"] = field
    del want["tools.functions"]  # documented as a row of its own and by its fields
    want["tools.functions"] = None
    for name, field in FunctionToolSpec.model_fields.items():
        want[f"tools.functions[].{name}"] = field
    rows = {}
    for cells in _table_rows((ROOT / "docs" / "config.md").read_text(encoding="utf-8"), "## Config reference"):
        keys = re.findall(r"`([^`]+)`", cells[0])
        prefix = keys[0].rsplit(".", 1)[0]
        for k in keys:
            rows[prefix + k if k.startswith(".") else k] = cells[1]
    assert sorted(set(want) - set(rows)) == [], "keys of jobs/spec.py missing from docs/config.md"
    assert sorted(set(rows) - set(want)) == [], "docs/config.md documents keys jobs/spec.py does not have"
    wrong = []
    for key, field in want.items():
        if field is None:
            continue
        doc = rows[key].split(" (")[0]
        if field.is_required():
            expected = "required"
        elif key == "input.column":
            expected = " / ".join(f"`{c}`" for c in dict.fromkeys(DEFAULT_COLUMNS.values()) if c != "body")
        else:
            expected = _doc_default(field.get_default(call_default_factory=True))
        if doc != expected:
            wrong.append(f"{key}: docs/config.md says {doc}, jobs/spec.py {expected}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", ["README.md", "docs/output.md"])
def test_output_columns_are_the_schemas(page: str):
    """The columns table of README.md and docs/output.md lists OUTPUT_SCHEMA's columns in its
    order with their types (jobs/outputs/schema.py), then those of a job with top logprobs
    (TOP_LOGPROBS_FIELDS), then the passthrough columns."""
    from jobs.outputs.schema import output_schema, type_str

    heading = "## Output" if page == "README.md" else "## Columns"
    documented = []
    for cells in _table_rows((ROOT / page).read_text(encoding="utf-8"), heading):
        names = re.findall(r"`([^`]+)`", cells[0])
        documented += [(n, cells[1]) for n in names] or [(cells[0], cells[1])]
    assert documented[-1][0] == "passthrough columns"
    # Arrow prints float32 as "float" and float64 as "double"; the docs name the widths
    schema = [(f.name, re.sub(r"\bdouble\b", "float64", re.sub(r"\bfloat\b", "float32", type_str(f.type))))
              for f in output_schema(top_logprobs=True)]
    assert [n for n, _ in documented[:-1]] == [n for n, _ in schema]
    for (name, doc_type), (_, real) in zip(documented, schema):
        if real.startswith("list<struct<"):  # README abbreviates the struct, output.md lists its fields
            assert doc_type.startswith("list<struct"), (name, doc_type)
            if page != "README.md":
                fields = re.findall(r"(\w+)(?:, |: |>)", doc_type[len("list<struct<"):])
                assert set(fields) >= set(re.findall(r"(\w+): ", real[len("list<struct<"):])), (doc_type, real)
        else:
            assert doc_type == real, f"{page}: {name} is {doc_type}; the schema says {real}"


def test_commands_block_names_every_verb_and_its_flags():
    """docs/config.md's Commands block gives every `batchgen` verb once, and only the options
    each verb's parser has (jobs/cli.py), and all of them; and every option of `batchgen`
    itself (`--version`), each on a line of its own."""
    from jobs.cli import _parser

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    block = re.search(r"^## Commands\n+```bash\n(.*?)^```", text, re.S | re.M).group(1)
    top = _parser()
    sub = next(a for a in top._actions if a.__class__.__name__ == "_SubParsersAction")
    all_lines = [ln.split("#", 1)[0] for ln in block.splitlines() if ln.startswith("batchgen ")]
    top_given = {ln.split()[1] for ln in all_lines if ln.split()[1].startswith("-")}
    top_options = {a.option_strings[-1] for a in top._actions if a.option_strings and a.dest != "help"}
    assert top_given == top_options, f"batchgen's own options: documented {top_given}, jobs/cli.py has {top_options}"
    lines = [ln for ln in all_lines if not ln.split()[1].startswith("-")]
    verbs = [ln.split()[1] for ln in lines]
    assert sorted(verbs) == sorted(sub.choices), verbs
    for ln, verb in zip(lines, verbs):
        given = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", ln))
        options = [a.option_strings for a in sub.choices[verb]._actions if a.option_strings and a.dest != "help"]
        missing = [o[-1] for o in options if not given & set(o)]
        unknown = given - {o for opts in options for o in opts}
        assert not missing and not unknown, f"batchgen {verb}: options not documented {missing}, unknown {unknown}"
