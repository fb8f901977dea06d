"""GSM8K with and without a Python `calculate(expression)` tool, called in the Hermes format.

    .venv/bin/python bench/gsm8k_tools.py [--questions 32] [--samples 2] [--max-tokens 256]
                                          [--temperature 0.7] [--model smollm2] [--threads N]

SmolLM2-135M-Instruct (default) answers GSM8K test questions twice, from the same few-shot
examples: once with the `calculate` tool listed in the system prompt (Hermes's <tools> block,
as engine/tool_calls.py writes it for templates that do not read `tools`) and examples that
call it, once with the same examples doing the arithmetic in the text. Prints how many
samples called the tool, how many calls failed, the exact-match accuracy of each run (the
last number of the text against the number after "####"), and checks, for every call, that
its forced tokens are exactly the chat template's rendering of its result
(engine/tool_calls.py ToolResponses) with mask 0, and that no token with mask 0 has a logprob
and every token with mask 1 has one. Exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gsm8k_accuracy import final_number, reference_number  # noqa: E402
from machine import describe  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as "(12 - 5) * 3" and return the number."""
    from engine.tools import calculator

    result = calculator(expression)
    if result.error is not None:
        raise ValueError(result.error)
    return result.output


SHOTS = [  # (question, expression, result, answer text)
    ("Tom has 3 boxes with 12 apples each. He eats 5 apples. How many apples are left?",
     "3 * 12 - 5", "31", "Tom has 31 apples left.\n#### 31"),
    ("A book costs $8 and a pen costs $2. Ann buys 4 books and 3 pens. How much does she pay?",
     "4 * 8 + 3 * 2", "38", "Ann pays $38.\n#### 38"),
    ("A farm has 20 cows. Each cow gives 9 liters of milk a day, and the farmer sells milk for $2 a liter. "
     "How much money does the farmer make in 7 days?", "20 * 9 * 2 * 7", "2520", "The farmer makes $2520.\n#### 2520"),
]


def tool_messages(question: str) -> list[dict]:
    """The few-shot conversation with the tool: each example calls it and reads its result."""
    msgs = [{"role": "system", "content": "You solve math word problems. Use the calculate tool for arithmetic, "
                                          "then give the final answer after ####."}]
    for q, expr, res, ans in SHOTS:
        call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                 {"role": "tool", "content": f"<tool_response>\n{res}\n</tool_response>"},
                 {"role": "assistant", "content": ans}]
    return msgs + [{"role": "user", "content": question}]


def plain_messages(question: str) -> list[dict]:
    """The same examples without the tool: the arithmetic written out."""
    msgs = [{"role": "system", "content": "You solve math word problems, then give the final answer after ####."}]
    for q, expr, res, ans in SHOTS:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f"{expr} = {res}\n{ans}"}]
    return msgs + [{"role": "user", "content": question}]


def check(sample, responses) -> list[str]:
    """What is wrong with a sample's forced tokens, masks and logprobs (empty: nothing)."""
    bad = []
    forced = set()
    for c in sample.tool_calls:
        if c.forced_start is None:
            continue
        span = sample.tokens[c.forced_start:c.end]
        want = responses.suffix(c.output)[: len(span)]
        if span != want:
            bad.append(f"call {c.name}: forced tokens differ from the template's rendering")
        forced.update(range(c.forced_start, c.end))
    for i, (m, lp) in enumerate(zip(sample.mask, sample.logprobs)):
        if (m == 0) != (i in forced) or (m == 0) != (lp is None):
            bad.append(f"token {i}: mask {m}, logprob {lp}, in a forced span: {i in forced}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 on a machine shared with other work: spinning threads collapse)")
    args = ap.parse_args()
    from engine import SamplingParams, load_engine
    from engine.engine import Engine
    from engine.tool_calls import ToolResponses

    rows = [json.loads(line) for line in DATA.open()][: args.questions]
    eng = load_engine(args.model, dtype="float32", max_seq_len=2048, tools=[calculate], num_threads=args.threads)
    print(describe())  # after load_engine has set the thread count
    plain = Engine(eng.model, eng.tokenizer, max_seq_len=2048)  # the same weights, no tools
    schemas = eng.tool_turns.box.schemas()
    params = SamplingParams(num_samples=args.samples, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=50, seed=0)
    ids = [f"q{i}" for i in range(len(rows))]
    results = {}
    for name, engine, build, tools in (("tool", eng, tool_messages, schemas), ("no tool", plain, plain_messages, None)):
        prompts = [engine.tokenizer.render_chat(build(r["question"]), tools=tools) for r in rows]
        t0 = time.perf_counter()
        results[name] = engine.generate(prompts, params, prompt_ids=ids)
        n_tok = sum(len(s.tokens) for out in results[name] for s in out)
        print(f"{name}: {time.perf_counter() - t0:.1f} s, {n_tok} tokens, prompts of {len(prompts[0])} tokens")
    responses = ToolResponses(eng.tokenizer, schemas)
    problems = []
    for name, res in results.items():
        samples = [(r, s) for r, out in zip(rows, res) for s in out]
        correct = sum(final_number(eng.tokenizer.decode(s.tokens)) == reference_number(r["answer"]) for r, s in samples)
        line = f"{name}: accuracy {correct}/{len(samples)} = {correct / len(samples):.1%}"
        if name == "tool":
            calls = [c for _, s in samples for c in s.tool_calls]
            callers = sum(1 for _, s in samples if s.tool_calls)
            answered = [c for c in calls if c.forced_start is not None]
            line += (f"; {callers}/{len(samples)} samples called the tool, {len(calls)} calls, {len(answered)} "
                     f"answered ({sum(c.error is not None for c in answered)} with an error), mean latency "
                     f"{1e3 * sum(c.latency_s or 0 for c in answered) / max(1, len(answered)):.2f} ms")
            with_call = [(r, s) for r, s in samples if s.tool_calls]
            ok = sum(final_number(eng.tokenizer.decode(s.tokens)) == reference_number(r["answer"]) for r, s in with_call)
            line += f"; accuracy of the calling samples {ok}/{len(with_call)}"
            for r, s in samples:
                problems += [f"{s.prompt_id}#{s.sample_index}: {p}" for p in check(s, responses)]
            errors = sorted({c.error for c in calls if c.error})[:5]
            if errors:
                line += f"; errors seen: {errors}"
        print(line)
    print(f"checks: {len(problems)} problems" + "".join(f"\n  {p}" for p in problems[:20]))
    example = next((s for out in results["tool"] for s in out if s.tool_calls), None)
    if example is not None:
        print("example:", json.dumps(eng.tokenizer.decode(example.tokens))[:800])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
