"""Exact-match accuracy of the final number in a batchgen GSM8K output.

    python bench/gsm8k_accuracy.py out/gsm8k [--show 3]

Reads the output dataset (one row per sample; the reference solution in the passthrough
column `answer`, whose final number follows "####", as GSM8K writes it) and counts a sample
correct when the last number in its generated `text` equals the reference number (commas,
a leading "$" and a trailing ".0" ignored). Prints the accuracy over samples, the finish
reasons, and (with --show) a few examples.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from decimal import Decimal, InvalidOperation

import pyarrow.dataset as ds

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _normalise(s: str) -> Decimal | None:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Decimal(s).normalize()
    except InvalidOperation:
        return None


def final_number(text: str | None) -> Decimal | None:
    """The last number written in `text` (None if there is none)."""
    found = _NUMBER.findall(text or "")
    return _normalise(found[-1]) if found else None


def reference_number(answer: str) -> Decimal | None:
    """GSM8K's reference: the number after the final '####'."""
    return _normalise(answer.rsplit("####", 1)[-1]) if "####" in answer else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", help="batchgen output directory (output.path)")
    ap.add_argument("--show", type=int, default=0, help="print this many examples")
    args = ap.parse_args()
    rows = ds.dataset(args.output, format="parquet").to_table(
        columns=["prompt_id", "sample_index", "text", "answer", "finish_reason", "num_tokens"]).to_pylist()
    if not rows:
        raise SystemExit(f"{args.output}: no rows")
    correct = 0
    for r in rows:
        r["ok"] = final_number(r["text"]) is not None and final_number(r["text"]) == reference_number(r["answer"])
        correct += r["ok"]
    n = len(rows)
    tokens = sum(r["num_tokens"] for r in rows)
    print(f"samples: {n}  correct: {correct}  exact-match accuracy: {correct / n:.1%}")
    print(f"finish reasons: {dict(Counter(r['finish_reason'] for r in rows))}  generated tokens: {tokens} "
          f"({tokens / n:.0f} per sample)")
    for r in sorted(rows, key=lambda r: (r["prompt_id"], r["sample_index"]))[: args.show]:
        print(f"\n--- {r['prompt_id']} #{r['sample_index']} ({'correct' if r['ok'] else 'wrong'}; reference "
              f"{reference_number(r['answer'])}, got {final_number(r['text'])})\n{r['text']}")


if __name__ == "__main__":
    main()
