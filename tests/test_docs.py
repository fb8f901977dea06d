"""The documentation holds together: README.md stays short, every relative link in README.md
and docs/*.md reaches an existing file and every #anchor an existing heading of its target
(GitHub's heading slugs), and the two commands the README gives a fresh machine are the ones
the Makefile and CI run.

No network, no install: these tests read files and, where `make` is present, ask it what it
would run (`make -n`).
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
