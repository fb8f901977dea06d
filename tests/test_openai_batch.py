"""OpenAI Batch files: the line parser (vLLM's own example file, every kind of malformed line),
the whole pipeline on SmolLM2 in-process (chat template, completions, logprobs, stop strings),
and `batchgen run-batch` on 210 GSM8K lines: every custom_id answered once and in order,
malformed lines as 400 lines, and a driver killed mid-job then rerun giving the same file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.params import SamplingParams
from jobs.inputs.openai_batch import parse_line

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [json.loads(line)["question"] for line in (ROOT / "jobs" / "data" / "gsm8k_demo.jsonl").open()]
BASE = SamplingParams(num_samples=1, max_tokens=256, top_k=0, seed=0)

# vLLM's example batch file (examples/offline_inference/openai_batch/openai_example_batch.jsonl,
# as its documentation shows it)
VLLM_EXAMPLE = """\
{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}
{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}
"""


def line(custom_id="c", url="/v1/chat/completions", **body):
    if url == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Once upon a time")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_vllm_example_file_parses():
    for i, raw in enumerate(VLLM_EXAMPLE.splitlines(), 1):
        p = parse_line(raw.encode(), i, BASE, "example.jsonl")
        assert p.error is None, p.error
        assert (p.custom_id, p.kind, p.model) == (f"request-{i}", "chat", "meta-llama/Meta-Llama-3-8B-Instruct")
        assert p.params.max_tokens == 1000 and p.params.num_samples == 1
        assert [m["role"] for m in p.prompt] == ["system", "user"]


def test_body_parameters_map_to_sampling_params():
    p = parse_line(line(max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, n=3, seed=11,
                        stop="\n\nQ:", logprobs=True, top_logprobs=0, top_k=-1, min_p=0.05, user="u").encode(),
                   1, BASE, "f")
    assert p.error is None and p.logprobs
    sp = p.params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.num_samples, sp.seed, sp.stop, sp.top_k, sp.min_p) == \
        (7, 0.5, 0.9, 3, 11, ("\n\nQ:",), 0, 0.05)
    p = parse_line(line(url="/v1/completions", prompt=[1, 2, 3], logprobs=0, ignore_eos=True, stop=["a", "b"]).encode(),
                   2, BASE, "f")
    assert p.error is None and p.prompt == [1, 2, 3] and p.logprobs
    assert p.params.stop_token_ids == () and p.params.stop == ("a", "b") and p.params.max_tokens == 256
    p = parse_line(line(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]).encode(), 3, BASE, "f")
    assert p.prompt == [{"role": "user", "content": "a\nb"}]
    assert parse_line(line(url="/v1/completions", prompt=["only one"]).encode(), 4, BASE, "f").prompt == "only one"
    # stop strings are matched on the content as vLLM matches them: without special tokens'
    # text unless the line sets skip_special_tokens false (engine/tokenizers/stop_strings.py)
    assert parse_line(line(stop="x").encode(), 5, BASE, "f").params.skip_special_tokens is True
    assert parse_line(line(stop="x", skip_special_tokens=False).encode(), 6, BASE, "f").params.skip_special_tokens is False
    assert parse_line(line().encode(), 7, BASE, "f").params is BASE  # no stop string: nothing to match


@pytest.mark.parametrize("raw, fragment", [
    ("not json", "f line 9: not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "custom_id: must be a non-empty string"),
    (line(extra=1).replace('"body"', '"bodyx"'), "unknown key 'bodyx'"),
    (line().replace('"POST"', '"GET"'), 'method: must be "POST", got \'GET\''),
    (line(url="/v1/embeddings"), "url: '/v1/embeddings' is not supported"),
    (json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": [1]}), "body: must be a JSON object"),
    (line(temperature=-1), "body.temperature: must be a finite number >= 0"),
    (line(n=0), "body.n: must be an integer from 1 to 1,000,000"),
    (line(max_completion_tokens="ten"), "body.max_completion_tokens: must be an integer >= 1"),
    (line(stop=["ok", ""]), "body.stop: must be a non-empty string or a list of them"),
    (line(top_logprobs=21, logprobs=True), "body.top_logprobs: must be an integer from 0 to 20"),
    (line(top_logprobs=3), "body.top_logprobs: needs logprobs true"),
    (line(logprobs=1), "body.logprobs: must be true or false"),
    (line(url="/v1/completions", logprobs=21), "body.logprobs: must be an integer from 0 to 20"),
    (line(presence_penalty=0.5), "body.presence_penalty: 0.5 is not supported"),
    (line(stream=True), "body.stream: True is not supported"),
    (line(tools=[{"type": "function"}]), "body.tools: not supported by batchgen for /v1/chat/completions"),
    (line(response_format={"type": "json_object"}), "body.response_format: not supported"),
    (line(url="/v1/completions", prompt=["a", "b"]), "body.prompt: holds 2 prompts; batchgen takes one prompt per"),
    (line(url="/v1/completions", prompt=""), "body.prompt: is an empty string"),
    (line(url="/v1/completions", prompt=[1, -2]), "body.prompt: token ids must be >= 0"),
    (line(url="/v1/completions", best_of=3, n=1), "body.best_of: 3 is not supported"),
    (line(messages=[]), "body.messages: must be a non-empty list"),
    (line(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "message 0 content part 0: type 'image_url' is not supported"),
    (line(messages=[{"role": "user", "content": None}]), "message 0 (user) has no content"),
    (line(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "message 1 tool call 0: function.arguments is not valid JSON"),
    (line(messages=[{"role": "user", "content": "x", "name": 5}]), "message 0: name must be a string, got 5"),
    (line(tool_choice="required"), "body.tool_choice: 'required' is not supported"),
    (line(chat_template_kwargs={"enable_thinking": False}), "body.chat_template_kwargs: not supported by batchgen"),
    # nested deeper than Python's json can recurse: a 400 line, not a RecursionError ending the job
    (line()[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}}", "f line 9: not valid JSON: nested too deeply"),
    (line(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100000 + "]" * 100000}}]}]),
     "message 1 tool call 0: function.arguments is not valid JSON"),
])
def test_malformed_lines_are_errors_naming_the_field(raw, fragment):
    p = parse_line(raw.encode(), 9, BASE, "f")
    assert p.error is not None and p.params is None
    assert p.error.startswith("f line 9: ") and fragment in p.error, p.error


def test_openai_batch_spec_defaults():
    """num_samples and top_k default to OpenAI's (1, off) for openai_batch unless the config sets them."""
    from jobs.errors import SpecError
    from jobs.spec import JobSpec

    s = JobSpec.from_dict({"input": {"path": "b.jsonl", "format": "openai_batch"}}).sampling
    assert (s.num_samples, s.top_k, s.temperature) == (1, 0, 1.0)
    s = JobSpec.from_dict({"input": {"path": "b.jsonl", "format": "openai_batch"},
                           "sampling": {"num_samples": 2, "top_k": 5}}).sampling
    assert (s.num_samples, s.top_k) == (2, 5)
    with pytest.raises(SpecError, match="input: id_column is not used with format openai_batch"):
        JobSpec.from_dict({"input": {"path": "b.jsonl", "format": "openai_batch", "id_column": "x"}})


def test_openai_batch_config_goes_through_load_job_spec_again(tmp_path):
    """An openai_batch config with a mapping of overrides, and its JobSpec loaded again (what
    jobs.run_job(path, {...}) and run_job(spec) do first), validate: the defaulted
    input.column "body" is not taken as given (openai_batch refuses a given column), and
    OpenAI's sampling defaults stay those of a config that does not set them."""
    from jobs.config import load_job_spec

    cfg = tmp_path / "batch.yaml"
    cfg.write_text(f"model: {{path: tiny-random}}\ninput: {{path: {tmp_path / 'in.jsonl'}, format: openai_batch}}\n")
    spec = load_job_spec(cfg)
    for again in (load_job_spec(cfg, {"output.path": str(tmp_path / "out"), "sampling.seed": 1}),
                  load_job_spec(spec), load_job_spec(spec, {"sampling.seed": 1})):
        s = again.sampling
        assert again.input.column == "body" and (s.num_samples, s.top_k, s.max_tokens) == (1, 0, None)
    assert load_job_spec(spec, {"sampling.seed": 1}).to_dict() == load_job_spec(cfg, ["sampling.seed=1"]).to_dict()


# ------------------------------------------------------------------ SmolLM2, in-process

@pytest.fixture(scope="module")
def smollm2():
    from engine import load_engine

    return load_engine("smollm2", device="cpu", dtype="float32", max_seq_len=512, max_num_seqs=8)


def run_in_process(engine, spec):
    """The job's units through one engine without Ray (what a worker does), then the responses."""
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job, with_chat_template_date
    from jobs.task import JobTask
    from engine.params import RequestOutput, error_output

    spec = with_chat_template_date(spec, None)  # as the runner does for a new output
    plan = plan_job(spec)
    OutputDir(spec.output.path).prepare(plan, spec)
    task = JobTask(spec, plan)
    for unit in plan.units:
        reqs = task.read_unit(unit, engine.tokenizer)
        good = [r for r in reqs if r.prompt_tokens is not None]
        results = engine.generate([r.prompt_tokens for r in good], [r.params for r in good],
                                  prompt_ids=[r.prompt_id for r in good])
        samples = {id(r): res for r, res in zip(good, results)}
        outs = [RequestOutput(None, r.prompt_id, r.prompt_tokens, samples[id(r)]) if r.prompt_tokens is not None
                else error_output(None, r.prompt_id, None, r.params, r.error) for r in reqs]
        task.write_unit(unit, reqs, outs, engine.tokenizer)
    return plan


def test_smollm2_chat_and_completions(smollm2, tmp_path):
    """Chat lines render with SmolLM2's ChatML template and answer as the engine does on the
    same rendered prompt; the EOS token <|im_end|> ends the chat answer (stop_reason null, as
    vLLM says; kept in the dataset's tokens, not in the content or the logprobs); a completion
    stops on a string; a bad line is a 400 between them."""
    from engine.tokenizers.stop_strings import completion_text
    from jobs.outputs.batch_responses import write_responses
    from jobs.outputs.output_dir import OutputDir
    from jobs.spec import JobSpec

    q = QUESTIONS[1]  # SmolLM2 answers it greedily in 101 tokens, <|im_end|> included
    lines = [
        line("chat-1", messages=[{"role": "user", "content": q}], temperature=0, max_completion_tokens=140,
             logprobs=True),
        line("bad", temperature="hot"),
        line("comp-1", url="/v1/completions", prompt="The capital of France is", temperature=0, max_tokens=20,
             stop=[".", "\n"], logprobs=0, model="my-model"),
    ]
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    spec = JobSpec.from_dict({"model": {"path": "smollm2", "max_seq_len": 512},
                              "input": {"path": str(inp), "format": "openai_batch"},
                              "output": {"path": str(tmp_path / "out")}, "cluster": {"unit_rows": 2}})
    plan = run_in_process(smollm2, spec)
    assert len(plan.units) == 2 and OutputDir(spec.output.path).verify() == []
    n = write_responses(spec.output.path, str(tmp_path / "results.jsonl"))
    out = [check_vllm_line(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert n == 3 and [o["custom_id"] for o in out] == ["chat-1", "bad", "comp-1"]

    tok = smollm2.tokenizer
    chat = out[0]["response"]
    assert chat["status_code"] == 200 and out[0]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    (choice,) = body["choices"]
    prompt = tok.render_chat([{"role": "user", "content": q}])
    s = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=140, top_k=0), prompt_ids=["chat-1"])[0][0]
    assert choice["message"] == {"role": "assistant", "content": completion_text(tok, s.tokens, s.stop_reason),
                                 "refusal": None, "annotations": None, "audio": None, "function_call": None}
    assert s.finish_reason == "stop" and s.tokens[-1] == 2  # a trained model ends its answer with <|im_end|>
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)  # EOS, as vLLM reports it
    assert "<|im_end|>" not in choice["message"]["content"] and "bolts" in choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in s.tokens[:-1]]
    assert [c["logprob"] for c in content] == pytest.approx(s.logprobs[:-1], abs=1e-6)
    assert bytes(b for c in content for b in c["bytes"]).decode() == choice["message"]["content"]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(s.tokens),
                             "total_tokens": len(prompt) + len(s.tokens), "prompt_tokens_details": None}

    bad = out[1]
    assert bad["response"] == {"status_code": 400, "request_id": bad["response"]["request_id"], "body": None}
    assert "batch.jsonl line 2: body.temperature: must be a finite number" in bad["error"]["error"]["message"]

    comp = out[2]["response"]["body"]
    assert comp["object"] == "text_completion" and comp["model"] == "my-model"
    (c,) = comp["choices"]
    assert c["finish_reason"] == "stop" and c["stop_reason"] in (".", "\n") and c["stop_reason"] not in c["text"]
    assert "Paris" in c["text"]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]).startswith(c["text"]) and lp["text_offset"][0] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == comp["usage"]["completion_tokens"]


# ------------------------------------------------------------------ run-batch, 210 lines, kill and rerun

def batch_lines() -> tuple[list[str], dict[int, str]]:
    """210 request lines from GSM8K questions (chat, some with n > 1, stop strings, logprobs;
    completions with text and token prompts), a blank line, and malformed lines.
    Returns (lines, {1-based line number: expected error fragment})."""
    lines: list[str] = []
    bad: dict[int, str] = {}
    for i in range(210):
        q = QUESTIONS[i % len(QUESTIONS)]
        body: dict = {"model": "tiny", "max_completion_tokens": 3 + i % 5}
        if i % 7 == 3:
            body["n"] = 2 + i % 2
        if i % 5 == 1:
            body["stop"] = ["e", "\n"]
        if i % 4 == 2:
            body["logprobs"] = True
        if i % 11 == 5:
            body.update(temperature=0.0)
        if i % 13 == 6:
            body.update(top_k=20, min_p=0.01, seed=i)
        if i % 9 == 4:
            comp = {"model": "tiny", "prompt": q if i % 2 else [100, 200, 300 + i], "max_tokens": 4, "logprobs": 0}
            lines.append(line(f"req-{i}", url="/v1/completions", **comp))
        else:
            lines.append(line(f"req-{i}", messages=[{"role": "user", "content": q}], **body))
    malformed = {
        17: ("{not json", "not valid JSON"),
        40: (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}), "custom_id: must be"),
        77: (line("req-bad-url", url="/v1/embeddings"), "url: '/v1/embeddings' is not supported"),
        101: (line("req-top", top_logprobs=25, logprobs=True), "body.top_logprobs: must be an integer from 0 to 20"),
        150: (line("req-temp", temperature=-2), "body.temperature: must be"),
        180: (line("req-7"), "custom_id: 'req-7' is also the custom_id of line"),
        199: (line("req-img", messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "type 'image_url'"),
    }
    for at in sorted(malformed):
        lines.insert(at - 1, malformed[at][0])
        bad[at] = malformed[at][1]
    lines.insert(60, "")  # a blank line: skipped, no response
    bad = {(k if k <= 60 else k + 1): v for k, v in bad.items()}
    return lines, bad


def test_run_batch_210_lines_kill_and_rerun(tmp_path):
    """The reference is the same job run in-process (a unit at a time, one thread, as the
    worker's one CPU): the file of the killed-and-rerun command equals it (its `created`
    aside: each output directory has its own start time)."""
    import torch

    from engine import load_engine
    from jobs.cli import batch_spec
    from jobs.outputs.batch_responses import write_responses
    from jobs.outputs.output_dir import OutputDir
    from conftest import kill_driver_once

    lines, bad = batch_lines()
    assert sum(1 for x in lines if x.strip()) >= 210
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    sets = ["cluster.unit_rows=32", "model.max_num_seqs=64", "sampling.top_k=20"]  # top_k: a fast sampler on 100k tokens

    ref = tmp_path / "ref" / "results.jsonl"
    spec = batch_spec(str(inp), str(ref), model="tiny-random", overrides=sets)
    threads = torch.get_num_threads()
    try:
        run_in_process(load_engine("tiny-random", device="cpu", dtype="auto", num_threads=1), spec)  # the job's dtype
    finally:
        torch.set_num_threads(threads)
    assert OutputDir(spec.output.path).verify() == []
    write_responses(spec.output.path, str(ref))
    out = [check_vllm_line(x) for x in ref.read_text().splitlines()]

    # one response per request line, in input order; 400s exactly for the malformed lines
    request_lines = [(n, x) for n, x in enumerate(lines, 1) if x.strip()]
    assert len(out) == len(request_lines)
    for (n, raw), o in zip(request_lines, out):
        try:
            cid = json.loads(raw).get("custom_id")
        except ValueError:
            cid = None
        assert o["custom_id"] == cid
        if n in bad:
            assert o["response"]["status_code"] == 400 and o["response"]["body"] is None
            message = o["error"]["error"]["message"]
            assert message.startswith(f"batch.jsonl line {n}: ") and bad[n] in message
            continue
        assert o["response"]["status_code"] == 200 and o["error"] is None, o
        req = json.loads(raw)["body"]
        body = o["response"]["body"]
        n_choices = req.get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n_choices))
        limit = req.get("max_completion_tokens") or req.get("max_tokens")
        assert body["usage"]["completion_tokens"] <= limit * n_choices
        for c in body["choices"]:
            text = c["message"]["content"] if "message" in c else c["text"]
            if isinstance(c["stop_reason"], str) and c["stop_reason"] in req.get("stop", []):
                assert c["finish_reason"] == "stop" and c["stop_reason"] not in text
            assert (c["logprobs"] is not None) == ("logprobs" in req)
    assert len({o["id"] for o in out}) == len(out)
    assert sum(len(o["response"]["body"]["choices"]) for o in out if o["response"]["body"]) > len(out) - len(bad)
    assert any(c["stop_reason"] == "e" for o in out if o["response"]["body"] for c in o["response"]["body"]["choices"])

    # the same command in a subprocess, SIGKILLed once a unit is committed, then run again
    work = tmp_path / "killed"
    work.mkdir()
    cmd = [sys.executable, "-m", "jobs.cli", "run-batch", "-i", str(inp), "-o", str(work / "results.jsonl"),
           "--model", "tiny-random"] + [a for s in sets for a in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    dataset = work / "results.parquet"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    kill_driver_once(proc, lambda: bool(list(dataset.glob("part-*.parquet"))), timeout_s=240)
    committed = OutputDir(str(dataset)).committed_units()
    assert 1 <= len(committed) < len(OutputDir(str(dataset)).read_manifest()["units"])
    assert not (work / "results.jsonl").exists()
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    st = OutputDir(str(dataset)).status()
    assert st["success"] and st["summary"]["units_this_run"] == st["units_total"] - len(committed)
    again = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()]

    def without_created(o):
        if o["response"]["body"]:
            o["response"]["body"].pop("created")
        return o

    assert [without_created(o) for o in again] == [without_created(o) for o in out]


# ------------------------------------------------------------------ vLLM's run-batch output (issue 20)

# The chat request lines of vLLM's own run-batch test (INPUT_BATCH in vLLM's
# tests/entrypoints/openai/test_run_batch.py), with our model name in place of theirs
# ("hmellor/tiny-random-LlamaForCausalLM"); request-3 names a model that is not served,
# request-4 an endpoint nobody serves, request-5 asks for a stream (as the string "True").
VLLM_INPUT_BATCH = """\
{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smollm2", "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}}
{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "smollm2", "messages": [{"role": "system", "content": "You are an unhelpful assistant."}, {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}}
{"custom_id": "request-3", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "NonExistModel", "messages": [{"role": "system", "content": "You are an unhelpful assistant."}, {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}}
{"custom_id": "request-4", "method": "POST", "url": "/bad_url", "body": {"model": "smollm2", "messages": [{"role": "system", "content": "You are an unhelpful assistant."}, {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}}
{"custom_id": "request-5", "method": "POST", "url": "/v1/chat/completions", "body": {"stream": "True", "model": "smollm2", "messages": [{"role": "system", "content": "You are an unhelpful assistant."}, {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}}
"""

# The keys vLLM writes, in its order (the field order of its pydantic models: BatchRequestOutput,
# BatchResponseData, ChatCompletionResponse / CompletionResponse and their choices, ChatMessage,
# UsageInfo, ErrorResponse / ErrorInfo), for the fields the OpenAI API defines plus vLLM's
# stop_reason. vLLM adds fields of its own after these (reasoning, token_ids, prompt_logprobs,
# kv_transfer_params, ..., varying by version), which batchgen does not write.
VLLM_KEYS = {
    "line": ["id", "custom_id", "response", "error"],
    "response": ["status_code", "request_id", "body"],
    "body": ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage"],
    "chat_choice": ["index", "message", "logprobs", "finish_reason", "stop_reason"],
    "completion_choice": ["index", "text", "logprobs", "finish_reason", "stop_reason"],
    "message": ["role", "content", "refusal", "annotations", "audio", "function_call"],
    "usage": ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"],
    "error": ["error"],
    "error_info": ["message", "type", "param", "code"],
    "chat_logprobs": ["content"],
    "chat_logprob": ["token", "logprob", "bytes", "top_logprobs"],
    "completion_logprobs": ["text_offset", "token_logprobs", "tokens", "top_logprobs"],
}


def check_vllm_line(raw: str) -> dict:
    """One response line checked against what vLLM's run-batch writes: pydantic's JSON (compact,
    its float and string encoding: the line is byte-identical to pydantic_core.to_json of its
    own value), and vLLM's keys in vLLM's order at every level. Returns the parsed line."""
    import pydantic_core

    o = json.loads(raw)
    assert raw == pydantic_core.to_json(o).decode(), raw
    assert list(o) == VLLM_KEYS["line"]
    assert isinstance(o["id"], str) and o["id"]
    assert list(o["response"]) == VLLM_KEYS["response"]
    assert isinstance(o["response"]["request_id"], str) and o["response"]["request_id"]
    body = o["response"]["body"]
    if body is None:
        assert o["response"]["status_code"] == 400
        assert list(o["error"]) == VLLM_KEYS["error"] and list(o["error"]["error"]) == VLLM_KEYS["error_info"]
        info = o["error"]["error"]
        assert (info["type"], info["code"]) == ("BadRequestError", 400) and isinstance(info["message"], str)
        assert info["param"] is None or isinstance(info["param"], str)
        return o
    assert o["response"]["status_code"] == 200 and o["error"] is None
    assert list(body) == VLLM_KEYS["body"] and body["service_tier"] is None
    chat = body["object"] == "chat.completion"
    assert chat or body["object"] == "text_completion"
    assert list(body["usage"]) == VLLM_KEYS["usage"] and body["usage"]["prompt_tokens_details"] is None
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    for c in body["choices"]:
        assert list(c) == VLLM_KEYS["chat_choice" if chat else "completion_choice"]
        assert c["finish_reason"] in ("stop", "length")
        assert c["finish_reason"] == "stop" or c["stop_reason"] is None
        if chat:
            assert list(c["message"]) == VLLM_KEYS["message"] and c["message"]["role"] == "assistant"
            assert all(c["message"][k] is None for k in VLLM_KEYS["message"][2:])
        if c["logprobs"] is not None:
            if chat:
                assert list(c["logprobs"]) == VLLM_KEYS["chat_logprobs"]
                assert all(list(e) == VLLM_KEYS["chat_logprob"] for e in c["logprobs"]["content"])
            else:
                assert list(c["logprobs"]) == VLLM_KEYS["completion_logprobs"]
    return o


def run_lines(engine, model, tmp_path, lines, sets=()) -> list[str]:
    """The lines through the job's units on `engine` in-process (run_in_process), then the
    response file; returns its lines as written."""
    from jobs.cli import batch_spec
    from jobs.outputs.batch_responses import write_responses

    tmp_path.mkdir(parents=True, exist_ok=True)
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    spec = batch_spec(str(inp), str(tmp_path / "results.jsonl"), model=model,
                      overrides=[f"model.max_seq_len={engine.max_seq_len}", *sets])
    run_in_process(engine, spec)
    write_responses(spec.output.path, str(tmp_path / "results.jsonl"))
    return (tmp_path / "results.jsonl").read_text(encoding="utf-8").splitlines()


def test_vllm_run_batch_input_gives_vllm_shaped_output(smollm2, tmp_path):
    """vLLM's own run-batch test lines give response lines in vLLM's layout: its keys in its
    order at every level, serialized as its pydantic models are (check_vllm_line). The good
    requests answer (their max_tokens 1000 cut by the context window; an EOS stop has
    stop_reason null; usage counts the rendered prompt), the unknown URL and the stream
    request are 400 lines whose error is vLLM's ErrorResponse object, and the unserved model
    name is answered by the job's model (batchgen's documented difference). SmolLM2 with a
    160-token context, greedy, to keep it short."""
    from engine.engine import Engine

    short = Engine(smollm2.model, smollm2.tokenizer, max_seq_len=160, max_num_seqs=8)
    lines = VLLM_INPUT_BATCH.splitlines()
    out = [check_vllm_line(raw) for raw in run_lines(short, "smollm2", tmp_path, lines, ["sampling.temperature=0"])]
    assert [o["custom_id"] for o in out] == [f"request-{i}" for i in range(1, 6)]
    tok = smollm2.tokenizer
    for o, raw in zip(out[:3], lines[:3]):
        req = json.loads(raw)["body"]
        body = o["response"]["body"]
        assert body["model"] == req["model"]
        (c,) = body["choices"]
        assert body["usage"]["prompt_tokens"] == len(tok.render_chat(req["messages"]))
        assert body["usage"]["completion_tokens"] <= short.max_seq_len - body["usage"]["prompt_tokens"]
        assert c["stop_reason"] is None  # the EOS token <|im_end|> or the context window ended it
        assert "<|im_end|>" not in c["message"]["content"] and "<|im_start|>" not in c["message"]["content"]
    assert any(o["response"]["body"]["choices"][0]["finish_reason"] == "stop" for o in out[:3])
    bad_url, stream = out[3]["error"]["error"], out[4]["error"]["error"]
    assert bad_url["message"].startswith("batch.jsonl line 4: url: '/bad_url' is not supported"), bad_url
    assert stream["message"].startswith("batch.jsonl line 5: body.stream: 'True' is not supported"), stream
    assert stream["param"] == "stream"


@pytest.fixture(scope="module")
def tiny():
    from engine import load_engine

    return load_engine("tiny-random", device="cpu", dtype="float32", max_seq_len=300, max_num_seqs=8)


def test_line_without_max_tokens_generates_to_the_context_limit(tiny, tmp_path):
    """A chat line without max_tokens generates until the context window ends it (model.max_seq_len
    minus the prompt), as vLLM and the OpenAI API do, not the job's 256; a completions line
    without one gets 16, the OpenAI completions default that vLLM keeps; a job that sets
    sampling.max_tokens gives that to both; a line's own max_completion_tokens wins."""
    from jobs.spec import JobSpec

    lines = [line("chat", ignore_eos=True), line("comp", url="/v1/completions", prompt=[100, 200, 300], ignore_eos=True),
             line("five", ignore_eos=True, max_completion_tokens=5)]
    sets = ["sampling.top_k=20"]  # a fast sampler on tiny-random's 100k tokens
    out = [json.loads(raw) for raw in run_lines(tiny, "tiny-random", tmp_path / "a", lines, sets)]
    usage = [o["response"]["body"]["usage"] for o in out]
    assert usage[0]["prompt_tokens"] + usage[0]["completion_tokens"] == tiny.max_seq_len, usage[0]
    assert usage[0]["completion_tokens"] > 256
    assert usage[1]["completion_tokens"] == 16 and usage[2]["completion_tokens"] == 5
    assert [o["response"]["body"]["choices"][0]["finish_reason"] for o in out] == ["length"] * 3

    out = [json.loads(raw) for raw in run_lines(tiny, "tiny-random", tmp_path / "b", lines, [*sets, "sampling.max_tokens=40"])]
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == [40, 40, 5]
    # the spec's own default: null, the context window (each endpoint's default in the parser)
    assert JobSpec.from_dict({"input": {"path": "b.jsonl", "format": "openai_batch"}}).sampling.max_tokens is None


def test_error_line_is_vllm_error_response(tiny, tmp_path):
    """A refused line is written as vLLM writes a request its server refuses: status_code 400,
    body null, and `error` holding vLLM's ErrorResponse, {"error": {"message", "type":
    "BadRequestError", "param": the body field or null, "code": 400}}."""
    lines = [line("bad", temperature=-1), line("ok", max_completion_tokens=2), "{not json"]
    raws = run_lines(tiny, "tiny-random", tmp_path, lines)
    out = [check_vllm_line(raw) for raw in raws]
    assert out[0]["response"]["body"] is None and out[0]["response"]["status_code"] == 400
    assert out[0]["error"] == {"error": {"message": out[0]["error"]["error"]["message"], "type": "BadRequestError",
                                         "param": "temperature", "code": 400}}
    assert out[0]["error"]["error"]["message"].startswith("batch.jsonl line 1: body.temperature: must be")
    assert out[1]["error"] is None
    assert out[2]["custom_id"] is None and out[2]["error"]["error"]["param"] is None
    assert raws[0].startswith('{"id":"batch_req_') and raws[0].endswith(',"code":400}}}')


def _formatted(tok, raw: str, tokens: list[int], finish: str, stop_reason) -> dict:
    """The choice object a worker stores for one sample of the request line `raw` (the parser,
    then jobs.outputs.batch_responses.sample_columns with the text the worker decodes)."""
    from engine.params import Sample
    from engine.tokenizers.stop_strings import completion_text
    from jobs.inputs.openai_batch import BatchPlan, BatchReader
    from jobs.outputs.batch_responses import sample_columns

    req = BatchReader(BatchPlan(name="f"))._request(raw.encode(), 1, BASE, tok, None, tok.vocab_size)
    assert req.error is None, req.error
    s = Sample(prompt_id="c", sample_index=0, tokens=tokens, mask=[1] * len(tokens), logprobs=[-0.5] * len(tokens),
               finish_reason=finish, stop_reason=stop_reason)
    return json.loads(sample_columns(req, s, completion_text(tok, s.tokens, s.stop_reason), tok)["choice"])


def test_eos_stop_reason_is_null_and_a_stop_token_is_its_id(smollm2):
    """stop_reason as vLLM reports it: null for a stop on the model's EOS token (SmolLM2's
    <|im_end|>), the token id (an int) for a stop on another stop token the request listed,
    the string for a stop string; never the stop token's text."""
    tok = smollm2.tokenizer
    eos, im_start = tok.eos_token_id, tok.special("<|im_start|>")
    hi = tok.encode("Hi there")
    c = _formatted(tok, line(), hi + [eos], "stop", eos)
    assert (c["message"]["content"], c["finish_reason"], c["stop_reason"]) == ("Hi there", "stop", None)
    c = _formatted(tok, line(stop_token_ids=[im_start]), hi + [im_start], "stop", im_start)
    assert (c["message"]["content"], c["stop_reason"]) == ("Hi there", im_start)
    c = _formatted(tok, line(url="/v1/completions", stop=" there"), hi, "stop", " there")
    assert (c["text"], c["stop_reason"]) == ("Hi", " there")
    c = _formatted(tok, line(ignore_eos=True), hi, "length", None)
    assert c["stop_reason"] is None


def test_special_tokens_are_skipped_in_content(smollm2):
    """The content (chat) and text (completions) skip special tokens, as vLLM's
    skip_special_tokens (default true) does; a line with skip_special_tokens false keeps
    them. The logprobs still list every generated token but the stop token."""
    tok = smollm2.tokenizer
    eos, im_start = tok.eos_token_id, tok.special("<|im_start|>")
    toks = tok.encode("Hi") + [eos, im_start] + tok.encode("user\nMore") + [eos]
    c = _formatted(tok, line(logprobs=True), toks, "stop", eos)
    assert c["message"]["content"] == "Hiuser\nMore"
    assert [e["token"] for e in c["logprobs"]["content"]] == [tok.decode([t]) for t in toks[:-1]]
    c = _formatted(tok, line(url="/v1/completions"), toks, "stop", eos)
    assert c["text"] == "Hiuser\nMore"
    c = _formatted(tok, line(skip_special_tokens=False), toks, "stop", eos)
    assert c["message"]["content"] == "Hi<|im_end|><|im_start|>user\nMore"
    bang = tok.encode("!")[0]  # a stop token that is not special, one special token before it
    c = _formatted(tok, line(stop_token_ids=[bang]), tok.encode("Hi") + [im_start] + tok.encode("user") + [bang],
                   "stop", bang)
    assert (c["message"]["content"], c["stop_reason"]) == ("Hiuser", bang)


TOOL_TEMPLATE = ("{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
                 "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]"
                 "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_messages_with_name_tool_calls_and_tool_call_id_reach_the_chat_template(smollm2):
    """A conversation with a named user, an assistant tool call (content null, arguments as the
    OpenAI JSON string) and the tool's answer is accepted and rendered by the model's chat
    template with those fields, the arguments as an object (as vLLM hands them to
    transformers' templates); Qwen2.5's real template renders the call."""
    from engine.tokenizers.hf_tokenizer import HFTokenizer
    from hf_cases import QWEN25_TEMPLATE
    from jobs.inputs.openai_batch import BatchPlan, BatchReader

    base = smollm2.tokenizer
    messages = [{"role": "user", "name": "ann", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    raw = line(messages=messages).encode()
    p = parse_line(raw, 1, BASE, "f")
    assert p.error is None, p.error
    for template, expected in [
        (TOOL_TEMPLATE, "<user name=ann>Weather in Paris?\n<assistant>[call call_1 get_weather {\"city\": \"Paris\"}]\n"
                        "<tool id=call_1>22C\n<assistant>"),
        (QWEN25_TEMPLATE, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22C\n"
                          "</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ]:
        tok = HFTokenizer(base.backend, special_tokens_map=base.special_tokens_map, chat_template=template, name="t")
        req = BatchReader(BatchPlan(name="f"))._request(raw, 1, BASE, tok, None, tok.vocab_size)
        assert req.error is None, req.error
        assert tok.decode(req.prompt_tokens).endswith(expected), tok.decode(req.prompt_tokens)


def test_unknown_body_and_message_keys_are_ignored_with_a_warning(tmp_path):
    """Body keys that neither the OpenAI API nor vLLM define, and message keys batchgen does not
    pass to the template, are ignored with a warning naming them and their lines (vLLM logs
    "fields were present in the request but ignored"), not refused; what batchgen cannot
    compute (tools, penalties, ...) is still refused for its line."""
    from jobs.inputs.openai_batch import BatchReader
    from jobs.spec import JobSpec

    lines = [line("a", my_tag="x", messages=[{"role": "user", "content": "Hi", "weight": 1}]),
             line("b", my_tag="y", vllm_xargs={"k": 1}), line("c", tools=[{"type": "function"}])]
    for n, raw in enumerate(lines[:2], 1):
        p = parse_line(raw.encode(), n, BASE, "f")
        assert p.error is None, p.error
    assert "body.tools" in parse_line(lines[2].encode(), 3, BASE, "f").error
    inp = tmp_path / "batch.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    spec = JobSpec.from_dict({"input": {"path": str(inp), "format": "openai_batch"}})
    warnings = BatchReader().scan(spec).warnings
    assert any("body.my_tag" in w and "2 lines" in w and "first line 1" in w for w in warnings), warnings
    assert any("body.vllm_xargs" in w and "line 2" in w for w in warnings), warnings
    assert any("messages[].weight" in w and "line 1" in w for w in warnings), warnings
    assert not any("tools" in w for w in warnings), warnings


def test_null_parameters_are_their_defaults():
    """A null body parameter or message key is the parameter left out, as the OpenAI API and
    vLLM read null: `"n": null, "best_of": 1` runs with n 1 (it was refused), null sampling
    values keep the job's, a message's null name / tool_calls / tool_call_id (as a message
    copied from an API response has) are absent, and an unknown key set to null is not
    warned about. best_of must equal the line's n after its defaults (the job's num_samples
    for a null or absent n)."""
    comp = dict(url="/v1/completions", n=None, best_of=1, max_tokens=None, temperature=None, top_p=None, stop=None,
                seed=None, top_k=None, min_p=None, stop_token_ids=None, logprobs=None, echo=None, suffix=None,
                ignore_eos=None, skip_special_tokens=None, presence_penalty=None, my_tag=None)
    p = parse_line(line(**comp).encode(), 1, BASE, "f")
    assert p.error is None, p.error
    assert p.params == BASE and not p.logprobs and p.skip_special_tokens and p.ignored == []
    msgs = [{"role": "user", "content": "Hi", "name": None},
            {"role": "assistant", "content": "Hello", "tool_calls": None, "refusal": None, "function_call": None},
            {"role": "tool", "content": "1", "tool_call_id": None}]
    p = parse_line(line(messages=msgs, n=None, max_completion_tokens=None, max_tokens=5, tools=None,
                        response_format=None, top_logprobs=None).encode(), 2, BASE, "f")
    assert p.error is None, p.error
    assert p.params == SamplingParams(num_samples=1, max_tokens=5, top_k=0, seed=0) and p.ignored == []
    assert p.prompt == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                        {"role": "tool", "content": "1"}]
    two = SamplingParams(num_samples=2, max_tokens=256, top_k=0, seed=0)  # a job with sampling.num_samples 2
    assert parse_line(line(url="/v1/completions", best_of=2).encode(), 3, two, "f").error is None
    assert "body.best_of: 1 is not supported (only best_of = n, here 2)" in \
        parse_line(line(url="/v1/completions", best_of=1, n=None).encode(), 4, two, "f").error


class _ByteTok:
    """A tokenizer for reading units without a model: bytes + 10."""

    vocab_size = 300
    bos_token_id = None
    prepend_bos = False

    def encode(self, s):
        return [b + 10 for b in s.encode()]


def test_a_deeply_nested_line_is_an_error_line_and_the_others_run(tmp_path):
    """A line nested deeper than Python's json decoder can recurse (100,000 "[") is that line's
    400, as malformed JSON is: the scan raised RecursionError, which ended `run-batch` with a
    traceback (exit 1) before any line ran."""
    from jobs.inputs import reader_for
    from jobs.spec import JobSpec

    deep = line("deep", url="/v1/completions")[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}}"
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([line("a", url="/v1/completions"), deep, line("c", url="/v1/completions")]) + "\n")
    spec = JobSpec.from_dict({"input": {"path": str(inp), "format": "openai_batch"}})
    scan = reader_for(spec).scan(spec)
    assert scan.expected_rows == {0: 3}
    reqs = reader_for(spec, None, scan.reader_state).read_unit(scan.units[0], _ByteTok(), spec.sampling_params())[0]
    assert [(r.prompt_id, r.error) for r in reqs] == [
        ("a", None), ("in.jsonl:2", "in.jsonl line 2: not valid JSON: nested too deeply"), ("c", None)]
    assert reqs[0].prompt_tokens == reqs[2].prompt_tokens == _ByteTok().encode("Once upon a time")


def test_fallback_prompt_ids_never_equal_a_custom_id(tmp_path):
    """A line without a usable custom_id (or a repeat of one) gets the prompt id
    "<file>:<line>", or "<file>:<line>#k" where another line's custom_id is that text, so no
    two rows share a prompt id (and sampling noise): `verify` failed a clean run whose
    line 1 had custom_id "in.jsonl:2" and line 2 an empty one. The ids are the same on
    every scan (a resume reads the same ones)."""
    from jobs.inputs import reader_for
    from jobs.spec import JobSpec

    lines = [line("in.jsonl:2", url="/v1/completions"), line("", url="/v1/completions"),
             line("in.jsonl:2#1", url="/v1/completions"), line("c", url="/v1/completions"),
             line("c", url="/v1/completions"), "{not json", line("in.jsonl:6", url="/v1/completions")]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    spec = JobSpec.from_dict({"input": {"path": str(inp), "format": "openai_batch"}, "cluster": {"unit_rows": 3}})
    ids = []
    for _ in range(2):
        scan = reader_for(spec).scan(spec)
        reader = reader_for(spec, None, scan.reader_state)
        ids.append([(r.prompt_id, r.passthrough["custom_id"], r.error is not None) for u in scan.units
                    for r in reader.read_unit(u, _ByteTok(), spec.sampling_params())[0]])
    assert ids[0] == ids[1] == [("in.jsonl:2", "in.jsonl:2", False), ("in.jsonl:2#2", None, True),
                                ("in.jsonl:2#1", "in.jsonl:2#1", False), ("c", "c", False),
                                ("in.jsonl:5", "c", True), ("in.jsonl:6#1", None, True),
                                ("in.jsonl:6", "in.jsonl:6", False)]


def test_errors_leave_credentials_in_the_uri_out(tmp_path):
    """Credentials written into an object store URI (s3://KEY:SECRET@bucket/...) are left out of
    the messages, as for Parquet input: the scan's errors and write_responses' printed the URI as
    given, secret and all, on stderr."""
    import signal
    import threading

    pytest.importorskip("moto")
    import pyarrow.fs as pafs

    from conftest import free_port
    from jobs.errors import InputError
    from jobs.inputs import reader_for
    from jobs.spec import JobSpec

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for out in proc.stdout:  # the server prints its address once it listens
            if f"Running on http://127.0.0.1:{port}" in out:
                break
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", allow_bucket_creation=True,
                               access_key="KEYID", secret_key="THE-SECRET", region="us-east-1")
        fs.create_dir("bkt")
        with fs.open_output_stream("bkt/blank.jsonl") as f:
            f.write(b"\n\n")
        for name, fragment in [("missing.jsonl", ": no such file"), ("blank.jsonl", ": no request lines")]:
            path = f"s3://KEYID:THE-SECRET@bkt/{name}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
            spec = JobSpec.from_dict({"input": {"path": path, "format": "openai_batch"},
                                      "output": {"path": str(tmp_path / "out")}})
            with pytest.raises(InputError) as e:
                reader_for(spec).scan(spec)
            assert str(e.value).startswith(f"input.path s3://bkt/{name}?endpoint_override=") and fragment in str(e.value)
            assert "THE-SECRET" not in str(e.value), str(e.value)
        # the response file's errors too (here: an output that is no batchgen job's)
        from jobs.errors import OutputError
        from jobs.outputs.batch_responses import write_responses

        with pytest.raises(OutputError) as e:
            write_responses(f"s3://KEYID:THE-SECRET@bkt/nojob?endpoint_override=127.0.0.1:{port}&scheme=http"
                            f"&region=us-east-1", str(tmp_path / "results.jsonl"))
        assert "s3://bkt/nojob?" in str(e.value) and "THE-SECRET" not in str(e.value), str(e.value)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_run_batch_prints_its_output_without_credentials(tmp_path, monkeypatch, capsys):
    """`run-batch`'s closing line names the response file with a URI's credentials left out
    (it printed s3://KEY:SECRET@... as given)."""
    import jobs.outputs.batch_responses as responses
    import jobs.runner as runner
    from jobs.cli import run_batch

    batch = tmp_path / "in.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "m", "prompt": "hi", "max_tokens": 2}}) + "\n")
    monkeypatch.setattr(runner, "run_job", lambda spec, **kw: None)  # the job itself is tested above
    monkeypatch.setattr(responses, "write_responses", lambda job_output, output: 1)
    out = "s3://KEYID:THE-SECRET@bkt/out.jsonl?endpoint_override=127.0.0.1:9&scheme=http"
    assert run_batch(str(batch), out, model="tiny-random", output_dir=str(tmp_path / "job")) == 0
    printed = capsys.readouterr().out
    assert "wrote 1 responses to s3://bkt/out.jsonl?endpoint_override=" in printed and "THE-SECRET" not in printed


def test_lone_surrogates_are_that_lines_error_and_the_others_run(tiny, tmp_path):
    r"""JSON's \u escapes can spell a lone UTF-16 surrogate ("\udc80"), which is no Unicode text:
    pydantic (vLLM's reader) refuses such a line. batchgen took it, and a custom_id or model
    holding one ended the unit when its Parquet rows were written, a stop string holding one
    ended the engine's step (UnicodeEncodeError): one line cost the whole job. Now it is that
    line's 400, naming the line and the field (a usable custom_id is still echoed); a
    surrogate pair (an emoji, escaped) is ordinary text."""
    good = line("ok", url="/v1/completions", prompt=[100, 200], max_tokens=2, ignore_eos=True)
    lines = [good.replace('"ok"', '"sur\\udc80"'),
             good.replace('"ok"', '"model"').replace('"prompt"', '"model": "m\\ud800", "prompt"'),
             good.replace('"ok"', '"stop"').replace('"prompt"', '"stop": ["a", "\\udc80"], "prompt"'),
             line("chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2).replace('"hi"', '"hi\\udc80"'),
             good.replace('"ok"', '"pair \\ud83d\\ude00"'), good]
    out = [check_vllm_line(raw) for raw in run_lines(tiny, "tiny-random", tmp_path, lines, ["sampling.top_k=20"])]
    errors = [(o["custom_id"], o["error"]["error"]["message"], o["error"]["error"]["param"]) for o in out[:4]]
    assert errors == [
        (None, "batch.jsonl line 1: custom_id: holds a lone UTF-16 surrogate (\\udc80), which is not Unicode text",
         None),
        ("model", "batch.jsonl line 2: body.model: holds a lone UTF-16 surrogate (\\ud800), which is not Unicode "
                  "text", "model"),
        ("stop", "batch.jsonl line 3: body.stop[1]: holds a lone UTF-16 surrogate (\\udc80), which is not Unicode "
                 "text", "stop"),
        ("chat", "batch.jsonl line 4: body.messages[0].content: holds a lone UTF-16 surrogate (\\udc80), which is "
                 "not Unicode text", "messages")]
    assert [o["custom_id"] for o in out[4:]] == ["pair \U0001F600", "ok"]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 2 for o in out[4:])


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-32"])
def test_a_lone_surrogate_in_the_lines_bytes_is_that_lines_error_too(encoding):
    r"""json.loads decodes a line's bytes with surrogatepass: a lone surrogate written as bytes
    (UTF-8's ED B2 80, no \u escape; a UTF-16 or UTF-32 line's lone code unit) was decoded into
    the custom_id or prompt and the line ran, and writing the unit's rows raised
    UnicodeEncodeError (the whole unit, then the job, failed for one line). It is the line's
    error, as for an escaped one; text that is not ASCII still runs."""
    good = json.dumps({"custom_id": "ok é", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "p 😀", "max_tokens": 2}}, ensure_ascii=False)
    for where, bad in [("custom_id", good.replace("ok é", "s\udc80")), ("body.prompt", good.replace("p 😀", "a\ud800"))]:
        p = parse_line(bad.encode(encoding, "surrogatepass"), 3, BASE, "f")
        surrogate = "\\udc80" if where == "custom_id" else "\\ud800"
        assert p.error == f"f line 3: {where}: holds a lone UTF-16 surrogate ({surrogate}), which is not Unicode text"
        assert p.params is None and p.custom_id == (None if where == "custom_id" else "ok é")
    p = parse_line(good.encode(encoding), 4, BASE, "f")
    assert p.error is None and (p.custom_id, p.prompt) == ("ok é", "p 😀")


def test_a_prompt_the_engine_refuses_names_the_line_and_field(tiny, tmp_path):
    """A prompt longer than the context window is refused by the engine, whose message named
    neither the file, the line nor the field ("prompt has 301 tokens, more than the context
    window of 300 tokens", param null): the response line now names all three, as the
    parser's errors do, and param is the prompt's field."""
    lines = [line("long-chat", messages=[{"role": "user", "content": "word " * 400}]),
             line("long-comp", url="/v1/completions", prompt=[100] * 301),
             line("ok", url="/v1/completions", prompt=[100] * 10, max_tokens=2, ignore_eos=True)]
    out = [check_vllm_line(raw) for raw in run_lines(tiny, "tiny-random", tmp_path, lines, ["sampling.top_k=20"])]
    chat, comp = out[0]["error"]["error"], out[1]["error"]["error"]
    assert chat["message"].startswith("batch.jsonl line 1: body.messages: prompt has ") and chat["param"] == "messages"
    assert comp["message"] == ("batch.jsonl line 2: body.prompt: prompt has 301 tokens, more than the context window "
                               "of 300 tokens") and comp["param"] == "prompt"
    assert out[2]["error"] is None and out[2]["response"]["body"]["usage"]["completion_tokens"] == 2


def test_a_line_longer_than_many_chunks_keeps_exact_offsets():
    """A line longer than a read chunk was re-joined and re-split at every chunk (quadratic: a
    128 MiB line took 14 s to scan; now its chunks are joined once, at its newline: 0.7 s; no
    timing here, the project keeps speed in bench/). Read in 4 KiB chunks, an 8 MiB line's
    offsets and line numbers stay exact, a CR LF split across two chunks included."""
    import io

    from jobs.inputs.openai_batch import _iter_lines

    data = b"x" * (8 << 20) + b"\r\n" + b"y\n" + b"z" * 5000
    got = [(s, e, n, len(raw)) for s, e, n, raw in _iter_lines(io.BytesIO(data), chunk=4096)]
    big = (8 << 20) + 2
    assert got == [(0, big, 1, 8 << 20), (big, big + 2, 2, 1), (big + 2, big + 5002, 3, 5000)]
    small = [(s, e, n, raw) for s, e, n, raw in _iter_lines(io.BytesIO(b"ab\r\ncd\n\nef"), first_line=7, offset=10,
                                                           chunk=3)]
    assert small == [(10, 14, 7, b"ab"), (14, 17, 8, b"cd"), (17, 18, 9, b""), (18, 20, 10, b"ef")]


def test_run_batch_refuses_to_write_the_responses_over_its_input(tiny, tmp_path, monkeypatch):
    """`run-batch -i batch.jsonl -o batch.jsonl` (or -o another name of the same file) ran the
    job and then replaced the request file with the responses: the requests were gone. Now it
    is refused before the job runs (exit 2), naming both paths, and the file is untouched."""
    import jobs.runner as runner
    from jobs.cli import run_batch
    from jobs.errors import SpecError

    inp = tmp_path / "batch.jsonl"
    text = line("a", url="/v1/completions", prompt=[100, 200], max_tokens=2) + "\n"
    inp.write_text(text)
    (tmp_path / "link.jsonl").symlink_to(inp)
    ran = []
    monkeypatch.setattr(runner, "run_job", lambda spec, **kw: ran.append(run_in_process(tiny, spec)))
    for out in (inp, tmp_path / "." / "batch.jsonl", tmp_path / "link.jsonl"):
        with pytest.raises(SpecError, match=r"run-batch: -o .* is the input file -i .*; the responses would "
                                            r"replace the requests"):
            run_batch(str(inp), str(out), model="tiny-random", overrides=["model.max_seq_len=300"])
    assert ran == [] and inp.read_text() == text
    assert run_batch(str(inp), str(tmp_path / "results.jsonl"), model="tiny-random",
                     overrides=["model.max_seq_len=300"]) == 0
    assert json.loads((tmp_path / "results.jsonl").read_text())["custom_id"] == "a" and inp.read_text() == text


def test_a_resume_with_retrained_weights_is_refused(tmp_path):
    """An openai_batch job's fingerprint leaves the checkpoint's content hashes out (so outputs
    of earlier releases still resume), so weights retrained to the same file sizes used to
    resume silently into rows of two models. The manifest keeps the hashes instead: the
    same job resumes while the files are unchanged, and with a file's content changed (its
    size and modification time kept) `run` and `plan` refuse it (exit 2) naming the file,
    until --overwrite. A Parquet job's manifest does not repeat them: its fingerprint holds them."""
    from jobs.config import load_job_spec
    from jobs.errors import OutputError
    from jobs.outputs.layout import MANIFEST
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job, with_chat_template_date
    from jobs.plan.report import describe_plan

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"a" * 64)
    (ckpt / "config.json").write_text("{}")
    (tmp_path / "in.jsonl").write_text(line("a") + "\n" + line("b") + "\n")
    spec = with_chat_template_date(load_job_spec({
        "model": {"path": str(ckpt)}, "input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out")}}), None)
    od = OutputDir(spec.output.path)
    plan = plan_job(spec)
    assert od.prepare(plan, spec) == "new"
    assert set(json.loads((tmp_path / "out" / MANIFEST).read_text())["checkpoint_sha256"]["sha256"]) == {
        "config.json", "model.safetensors"}
    assert od.prepare(plan_job(spec), spec) == "resume"

    st = os.stat(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").write_bytes(b"b" * 64)  # retrained: same size, old mtime
    os.utime(ckpt / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    retrained = plan_job(spec)
    assert retrained.fingerprint == plan.fingerprint
    with pytest.raises(OutputError, match="generated with other weights: the content of model.safetensors changed"):
        od.prepare(retrained, spec)
    text, code = describe_plan(spec)
    assert code == 2 and "model.safetensors changed" in text, text
    assert od.prepare(retrained, spec, overwrite=True) == "overwrite"
    assert od.prepare(plan_job(spec), spec) == "resume"
    # an output written before the manifest kept them resumes, and is checked from then on
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    (tmp_path / "out" / MANIFEST).write_text(json.dumps({k: v for k, v in m.items() if k != "checkpoint_sha256"}))
    assert od.prepare(plan_job(spec), spec) == "resume"
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == m

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in.parquet")
    parquet = load_job_spec({"model": {"path": str(ckpt)}, "input": {"path": str(tmp_path / "in.parquet")},
                             "output": {"path": str(tmp_path / "out2")}})
    OutputDir(parquet.output.path).prepare(plan_job(parquet), parquet)
    manifest = json.loads((tmp_path / "out2" / MANIFEST).read_text())
    assert "checkpoint_sha256" not in manifest and "model.safetensors" in manifest["fingerprint_data"]["model"]["sha256"]
