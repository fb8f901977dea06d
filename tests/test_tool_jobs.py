"""Tools in a whole job (`run_job` on a local Ray instance) with a real model, SmolLM2-135M:
tools from the config (function paths, imported on the worker) and from Python (`tools=`),
listed to the model by the chat template, called by the model in the Hermes format, their
results forced into the samples as the template renders them, and every kind of failure
named in the output while the job completes.

The model is made to call: each conversation shows three earlier turns calling the same
tool the same way, and greedy SmolLM2 copies the pattern for the fourth.
"""
from __future__ import annotations

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

_never = threading.Event()


def lookup(key: str) -> str:
    """Look a key up in the table."""
    return f"value-of-{key}"


def hang(key: str) -> str:
    """Wait for a reply that never comes."""
    _never.wait(20)
    return "late"


def boom(key: str) -> str:
    raise KeyError(key)


def conversation(call: str, result: str) -> list[dict]:
    msgs = []
    for i in range(3):
        msgs += [{"role": "user", "content": f"Look up k{i}."},
                 {"role": "assistant", "content": call.replace("KEY", f"k{i}")},
                 {"role": "tool", "content": f"<tool_response>\n{result}\n</tool_response>"},
                 {"role": "assistant", "content": "Done."}]
    return msgs + [{"role": "user", "content": "Look up k3."}]


CASES = {  # prompt id: (the call the conversation shows, what the output must say)
    "ok": ('{"name": "lookup", "arguments": {"key": "KEY"}}', None),
    "missing": ('{"name": "fetch", "arguments": {"key": "KEY"}}', "'no_such_module_xyz:fetch' does not import"),
    "hang": ('{"name": "hang", "arguments": {"key": "KEY"}}', "hang timed out after 0.5 s"),
    "boom": ('{"name": "boom", "arguments": {"key": "KEY"}}', "boom raised KeyError"),
    "json": ("{name: lookup, key: KEY}", "the tool call is not JSON"),
    "unknown": ('{"name": "weather", "arguments": {"city": "KEY"}}', "unknown tool 'weather'"),
}


def test_a_job_runs_tools_and_names_every_failure(tmp_path, ray_local):
    """Every sample calls its tool; the Python tool answers, the others fail each in its way
    (an import failure, a timeout, an exception, bad JSON, an unknown name): the job
    completes, each call is in `tool_calls` with its name, arguments, output or error,
    latency and forced span; the span's tokens are exactly the template's rendering of the
    result, with mask 0 and null logprobs, and every other token has mask 1 and a logprob."""
    from engine.tokenizers.base import Tokenizer
    from engine.loading.builtin import resolve_builtin
    from engine.tool_calls import ToolResponses
    from jobs import run_job

    rows = [{"id": k, "messages": conversation(f"<tool_call>\n{call}\n</tool_call>", "value-of-KEY")}
            for k, (call, _) in CASES.items()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    config = {"model": {"path": "smollm2", "dtype": "float32", "max_seq_len": 1024, "max_num_seqs": 8},
              "input": {"path": str(tmp_path / "in.parquet"), "format": "chat", "id_column": "id"},
              "output": {"path": str(tmp_path / "out")},
              "sampling": {"num_samples": 1, "max_tokens": 60, "temperature": 0.0},
              "tools": {"max_turns": 1, "functions": [
                  {"name": "fetch", "function": "no_such_module_xyz:fetch"},
                  {"name": "hang", "function": "test_tool_jobs:hang", "timeout_s": 0.5},
                  {"name": "boom", "function": "test_tool_jobs:boom"}]}}
    result = run_job(config, tools=[lookup])
    table = result.to_table().to_pylist()
    assert sorted(r["prompt_id"] for r in table) == sorted(CASES) and result.summary["error_rows"] == 0
    tok = Tokenizer.load(resolve_builtin("smollm2"))
    responses = ToolResponses(tok, [])
    for r in table:
        why = CASES[r["prompt_id"]][1]
        (call,) = r["tool_calls"]
        assert (call["error"] is None) if why is None else (why in call["error"]), (r["prompt_id"], call)
        assert call["output"] == ("value-of-k3" if why is None else f"Error: {call['error']}")
        if r["prompt_id"] != "json":
            assert call["name"] == json.loads(CASES[r["prompt_id"]][0])["name"]
            assert json.loads(call["arguments"]) in ({"key": "k3"}, {"city": "k3"})
        assert call["latency_s"] >= (0.5 if r["prompt_id"] == "hang" else 0.0)
        a, b = call["forced_start"], call["end"]
        assert r["tokens"][a:b] == responses.suffix(call["output"])[: b - a]
        assert r["mask"][a:b] == [0] * (b - a) and r["logprobs"][a:b] == [None] * (b - a)
        outside = [i for i in range(len(r["tokens"])) if not a <= i < b]
        assert all(r["mask"][i] == 1 and r["logprobs"][i] is not None for i in outside)
    assert result.summary["tool_calls"] == len(CASES) and result.summary["tool_errors"] == len(CASES) - 1


def test_a_pool_takes_python_tools_and_lists_them_in_chat_prompts(ray_local):
    """GenerationPool(tools=[...]): chat prompts of a call list the tool (Hermes's block in
    SmolLM2's system message) and the model's call is answered in the returned rows."""
    from jobs import GenerationPool

    config = {"model": {"path": "smollm2", "dtype": "float32", "max_seq_len": 1024},
              "sampling": {"num_samples": 1, "max_tokens": 40, "temperature": 0.0}}
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "KEY"}}\n</tool_call>'
    with GenerationPool(config, tools=[lookup]) as pool:
        rows = pool.generate([conversation(call, "value-of-KEY")]).to_pylist()
    (r,) = rows
    from engine.loading.builtin import resolve_builtin
    from engine.tokenizers.base import Tokenizer

    prompt = Tokenizer.load(resolve_builtin("smollm2")).decode(r["prompt_tokens"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "lookup"' in prompt
    (c,) = r["tool_calls"]
    assert (c["name"], c["output"], c["error"]) == ("lookup", "value-of-k3", None)
