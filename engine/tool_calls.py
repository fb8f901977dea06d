"""Tool calls in the Hermes / Qwen format, found in a sample's text while it decodes, and
tool results rendered back by the model's own chat template.

The format (NousResearch's Hermes-Function-Calling, and the chat templates of Qwen2.5 and
Qwen3, which read a `tools` list of JSON schemas):

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 2"}}
    </tool_call>

`HermesScanner` watches one sample's sampled tokens: it keeps the bytes since the last call
and searches them only when a token holds a ">" (the last byte of both tags), so a token
costs a bytes append. The call's text is parsed by `parse_tool_call`.

`ToolResponses` renders a result as the template renders a tool message after an assistant
turn: the text after a sentinel assistant message in a render of [user, assistant, tool] with
the generation prompt, i.e. the tokens that close the assistant turn, the tool message and
the header opening the next assistant turn (verl's agent loop computes its tool tokens by the
same difference of renders). Templates that never read `tools` (SmolLM2's) get the tool
list as Hermes's system prompt (`hermes_system_prompt`) and the result inside Hermes's
<tool_response> tags.

Imports no torch: jobs/ reads `hermes_system_prompt` through the tokenizer.
"""
from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = b"<tool_call>", b"</tool_call>"
_SENTINEL = "\u2063batchgen-assistant-turn\u2063"  # invisible separators: no template or model writes this


@dataclass(slots=True)
class ParsedCall:
    """A tool call's text parsed: name and arguments, or why it cannot be run (`error`)."""

    name: str | None
    arguments: dict | None
    error: str | None = None


def _unparsable(e: Exception) -> str:
    """Why json.loads gave up on well-formed-looking text (the text itself is too large to quote)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]


def parse_tool_call(text: str) -> ParsedCall:
    """The call between <tool_call> and </tool_call>: a JSON object {"name": str, "arguments":
    object} ("arguments" may also be a JSON string holding an object, as some models write it;
    missing means {}). Never raises: a bad call comes back with `error` saying why (the text
    is the model's: json.loads also raises RecursionError for brackets nested past the
    interpreter's recursion limit and a plain ValueError for an integer of over 4300 digits,
    and either escaping would end the engine's step loop)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ParsedCall(None, None, f"the tool call is not JSON ({e.msg} at character {e.pos}): {text.strip()!r}")
    except (ValueError, RecursionError) as e:
        return ParsedCall(None, None, f"the tool call cannot be parsed ({_unparsable(e)})")
    if not isinstance(obj, dict):
        return ParsedCall(None, None, f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                                      f"got {text.strip()!r}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, None, f'the tool call has no "name" string: {text.strip()!r}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ParsedCall(name, None, f"the arguments of {name} are not JSON ({e.msg}): {args!r}")
        except (ValueError, RecursionError) as e:
            return ParsedCall(name, None, f"the arguments of {name} cannot be parsed ({_unparsable(e)})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(name, None, f"the arguments of {name} must be a JSON object, got {json.dumps(args)}")
    return ParsedCall(name, args)


class HermesScanner:
    """One sample's search for <tool_call>...</tool_call> in its sampled text.

    `feed(index, data)` takes the sample's token `index` and its bytes; it returns
    (start, text) when the token completes a call: `start` the index of the token where
    "<tool_call>" begins, `text` what lies between the tags (decoded as UTF-8, bad bytes as
    U+FFFD). Then the search starts afresh after the call. `open_start` is the start of a call
    whose closing tag has not come yet (None without one).
    """

    __slots__ = ("buf", "offsets", "base", "open_at")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.offsets: list[int] = []  # byte offset in buf of each token fed since `base`
        self.base = 0  # the token index of offsets[0]
        self.open_at: int | None = None  # byte offset of an unclosed "<tool_call>"

    def reset(self) -> None:
        self.buf.clear()
        self.offsets.clear()
        self.open_at = None

    @property
    def open_start(self) -> int | None:
        return None if self.open_at is None else self._token_at(self.open_at)

    def open_text(self) -> str:
        """The text of an unclosed call so far ("" without one)."""
        return "" if self.open_at is None else self.buf[self.open_at + len(OPEN):].decode("utf-8", "replace")

    def _token_at(self, offset: int) -> int:
        return self.base + bisect.bisect_right(self.offsets, offset) - 1

    def feed(self, index: int, data: bytes) -> tuple[int, str] | None:
        if not self.offsets:
            self.base = index
        self.offsets.append(len(self.buf))
        self.buf += data
        if b">" not in data:
            return None
        n = len(self.buf)
        if self.open_at is None:
            j = self.buf.find(OPEN, max(0, n - len(data) - len(OPEN)))
            if j < 0:
                self._trim()
                return None
            self.open_at = j
        body = self.open_at + len(OPEN)
        k = self.buf.find(CLOSE, max(body, n - len(data) - len(CLOSE)))
        if k < 0:
            return None
        start, text = self._token_at(self.open_at), self.buf[body:k].decode("utf-8", "replace")
        self.reset()
        return start, text

    def _trim(self) -> None:
        # Without an open tag only the last len(OPEN) - 1 bytes can still begin one: drop
        # whole tokens before them, now and then (amortised).
        keep_from = len(self.buf) - len(OPEN)
        if keep_from < 512:
            return
        i = bisect.bisect_right(self.offsets, keep_from) - 1
        cut = self.offsets[i]
        del self.buf[:cut]
        self.offsets = [o - cut for o in self.offsets[i:]]
        self.base += i


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""Hermes's tool block, as Qwen2.5's template writes it into the system message."""


def template_reads_tools(source: str | None) -> bool:
    """Whether a chat template uses the `tools` variable (else the tool list goes in the
    system message as Hermes's prompt, and results inside <tool_response> tags)."""
    return bool(source) and re.search(r"\btools\b", source) is not None


def hermes_system_prompt(tools: list[dict]) -> str:
    """The Hermes tool block for `tools` (OpenAI-style {"type": "function", "function":
    {...}} schemas), one JSON object per line, as Qwen2.5's template renders it."""
    return HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def with_hermes_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the Hermes tool block appended to the system message (one is added
    first when the conversation has none)."""
    block = hermes_system_prompt(tools)
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system":
        msgs[0]["content"] = f"{msgs[0].get('content') or ''}\n\n{block}"
    else:
        msgs.insert(0, {"role": "system", "content": block})
    return msgs


class ToolResponses:
    """Tool results as the tokens the model's chat template renders for them.

    ToolResponses(tokenizer, tools): `tokenizer` needs `render_chat_text` and `chat_template`
    (engine/tokenizers/hf_tokenizer.py); `tools` the schemas the prompts list.
    `suffix(result)` -> the token ids that follow the assistant's text: the turn's end, the
    tool message with `result`, the next assistant header (`suffix([r1, r2])`: one tool
    message per result; `after_turn_end` the same without the turn's end, for a model that
    sampled it itself: tools.parallel_calls). Raises ValueError at construction
    when the tokenizer has no chat template, its template refuses a tool message, or its
    prompt with tools asks for calls in another format than <tool_call> (Llama 3.x's asks for
    bare JSON): no call of that model would ever be recognised.

    The result goes inside <tool_response> tags unless the template's own tool message has
    them: asked of the rendering, not of the `chat_template` source, because with tools the
    tokenizer may render with another template (a "tool_use" one, as Hermes-2-Pro's), which
    wraps results itself.
    """

    def __init__(self, tokenizer: Any, tools: list[dict]):
        render = getattr(tokenizer, "render_chat_text", None)
        source = getattr(tokenizer, "chat_template", None)
        name = getattr(tokenizer, "name", tokenizer)
        if render is None or not source:
            raise ValueError(f"tokenizer {name!r} has no chat template: tool results "
                             f"cannot be rendered as tool messages (nanochat models have the calculator only)")
        self.tokenizer = tokenizer
        self.tools = tools
        self.native = True  # the probe renders the tool message as given
        self._ends_turn: dict[int, bool] = {}
        try:
            self.native = "<tool_response>" in self.suffix_text("probe")
            prompt = render([{"role": "user", "content": "."}], add_generation_prompt=True, tools=tools or None)
        except ValueError as e:
            raise ValueError(f"the chat template of {name!r} cannot render a tool "
                             f"message after an assistant turn: {e}") from None
        if tools and OPEN.decode() not in prompt:
            raise ValueError(f"the chat template of {name!r} lists tools in its own call format (its prompt with "
                             f"tools never names {OPEN.decode()}, as Llama 3.x's asks for bare JSON): batchgen "
                             f"recognises Hermes {OPEN.decode()} calls only, so this model's calls would never run")

    def suffix_text(self, result: str | list[str]) -> str:
        """The text after the assistant's text: its turn's end, one tool message per result
        (a list: consecutive tool messages, in order, as the template renders them: Qwen's
        groups them in one user block, one <tool_response> each), the next assistant header."""
        results = [result] if isinstance(result, str) else list(result)
        msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}]
        msgs += [{"role": "tool", "content": r if self.native else f"<tool_response>\n{r}\n</tool_response>"}
                 for r in results]
        text = self.tokenizer.render_chat_text(msgs, add_generation_prompt=True, tools=self.tools or None)
        at = text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the template does not render the assistant's content as given")
        return text[at + len(_SENTINEL):]

    def suffix(self, result: str | list[str]) -> list[int]:
        return list(self.tokenizer.encode(self.suffix_text(result)))

    def ends_turn(self, token: int) -> bool:
        """Whether `token` (a sampled stop token) is the template's end of an assistant turn:
        the first token of what it renders after the assistant's text (Qwen's and ChatML's
        <|im_end|>). Cached per token: the answer depends on the template alone."""
        known = self._ends_turn.get(token)
        if known is None:
            toks = self.suffix(["probe"])
            known = self._ends_turn[token] = bool(toks) and toks[0] == token
        return known

    def after_turn_end(self, results: list[str]) -> list[int]:
        """tools.parallel_calls: the tokens the template renders after the assistant's
        end-of-turn token (which the model sampled, see `ends_turn`) for one tool message per
        result, in order, and the next assistant header: `suffix(results)` without its first
        token. For Qwen2.5 and two results `\n<|im_start|>user\n<tool_response>\nA\n</tool_response>`
        `\n<tool_response>\nB\n</tool_response><|im_end|>\n<|im_start|>assistant\n`."""
        return self.suffix(results)[1:]


__all__ = ["ParsedCall", "parse_tool_call", "HermesScanner", "ToolResponses", "hermes_system_prompt",
           "with_hermes_system", "template_reads_tools", "HERMES_TOOLS_PROMPT"]
