"""Measure engine.tools.calculator against GSM8K's <<expr=result>> calculator annotations.

    .venv/bin/python bench/gsm8k_calculator.py [path/to/train.jsonl] [--examples N]

Default path: ../shared/data/gsm8k/train.jsonl beside the checkout. Prints the total
number of annotations, how many are plain arithmetic, how many the calculator agrees
with, and every class of disagreement with its count and examples. tests/test_tools.py
imports classify() / measure() from this file, so the test and the numbers agree.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATH = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

ANNOTATION = re.compile(r"<<(.*?)>>")
#: "Plain arithmetic": what nanochat's pure-math path accepts (after comma removal), minus
#: '**' (which both reject), with at least one digit.
PLAIN_CHARS = frozenset("0123456789+-*/(). ")
NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")

REL_TOL = 1e-6
ABS_TOL = 1e-6


def _load_calculator():
    """Import engine.tools; fall back to loading the file directly (engine/__init__ pulls in
    the whole engine, which this measurement does not need)."""
    try:
        from engine.tools import calculator  # type: ignore
        return calculator
    except ImportError:
        spec = importlib.util.spec_from_file_location("_batchgen_tools", ROOT / "engine" / "tools.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod.calculator


def annotations(path: Path) -> list[tuple[str, str]]:
    """Every <<expr=result>> in the "answer" fields, split at the last '='."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            for ann in ANNOTATION.findall(json.loads(line)["answer"]):
                expr, _, result = ann.rpartition("=")
                out.append((expr, result))
    return out


def _decimals(text: str) -> int:
    text = text.strip()
    return len(text.split(".", 1)[1]) if "." in text else 0


def classify(calculator, expr: str, result: str, res=None) -> str:
    """One of: 'not plain: ...' (excluded), 'agree', 'agree (annotation rounded)',
    or 'disagree: ...'. res: calculator(expr) if already computed."""
    e = expr.replace(",", "")
    if "**" in e or not set(e) <= PLAIN_CHARS or not any(c.isdigit() for c in e):
        return "not plain: expression syntax"
    r = result.replace(",", "")
    if not NUMBER.match(r):
        return "not plain: result is not a number"
    want = float(r)
    if res is None:
        res = calculator(expr)
    if res.output is None:
        return f"disagree: calculator error ({res.error.split(':')[0]})"
    got = float(res.output)
    if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
        return "agree"
    # Writers rounded to the precision they wrote (3.333, 33.33, 0.67), or to a whole
    # number / cents with truncation; accept round() and truncation at their precision.
    d = _decimals(r)
    for cand in (round(got, d), math.floor(got * 10**d) / 10**d, math.ceil(got * 10**d) / 10**d):
        if math.isclose(cand, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return "agree (annotation rounded)"
    if math.isclose(abs(got), abs(want), rel_tol=REL_TOL, abs_tol=ABS_TOL):
        return "disagree: annotation has the wrong sign"
    # Percent written as a whole: expr gives 0.25, annotation says 25 (or the reverse).
    for scale in (100, 0.01):
        if math.isclose(got * scale, want, rel_tol=1e-4, abs_tol=1e-4):
            return "disagree: annotation off by a factor of 100 (percent)"
    return "disagree: annotation value wrong"


def text_class(output: str, result: str) -> str:
    """For a numerically agreeing pair: how the calculator's text differs from the annotation's
    (the annotation text is what nanochat's GSM8K task trains the model to see after the tool
    call; the calculator prints str(value), as nanochat's eval path does)."""
    if output == result:
        return "same text"
    if float(output) != float(result.replace(",", "")):
        return "float noise in calculator text (e.g. 0.49000000000000005 vs 0.49)"
    if output.endswith(".0") and output[:-2] == result:
        return "calculator X.0, annotation X (float-valued, e.g. from /)"
    if result.startswith("."):
        return "annotation omits the leading 0 (.5)"
    if "." in result and result.endswith("0"):
        return "annotation has trailing zeros (144.00)"
    return "other formatting"


def measure(path: Path = DEFAULT_PATH):
    """Returns (total, Counter of classes, {class: [(expr, result, calculator text)]},
    Counter of text classes over the numerically agreeing annotations)."""
    calculator = _load_calculator()
    anns = annotations(path)
    counts: Counter = Counter()
    texts: Counter = Counter()
    examples: dict[str, list] = defaultdict(list)
    for expr, result in anns:
        res = calculator(expr)  # once: classes and examples must describe the same call
        cls = classify(calculator, expr, result, res)
        counts[cls] += 1
        shown = res.output if res.output is not None else res.error
        if len(examples[cls]) < 50:
            examples[cls].append((expr, result, shown))
        if cls.startswith("agree"):
            tcls = text_class(res.output, result)
            texts[tcls] += 1
            if len(examples[tcls]) < 50:
                examples[tcls].append((expr, result, shown))
    return len(anns), counts, examples, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", nargs="?", default=str(DEFAULT_PATH))
    ap.add_argument("--examples", type=int, default=3)
    args = ap.parse_args()
    total, counts, examples, texts = measure(Path(args.path))
    plain = sum(v for k, v in counts.items() if not k.startswith("not plain"))
    agree = counts["agree"] + counts["agree (annotation rounded)"]
    print(f"total annotations: {total}")
    print(f"plain arithmetic:  {plain}")
    print(f"agreeing:          {agree} ({100 * agree / max(plain, 1):.3f}%)"
          f"  [exact {counts['agree']}, annotation rounded {counts['agree (annotation rounded)']}]")
    for cls, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if cls.startswith("agree"):
            continue
        print(f"  {n:6d}  {cls}")
        for expr, result, out in examples[cls][: args.examples]:
            print(f"            <<{expr}={result}>>  calculator: {out}")
    print("text of the agreeing ones (calculator str() vs annotation result):")
    for cls, n in sorted(texts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:6d}  {cls}")
        if cls != "same text":
            for expr, result, out in examples[cls][: args.examples]:
                print(f"            <<{expr}={result}>>  calculator: {out}")


if __name__ == "__main__":
    main()
