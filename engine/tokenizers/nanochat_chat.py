"""nanochat's chat layout: its special tokens and a conversation rendered as token ids, as
nanochat's `render_for_completion` does (the tiktoken tokenizers' `render_chat`).

    <|bos|> (<|user_start|> text <|user_end|> <|assistant_start|> text <|assistant_end|>)*
    <|user_start|> text <|user_end|> <|assistant_start|>
"""
from __future__ import annotations

from typing import Any, Callable

# nanochat's special tokens, in nanochat's order (their ids follow the ranks in this order).
NANOCHAT_SPECIALS = (
    "<|bos|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",
    "<|output_start|>", "<|output_end|>",
)
# the tokens a tokenizer needs to have nanochat's chat format
CHAT_REQUIRED = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>")
_PART_TOKENS = {"python": ("<|python_start|>", "<|python_end|>"),
                "python_output": ("<|output_start|>", "<|output_end|>")}


def render_chat(messages: list[dict], specials: dict[str, int], encode: Callable[[str], list[int]],
                name: str) -> list[int]:
    """Token ids priming the assistant's reply, in nanochat's render_for_completion layout
    (module docstring).

    messages: [{"role": "system"|"user"|"assistant", "content": ...}, ...]. A leading
    system message is merged into the first user message as system + "\\n\\n" + user.
    Roles must then alternate user, assistant, ... starting with user. A trailing
    assistant message is dropped (the model writes it). User and system content is a
    str; assistant content is a str or a list of parts {"type": "text"|"python"|
    "python_output", "text": str} (python parts are wrapped in <|python_start|>..
    <|python_end|>, outputs in <|output_start|>..<|output_end|>).
    specials: the tokenizer's special tokens (name -> id); encode: ordinary text -> ids (never
    specials); name: the tokenizer, for messages.

    Raises ValueError naming the message (index in `messages`) and what is wrong, or
    "... has no chat format ..." for a tokenizer without nanochat's chat tokens (GPT-2).
    """
    if not all(s in specials for s in CHAT_REQUIRED):
        missing = [s for s in CHAT_REQUIRED if s not in specials]
        raise ValueError(f"tokenizer {name} has no chat format (missing special tokens "
                         f"{', '.join(missing)}); send token ids or plain text prompts instead")
    items = _conversation(messages, specials, name)
    sp = specials
    ids = [sp["<|bos|>"]]
    for _, role, content in items:
        if role == "user":
            ids.append(sp["<|user_start|>"])
            ids.extend(encode(content))
            ids.append(sp["<|user_end|>"])
        else:
            ids.append(sp["<|assistant_start|>"])
            if isinstance(content, str):
                ids.extend(encode(content))
            else:
                for part in content:
                    text_ids = encode(part["text"])
                    if part["type"] == "text":
                        ids.extend(text_ids)
                    else:
                        start, end = _PART_TOKENS[part["type"]]
                        ids.append(sp[start])
                        ids.extend(text_ids)
                        ids.append(sp[end])
            ids.append(sp["<|assistant_end|>"])
    ids.append(sp["<|assistant_start|>"])
    return ids


def _conversation(messages: Any, specials: dict[str, int], name: str) -> list[tuple[int, str, Any]]:
    """The checked conversation as (original index, role, content), the system message merged
    into the first user message and a trailing assistant message dropped; ValueError naming
    the message and what is wrong (see render_chat)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one user message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is a {type(m).__name__}, expected a dict with 'role' and 'content'")
        if "role" not in m:
            raise ValueError(f"message {i} has no 'role'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"message {i} has unknown role {m['role']!r} (expected system, user or assistant)")
        if "content" not in m:
            raise ValueError(f"message {i} ({m['role']}) has no 'content'")
        if m["role"] == "system" and i != 0:
            raise ValueError(f"message {i} is a system message; only the first message may be one")

    # (original index, role, content) after merging the system message into the first user one.
    items: list[tuple[int, str, Any]] = [(i, m["role"], m["content"]) for i, m in enumerate(messages)]
    if items[0][1] == "system":
        sys_content = items[0][2]
        if not isinstance(sys_content, str):
            raise ValueError(f"message 0 (system) content must be a str, got {type(sys_content).__name__}")
        if len(items) < 2 or items[1][1] != "user":
            raise ValueError("message 0 is a system message, so message 1 must be a user message"
                             + ("" if len(items) >= 2 else " (there is none)"))
        if not isinstance(items[1][2], str):
            raise ValueError(f"message 1 (user) content must be a str, got {type(items[1][2]).__name__}")
        items = [(1, "user", sys_content + "\n\n" + items[1][2])] + items[2:]
    for k, (i, role, content) in enumerate(items):
        expected = "user" if k % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"message {i} is from {role} but should be from {expected} (roles must "
                             f"alternate user/assistant, starting with user)")
        if role == "user" and not isinstance(content, str):
            raise ValueError(f"message {i} (user) content must be a str, got {type(content).__name__}")
        if role == "assistant":
            _check_assistant_content(i, content, specials, name)
    if items[-1][1] == "assistant":
        items = items[:-1]  # nanochat pops the assistant message being completed
    return items


def _check_assistant_content(i: int, content: Any, specials: dict[str, int], name: str) -> None:
    """Validate assistant content (str or list of parts); ValueError naming message/part."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"message {i} (assistant) content must be a str or a list of parts, "
                         f"got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"message {i} part {j} is a {type(part).__name__}, expected a dict with "
                             f"'type' and 'text'")
        ptype = part.get("type")
        if ptype not in ("text", "python", "python_output"):
            raise ValueError(f"message {i} part {j} has unknown type {ptype!r} "
                             f"(expected text, python or python_output)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"message {i} part {j} ({ptype}) needs a str 'text', "
                             f"got {type(part.get('text')).__name__}")
        if ptype in _PART_TOKENS and any(s not in specials for s in _PART_TOKENS[ptype]):
            raise ValueError(f"message {i} part {j}: tokenizer {name} has no {_PART_TOKENS[ptype]} tokens")
