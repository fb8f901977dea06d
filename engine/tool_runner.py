"""Tools the model may call (Hermes format, engine/tool_calls.py) and the threads that run them.

A `Tool` is a Python callable, given as the object or as "package.module:callable" (imported
on first use, in the process that runs it: a path that does not import fails each call that
names it, with the import error, and nothing else). Its parameters are a JSON schema, given
or read from the signature (`function_schema`: type hints to JSON types, parameters without a
default required, the docstring's first paragraph as the description), as transformers'
`get_json_schema` does for `apply_chat_template(tools=...)`.

`ToolRunner` runs calls on daemon threads owned by the engine, so the engine keeps decoding
the other samples meanwhile; a call is a concurrent.futures.Future. Threads are daemons and
made on demand (at most `max_workers` busy ones; more calls wait in a queue, and their
timeout counts from when a thread starts them): a call that runs past its timeout is
abandoned, not killed (Python cannot kill a thread), and a new thread takes its place, so a
hung tool never blocks the others or the interpreter's exit.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import queue
import re
import threading
import time
import types
import typing
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array",
               dict: "object", type(None): "null"}


class ToolError(Exception):
    """A call that failed: its message becomes the tool message ("Error: ...") and the
    output's `error`."""


def check_function_path(path: str) -> str | None:
    """Why "package.module:callable" is malformed, or None (syntax only: nothing imported)."""
    if not isinstance(path, str) or not _PATH.match(path):
        return f'must be "package.module:callable" (dotted Python names), got {path!r}'
    return None


def check_tool_name(name: str) -> str | None:
    if not isinstance(name, str) or not _NAME.match(name):
        return f"must be a name of letters, digits, '_', '.' or '-' (starting with a letter or '_'), got {name!r}"
    return None


def _json_type(hint: Any) -> dict:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"anyOf": [_json_type(a) for a in args]}
    if origin is typing.Literal:
        vals = list(typing.get_args(hint))
        return {"type": _JSON_TYPES.get(type(vals[0]), "string"), "enum": vals}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args and args[0] is not Ellipsis else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}  # Any, or a type JSON schema cannot name


def function_schema(fn: Callable) -> tuple[str, dict]:
    """(description, parameters) of a Python function: its docstring's first paragraph and a
    JSON schema object of its parameters (type hints; required = no default; *args and
    **kwargs skipped). Never raises for odd hints: an unknown type is an unconstrained {}."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no types rather than no tool
        hints = {}
    props: dict[str, dict] = {}
    required = []
    try:
        sig = inspect.signature(fn)
    except (ValueError, TypeError):  # some builtins have none
        return (inspect.getdoc(fn) or "").split("\n\n")[0].strip(), {"type": "object", "properties": {}}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = _json_type(hints.get(p.name, Any))
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n")[0].strip(), {"type": "object", "properties": props, "required": required}


@dataclass
class Tool:
    """A tool the model may call by `name`.

    function: the callable, or "package.module:callable" (imported when first needed).
    description, parameters: what the prompt shows (parameters a JSON schema object); None:
        from the function's docstring and signature (`function_schema`).
    timeout_s: seconds a call may run before it is abandoned and answered with an error
        (from when a thread starts it: time queued behind other calls does not count).
    max_calls: calls one sample may make, every call naming it counted (one with arguments
        that do not parse too); None: no limit but the engine's max_turns.
    Raises ValueError naming the field for a bad name, path, timeout or max_calls.
    """

    name: str
    function: Callable | str
    description: str | None = None
    parameters: dict | None = None
    timeout_s: float = 30.0
    max_calls: int | None = None
    _resolved: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        why = check_tool_name(self.name)
        if why is None and isinstance(self.function, str):
            why = check_function_path(self.function) and f"function: {check_function_path(self.function)}"
        elif why is None and not callable(self.function):
            why = f"function: must be a callable or a \"package.module:callable\" string, got {self.function!r}"
        if why is None and (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                            or not 0 < self.timeout_s < float("inf")):
            why = f"timeout_s: must be a number of seconds > 0, got {self.timeout_s!r}"
        if why is None and self.max_calls is not None and (
                isinstance(self.max_calls, bool) or not isinstance(self.max_calls, int) or self.max_calls < 1):
            why = f"max_calls: must be an integer >= 1 (or null), got {self.max_calls!r}"
        if why is not None:
            raise ValueError(f"tool {self.name!r}: {why}")

    @classmethod
    def of(cls, obj: "Tool | Callable | dict") -> "Tool":
        """A Tool from a Tool, a callable (named by its __name__) or a dict of Tool's fields.
        Raises ValueError naming an unknown or missing field, or a bad value."""
        if isinstance(obj, Tool):
            return obj
        if isinstance(obj, dict):
            keys = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
            why = next((f"unknown field {k!r}" for k in obj if k not in keys), None) or next(
                (f"the field {k!r} is required" for k in ("name", "function") if k not in obj), None)
            if why is not None:
                raise ValueError(f"tool {obj.get('name', '?')!r}: {why} (fields: {', '.join(keys)})")
            return cls(**obj)
        if callable(obj):
            return cls(name=getattr(obj, "__name__", "tool"), function=obj)
        raise ValueError(f"a tool must be a Tool, a callable or a dict of Tool fields, got {obj!r}")

    def resolve(self) -> Callable:
        """The callable. Raises ToolError naming the path when it does not import."""
        if self._resolved is None:
            if callable(self.function):
                self._resolved = self.function
            else:
                module, _, attr = self.function.partition(":")
                try:
                    obj: Any = importlib.import_module(module)
                    for part in attr.split("."):
                        obj = getattr(obj, part)
                except Exception as e:  # noqa: BLE001 - any import failure is the tool's error
                    raise ToolError(f"tool {self.name!r}: function {self.function!r} does not import: "
                                    f"{type(e).__name__}: {e}") from None
                if not callable(obj):
                    raise ToolError(f"tool {self.name!r}: {self.function!r} is not callable")
                self._resolved = obj
        return self._resolved

    def schema(self) -> dict:
        """{"type": "function", "function": {name, description, parameters}}, as chat
        templates take `tools`. A path that does not import shows the given description and
        parameters (or none): its calls fail with the import error."""
        desc, params = self.description, self.parameters
        if desc is None or params is None:
            try:
                d, p = function_schema(self.resolve())
            except ToolError:
                d, p = "", {"type": "object", "properties": {}}
            desc = d if desc is None else desc
            params = p if params is None else params
        return {"type": "function", "function": {"name": self.name, "description": desc, "parameters": params}}

    def __getstate__(self) -> dict:  # a resolved module object never travels
        return {k: v for k, v in self.__dict__.items() if k != "_resolved"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _resolved=None)


TRUNCATED = "...(truncated)"  # ends a tool result cut to max_response_chars (verl's marker)


@dataclass
class ToolBox:
    """The tools of an engine and how many tool turns a sample may take (`max_turns`: tool
    results forced into one sample; a call past it is recorded with an error and not run).
    `max_response_chars`: the longest result (or `Error: ...` message) the model is shown, in
    characters; a longer one is cut to its first max_response_chars characters followed by
    TRUNCATED (verl bounds tool results the same way: `max_tool_response_length`), before it is
    tokenized (a 5 MB result otherwise stalls the engine for seconds and fills the context);
    None: no limit. `parallel_calls` (engine/tool_turns.py): False runs each call as soon as its
    </tool_call> closes and forces its result with the end of the assistant's turn (one call per
    turn); True lets the model write several calls in one turn and end the turn itself (its
    sampled end-of-turn token), then runs them all and forces their tool messages together, as
    verl's and SGLang's agent loops do; a turn counts once towards max_turns. Raises ValueError
    for duplicate names, max_turns < 1, max_response_chars < 1 or a parallel_calls that is not
    a bool."""

    tools: list[Tool]
    max_turns: int = 8
    max_response_chars: int | None = None
    parallel_calls: bool = False

    def __post_init__(self) -> None:
        self.tools = [Tool.of(t) for t in self.tools]
        names = [t.name for t in self.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tools: the name {dup[0]!r} is used twice")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns: must be an integer >= 1, got {self.max_turns!r}")
        m = self.max_response_chars
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_response_chars: must be an integer >= 1 or None, got {m!r}")
        if not isinstance(self.parallel_calls, bool):
            raise ValueError(f"parallel_calls: must be true or false, got {self.parallel_calls!r}")
        self.by_name = {t.name: t for t in self.tools}

    @classmethod
    def of(cls, tools: "ToolBox | list | None", max_turns: int = 8) -> "ToolBox | None":
        if tools is None or isinstance(tools, ToolBox):
            return tools
        tools = list(tools)
        return cls(tools, max_turns) if tools else None

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools]

    def shown(self, text: str) -> str:
        """`text` as the model is shown it: cut to max_response_chars (see the class)."""
        m = self.max_response_chars
        return text if m is None or len(text) <= m else text[:m] + TRUNCATED


def call_tool(tool: Tool, arguments: dict) -> str:
    """Run one call in this thread: the result string. Raises ToolError for an import
    failure, arguments the signature refuses, an exception inside the tool, or a result
    that is not a string."""
    fn = tool.resolve()
    try:
        result = fn(**arguments)
    except TypeError as e:
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError:
            raise ToolError(f"bad arguments for {tool.name}: {e}") from None
        raise ToolError(f"{tool.name} raised TypeError: {e}") from None
    except Exception as e:  # noqa: BLE001 - the tool's failure is shown to the model, never the engine's
        raise ToolError(f"{tool.name} raised {type(e).__name__}: {e}") from None
    if not isinstance(result, str):
        raise ToolError(f"{tool.name} returned {type(result).__name__}, not a string: {json.dumps(repr(result))[:200]}")
    return result


class ToolRunner:
    """Calls on daemon threads (see the module docstring). submit -> Future of the result
    string (ToolError inside it for a failed call). Its `batchgen_started_at` is the
    time.perf_counter() at which a thread started the call (absent while the call waits for
    a thread: at most `max_workers` run at once), `batchgen_done_at` the one at which the
    call returned. abandon(future) when its timeout passed."""

    def __init__(self, max_workers: int = 16):
        self.max_workers = max_workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads not running a call (started ones included, before their first)
        self._queued = 0  # calls in the queue that no thread has taken yet
        self._busy = 0  # threads that have not been abandoned

    def submit(self, tool: Tool, arguments: dict) -> Future:
        fut: Future = Future()
        self._queue.put((fut, tool, arguments))
        with self._lock:
            self._queued += 1
            self._grow()
        return fut

    def _grow(self) -> None:
        # Under the lock: a thread for each queued call that no idle thread will take, while
        # fewer than max_workers exist. Counting queued calls, not whether some thread is idle:
        # one idle thread must not stand for several calls submitted in one step, which would
        # then run one after another (behind a slow one) with free threads left unused.
        while self._queued > self._idle and self._busy < self.max_workers:
            self._busy += 1
            self._idle += 1  # idle from birth: the next submit does not start another for this call
            threading.Thread(target=self._work, name="batchgen-tool", daemon=True).start()

    def abandon(self, fut: Future) -> None:
        """Give up on a running call: its thread no longer counts as a worker (it exits when
        the call returns) and its result is dropped."""
        if fut.cancel():
            return
        with self._lock:  # done() under the lock: a call that returned meanwhile keeps its thread a worker
            if not fut.done() and not getattr(fut, "_batchgen_abandoned", False):
                fut._batchgen_abandoned = True  # type: ignore[attr-defined]
                self._busy -= 1
                self._grow()  # calls queued behind the hung one get a thread

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            fut, tool, arguments = item
            if fut.set_running_or_notify_cancel():
                fut.batchgen_started_at = time.perf_counter()  # type: ignore[attr-defined]
                try:
                    result = call_tool(tool, arguments)
                    fut.batchgen_done_at = time.perf_counter()  # type: ignore[attr-defined]
                    fut.set_result(result)
                except BaseException as e:  # noqa: BLE001 - delivered to the engine with the future
                    fut.batchgen_done_at = time.perf_counter()  # type: ignore[attr-defined]
                    fut.set_exception(e)
            with self._lock:
                if getattr(fut, "_batchgen_abandoned", False):
                    return  # another thread took this one's place while it hung
                self._idle += 1


__all__ = ["Tool", "ToolBox", "ToolError", "ToolRunner", "call_tool", "check_function_path", "check_tool_name",
           "function_schema"]
