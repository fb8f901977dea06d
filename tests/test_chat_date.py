"""Chat templates that print the date (Llama 3.x puts "Today Date: 26 Nov 2026" in its system
prompt) render one date per job, never a worker's clock (issue 20, item 2): the same messages
give the same prompt tokens in another time zone, on another day, on a retry, a second copy
or a resume. The day is `model.chat_template_date`: the config's, else the day the output was
created (kept in its manifest), else today in UTC; the fingerprint holds it for chat jobs."""
from __future__ import annotations

import datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hf_cases
from jobs.errors import OutputError, SpecError

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory):
    """A Llama 3.2-style tokenizer directory: its template prints strftime_now("%d %b %Y")."""
    return hf_cases.build_llama3(tmp_path_factory.mktemp("llama3"))


def _today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def test_the_template_prints_the_day_it_is_given(llama3_tokenizer, monkeypatch):
    """render_chat(date=...) renders that day, whatever the process's time zone; without a
    date, today in UTC (not the local clock)."""
    import time

    from engine.tokenizers.base import Tokenizer

    tok = Tokenizer.load(str(llama3_tokenizer))
    text = tok.decode(tok.render_chat(MESSAGES, date="2024-07-23"))
    assert "Today Date: 23 Jul 2024" in text
    assert tok.render_chat(MESSAGES, date=datetime.date(2024, 7, 23)) == tok.render_chat(MESSAGES, date="2024-07-23")
    monkeypatch.setenv("TZ", "Etc/GMT-14")  # UTC+14: the local date is tomorrow's for 10 hours a day
    time.tzset()
    try:
        utc_now = datetime.datetime.now(datetime.timezone.utc).strftime("%d %b %Y")
        assert f"Today Date: {utc_now}" in tok.decode(tok.render_chat(MESSAGES))
        assert tok.render_chat(MESSAGES, date="2024-07-23") == tok.render_chat(MESSAGES, date="2024-07-23")
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def _chat_spec(tmp_path, tokenizer_dir, **model):
    from jobs.spec import JobSpec

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"messages": [MESSAGES, [{"role": "user", "content": "Hi"}]]}), path)
    return JobSpec.from_dict({
        "model": {"path": "tiny-random", "tokenizer": str(tokenizer_dir), **model},
        "input": {"path": str(path), "format": "chat"},
        "output": {"path": str(tmp_path / "out")},
        "sampling": {"num_samples": 1, "max_tokens": 4}}, "test.yaml")


def test_every_row_of_a_job_renders_at_the_jobs_date(tmp_path, llama3_tokenizer):
    """A worker's task renders each chat row at model.chat_template_date, carried with the spec
    to every worker: the decoded prompt holds that day, not the worker's."""
    from engine.tokenizers.base import Tokenizer
    from jobs.plan.planner import plan_job
    from jobs.task import JobTask

    spec = _chat_spec(tmp_path, llama3_tokenizer, chat_template_date="2024-07-23")
    plan = plan_job(spec)
    task = JobTask(spec, plan)
    tok = Tokenizer.load(str(llama3_tokenizer))
    requests = task.read_unit(plan.units[0], tok)
    assert [r.error for r in requests] == [None, None]
    assert all("Today Date: 23 Jul 2024" in tok.decode(r.prompt_tokens) for r in requests)
    assert requests[0].prompt_tokens == tok.render_chat(MESSAGES, date="2024-07-23")


def test_a_resume_on_another_day_keeps_the_outputs_date(tmp_path, llama3_tokenizer):
    """No date in the config: a new output takes today's (UTC), a rerun takes the one its
    manifest kept, so a resume on a later day has the same fingerprint; a config that names
    another date is another job, refused by name; text jobs never see the date."""
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job, with_chat_template_date

    spec = _chat_spec(tmp_path, llama3_tokenizer)
    assert spec.model.chat_template_date is None
    fresh = with_chat_template_date(spec, None)
    assert fresh.model.chat_template_date == _today() and spec.model.chat_template_date is None
    out = OutputDir(spec.output.path)
    first = plan_job(with_chat_template_date(spec, out.manifest_or_none()))
    assert first.fingerprint_data["chat_template_date"] == _today()
    out.prepare(first, spec)

    # "tomorrow": the output was created with 2020-01-01 (as if made that day)
    manifest = out.read_manifest()
    manifest["fingerprint_data"]["chat_template_date"] = "2020-01-01"
    later = with_chat_template_date(spec, manifest)
    assert later.model.chat_template_date == "2020-01-01"
    explicit = _chat_spec(tmp_path, llama3_tokenizer, chat_template_date="2020-01-01")
    assert plan_job(later).fingerprint == plan_job(explicit).fingerprint

    other = plan_job(with_chat_template_date(_chat_spec(tmp_path, llama3_tokenizer,
                                                        chat_template_date="2021-05-05"), out.read_manifest()))
    with pytest.raises(OutputError, match="chat_template_date"):
        out.prepare(other, spec)

    text = _chat_spec(tmp_path, llama3_tokenizer)
    text_spec = text.model_copy(update={"input": text.input.model_copy(update={"format": "text",
                                                                                "column": "prompt"})})
    assert "chat_template_date" not in text_spec.fingerprint_dict()


def test_the_config_key(tmp_path):
    """model.chat_template_date: an ISO date, as YAML writes it (unquoted: a date) or a string;
    anything else stops the job naming the key."""
    from jobs.config import load_job_spec

    cfg = tmp_path / "job.yaml"
    cfg.write_text("model:\n  chat_template_date: 2024-07-23\n")
    assert load_job_spec(str(cfg)).model.chat_template_date == "2024-07-23"
    assert load_job_spec({"model": {"chat_template_date": "2024-07-23"}}).model.chat_template_date == "2024-07-23"
    for bad in ("2024-13-01", "yesterday", 20240723):
        with pytest.raises(SpecError, match="model.chat_template_date"):
            load_job_spec({"model": {"chat_template_date": bad}})


def test_a_pool_renders_every_call_at_its_creation_date(tmp_path, llama3_tokenizer):
    """GenerationPool's task carries the pool's date (its creation day, UTC, unless the config
    names one) into every call's units."""
    from jobs.plan.planner import with_chat_template_date
    from jobs.pool_task import PoolTask

    spec = _chat_spec(tmp_path, llama3_tokenizer)
    task = PoolTask(with_chat_template_date(spec, None))
    units, _ = task.make_units([MESSAGES], None, None, 0, 8)
    assert units[0].payload.layout.chat_template_date == _today()
    task = PoolTask(with_chat_template_date(_chat_spec(tmp_path, llama3_tokenizer, chat_template_date="2024-07-23"),
                                            None))
    units, _ = task.make_units([MESSAGES], None, None, 0, 8)
    assert units[0].payload.layout.chat_template_date == "2024-07-23"
