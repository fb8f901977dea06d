"""Error messages echo an offending value bounded: a huge value (a 5 MB string where a number
is expected, a row's sampling-parameter column holding a long string) appears as its first
200 characters of repr and its length, in every layer that formats one: the engine's
sampling rules (engine/params.py shown), the job spec and config (jobs/errors.py shown), a
row's sampling struct, chat messages and OpenAI batch lines. Each was echoed whole: the
console and the output's error column got megabytes."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from engine.params import SAMPLING_FIELDS, SamplingParams, check_sampling_value
from jobs.errors import InputError, SpecError, shown
from jobs.spec import FunctionToolSpec, JobSpec, ModelSpec, spec_sections

HUGE = "x" * 5_000_000
BOUND = 1000  # characters: a message with a bounded echo, its prefix and its explanation


def test_shown_bounds_the_repr_and_says_how_long_the_value_was():
    import engine.params

    for helper in (shown, engine.params.shown):  # one per layer: the engine imports nothing of jobs
        assert helper("abc") == "'abc'" and helper(1.5) == "1.5" and helper([1, 2]) == "[1, 2]"
        assert helper(HUGE) == repr(HUGE)[:200] + "... (5,000,000 characters)"
        assert helper(list(range(100_000))).endswith(f"... ({len(repr(list(range(100_000)))):,} characters)")
        assert helper(10 ** 5000) == "an integer of 16,610 bits"  # repr refuses over 4,300 digits


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_engine_sampling_rules_bound_the_value(name):
    with pytest.raises(ValueError) as e:
        check_sampling_value(name, [HUGE] if name in ("stop_token_ids",) else 10 ** 5000 if name == "seed" else
                             ["", HUGE] if name == "stop" else HUGE if name != "stop" else None)
    assert len(str(e.value)) < BOUND, str(e.value)[:300]
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=HUGE)
    assert len(str(e.value)) < BOUND and str(e.value).endswith("... (5,000,000 characters)")


def _all_keys():
    for section, model in spec_sections().items():
        for name in model.model_fields:
            if (section, name) != ("tools", "functions"):
                yield section, name
    for name in FunctionToolSpec.model_fields:
        yield "tools.functions", name


@pytest.mark.parametrize("section, name", list(_all_keys()), ids=lambda x: str(x))
def test_every_config_key_bounds_a_huge_value(section, name):
    """Every key of the spec, given a 5 MB string (and a 5 MB list where it takes a string):
    the SpecError, whatever formatted it (our validators, pydantic's own messages with our
    `got ...`), is bounded."""
    for value in (HUGE, [HUGE], {HUGE: 1}):
        if section == "tools.functions":
            tool = {"name": "calc", "function": "m:f", name: value}
            data = {"tools": {"functions": [tool]}}
        else:
            data = {section: {name: value}}
        try:
            JobSpec.from_dict(data, "job.yaml")
        except SpecError as e:
            assert len(str(e)) < BOUND, (len(str(e)), str(e)[:300])


def test_pydantics_own_message_does_not_echo_the_input_but_str_truncates_it():
    """What pydantic itself says: a type error's `msg` holds no input (jobs/spec.py appends a
    bounded `got ...`), and str(ValidationError) truncates input_value (pydantic v2)."""
    with pytest.raises(ValidationError) as e:
        ModelSpec.model_validate({"batch_invariant": HUGE})
    assert HUGE[:50] not in e.value.errors()[0]["msg"]
    assert len(str(e.value)) < BOUND
    with pytest.raises(SpecError) as e2:
        JobSpec.from_dict({"model": {"batch_invariant": HUGE, "dtype": HUGE}}, "job.yaml")
    assert len(str(e2.value)) < BOUND and "model.dtype: Input should be 'auto'" in str(e2.value)


def test_config_file_values_are_bounded(tmp_path):
    from jobs.config import load_spec

    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps({"sampling": {"temperature": HUGE}}))
    with pytest.raises(SpecError) as e:
        load_spec(cfg)
    assert str(e.value).startswith(f"{cfg}: sampling.temperature: must be a finite number") and len(str(e.value)) < BOUND
    cfg.write_text(json.dumps({"sampling": HUGE}))
    with pytest.raises(SpecError) as e:
        load_spec(cfg)
    assert len(str(e.value)) < BOUND


def test_a_rows_sampling_struct_and_messages_are_bounded():
    from jobs.inputs.prompts import check_messages
    from jobs.inputs.row_params import row_params

    params, why = row_params(SamplingParams(), {"temperature": HUGE}, "in.parquet row 1 column 'params' ")
    assert why.startswith("in.parquet row 1 column 'params' field 'temperature': must be a finite number")
    assert why.endswith("... (5,000,000 characters)") and len(why) < BOUND
    for messages in ([HUGE], [{"role": [HUGE], "content": "hi"}], [{"role": HUGE, "content": None}],
                     [{"role": HUGE, "content": 5}]):
        why = check_messages(messages)
        assert why is not None and len(why) < BOUND, why[:300]


@pytest.mark.parametrize("line", [
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": HUGE}},
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": HUGE}},
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": HUGE}},
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": [{"type": HUGE}]}]}},
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": HUGE, "content": None}]}},
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "best_of": HUGE}},
    {"custom_id": "a", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "p", "skip_special_tokens": HUGE}},
    {"custom_id": [HUGE], "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},
    {"custom_id": "a", "method": HUGE, "url": "/v1/completions", "body": {"prompt": "p"}},
    {"custom_id": "a", "method": "POST", "url": HUGE, "body": {"prompt": "p"}},
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}, HUGE: 1},
], ids=["temperature", "logprobs", "ignore_eos", "content-part-type", "role", "best_of", "skip_special_tokens",
        "custom_id", "method", "url", "unknown-key"])
def test_openai_batch_line_errors_are_bounded(line):
    from jobs.inputs.openai_batch import parse_line

    p = parse_line(json.dumps(line).encode(), 1, SamplingParams(), "in.jsonl")
    assert p.error is not None and len(p.error) < BOUND, p.error[:300]


def test_a_huge_duplicate_prompt_id_is_bounded(tmp_path):
    from jobs.plan.planner import plan_job

    pq.write_table(pa.table({"prompt": ["a", "b"], "id": [HUGE, HUGE]}), tmp_path / "in.parquet")
    spec = JobSpec.from_dict({"input": {"path": str(tmp_path / "in.parquet"), "id_column": "id"},
                              "output": {"path": str(tmp_path / "out")}}, "job.yaml")
    with pytest.raises(InputError) as e:
        plan_job(spec)
    assert "duplicate prompt id" in str(e.value) and len(str(e.value)) < BOUND, str(e.value)[:300]


def test_shown_survives_a_repr_that_fails():
    """A value whose repr raises (or nests past the recursion limit) is named by its type and
    address: the repr's exception replaced the message (a RuntimeError from run_job where a
    SpecError, exit 2, naming the key was due)."""
    from jobs.config import load_job_spec

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no repr")

    value = Unprintable()
    assert shown(value) == f"{object.__repr__(value)} (its repr failed: RuntimeError)"
    deep: list = []
    cur = deep
    for _ in range(100_000):
        cur.append([])
        cur = cur[0]
    assert "(its repr failed: RecursionError)" in shown(deep)
    with pytest.raises(SpecError, match=r"^override sampling.temperature=<.*Unprintable object at 0x[0-9a-f]+> "
                                        r"\(its repr failed: RuntimeError\): sampling.temperature: must be a finite number"):
        load_job_spec({"model": {"path": "tiny-random"}}, {"sampling.temperature": Unprintable()})


def test_huge_keys_are_named_bounded():
    """A huge key (unknown, or on the path to a value JSON cannot hold) is named by its first
    200 characters and its length: it was named whole (100,000 characters for a 100,000-character
    key), in the file's message and in --set's."""
    import datetime

    from jobs.config import apply_override, normalise_sections

    key = "k" * 100_000
    bounded = "k" * 200 + "... (100,000 characters)"
    for data, where in (({"sampling": {key: 1}}, f"unknown key sampling.{bounded}"),
                        ({"tools": {"functions": [{"name": "f", "function": "os:getcwd", "parameters": {
                            "type": "object", "properties": {key: {"default": datetime.date(2020, 1, 1)}}}}]}},
                         f"properties.{'k' * 189}... (100,019 characters): datetime.date(2020, 1, 1) is not")):
        with pytest.raises(SpecError) as e:
            JobSpec.from_dict(data, "job.yaml")
        assert len(str(e.value)) < BOUND and where in str(e.value), str(e.value)[:400]
    with pytest.raises(SpecError) as e:
        normalise_sections({key: {}}, "<dict>")
    assert len(str(e.value)) < BOUND and f"unknown key {bounded}" in str(e.value), str(e.value)[:400]
    with pytest.raises(SpecError) as e:
        apply_override({}, f"sampling.{key}=1")
    assert len(str(e.value)) < 2 * BOUND and f"unknown key sampling.{'k' * 191}... (100,009 characters)" in str(
        e.value), str(e.value)[:400]
