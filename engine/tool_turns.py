"""Multi-turn tool use inside the step loop: a sample's Hermes call run while the others decode.

When a sampled token completes <tool_call>...</tool_call> (engine/sequence.py leaves it in
`Sequence.new_call`), `ToolTurns.start` parses it and either answers at once (bad JSON, an
unknown tool, max_calls reached: an error message) or submits it to the `ToolRunner`'s
threads; the sample then waits (`Sequence.pending`) outside the decode batch, holding its slot
and KV run, while every other sample decodes. `poll` collects finished calls and calls that
have run past their timeout (counted from when a tool thread starts the call, not from its
submission: a call queued for a thread does not time out); the result (or "Error: <why>") is
rendered as the chat template renders a tool message (engine/tool_calls.py `ToolResponses`)
and queued in `Sequence.forced`: the engine feeds those tokens one per step (their KV
computed as the calculator's output is), with mask 0 and no logprob, and the sample goes on
sampling after them.

Why a waiting sample's tokens do not change: its noise is keyed by position (engine/sampling.py),
not by step, and on CPU with batch_invariant a row's logits do not depend on the batch it sits
in, so leaving the batch for a few steps and coming back gives the same bits as not leaving.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from engine.params import ToolCall
from engine.tool_calls import ToolResponses, parse_tool_call
from engine.tool_runner import ToolBox, ToolError, ToolRunner

MAX_BLOCK_S = 0.05  # longest `wait` blocks when only tool calls are left: new requests may arrive
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(text: str) -> str:
    """`text` with its lone surrogates as U+FFFD: a Python str that is not valid UTF-8 (a tool
    returning os.listdir's undecodable file names, an exception message quoting them, a call
    whose JSON writes "\\udc00") can be neither tokenized nor written to the output's Parquet."""
    return _SURROGATE.sub("\ufffd", text)


def _arguments_text(arguments: dict) -> str:
    """The call's arguments as JSON text; lone surrogates stay as JSON escapes (see _utf8)."""
    text = json.dumps(arguments, ensure_ascii=False)
    return json.dumps(arguments) if _SURROGATE.search(text) else text


@dataclass(slots=True)
class PendingCall:
    """A call submitted to the tool threads: its record, the tool's future, when it was
    submitted (`t0`, time.perf_counter() seconds) and how long it may run (`timeout_s`)."""

    call: ToolCall
    future: concurrent.futures.Future
    t0: float
    timeout_s: float

    def deadline(self) -> float | None:
        """The time.perf_counter() past which the call has run too long, or None while it
        waits for a thread: the timeout counts from when a thread starts it (ToolRunner), so
        a call queued behind others (more calls than threads) is never answered with a
        timeout it did not run into, and a tool that is quick enough gets its result to the
        model however loaded the threads are."""
        started = getattr(self.future, "batchgen_started_at", None)
        return None if started is None else started + self.timeout_s


class ToolTurns:
    """The engine's tools (a ToolBox), their threads, and the samples waiting on them.

    ToolTurns(box, tokenizer): raises ValueError when the tokenizer cannot render tool
    messages (engine/tool_calls.py ToolResponses)."""

    def __init__(self, box: ToolBox, tokenizer: Any, max_workers: int = 16):
        self.box = box
        self.responses = ToolResponses(tokenizer, box.schemas())
        self.runner = ToolRunner(max_workers)
        self.waiting: list[Any] = []  # Sequences with a pending call

    def start(self, seq: Any) -> None:
        """Handle `seq.new_call` (set by its last token): record it, then answer it, run it or
        refuse it. A sample that has ended (max_tokens, context) records it as not run."""
        start, text = seq.new_call
        seq.new_call = None
        call = ToolCall(start=start, end=len(seq.tokens), expr=text, output=None, error=None)
        seq.tool_calls.append(call)
        parsed = parse_tool_call(text)
        call.name = None if parsed.name is None else _utf8(parsed.name)
        call.arguments = None if parsed.arguments is None else _arguments_text(parsed.arguments)
        if seq.finish_reason is not None:
            call.error = f"not run: the sample ended ({seq.finish_reason}) with the call"
            return
        if seq.num_turns >= self.box.max_turns:
            call.error = f"not run: the sample reached max_turns ({self.box.max_turns})"
            return
        seq.num_turns += 1
        error = parsed.error
        tool = None if error else self.box.by_name.get(parsed.name)
        if error is None and tool is None:
            error = f"unknown tool {parsed.name!r} (tools: {', '.join(self.box.by_name) or 'none'})"
        if call.name is not None:
            # Every call that names a tool counts towards its max_calls, run or not (bad
            # arguments, refused): a continuation counts the calls it replays so
            # (Sequence._restore_hermes_calls), from their records, and must refuse the calls
            # after them exactly as the uninterrupted sample did.
            used = seq.calls_by_name.get(call.name, 0)
            if error is None and tool.max_calls is not None and used >= tool.max_calls:
                error = f"{tool.name} may be called {tool.max_calls} times per sample"
            seq.calls_by_name[call.name] = used + 1
        if error is not None:
            self._answer(seq, call, None, error, 0.0)
            return
        t0 = time.perf_counter()  # before submit: a quick call's thread may return before submit does
        seq.pending = PendingCall(call, self.runner.submit(tool, parsed.arguments), t0, float(tool.timeout_s))
        self.waiting.append(seq)

    def poll(self) -> bool:
        """Answer every waiting sample whose call finished or ran past its timeout. Returns
        True if any sample left the waiting list (the decode batch must be rebuilt)."""
        now = time.perf_counter()
        still = []
        for seq in self.waiting:
            p: PendingCall = seq.pending
            if p.future.done():
                took = getattr(p.future, "batchgen_done_at", now) - p.t0  # queue + run, not our polling
                output, error = None, None
                try:
                    output = p.future.result()
                except ToolError as e:
                    error = str(e)
                except BaseException as e:  # noqa: BLE001 - a tool's own failure, never the engine's
                    error = f"{p.call.name} raised {type(e).__name__}: {e}"
                self._answer(seq, p.call, output, error, took)  # outside: its own failure is not the tool's
            elif (deadline := p.deadline()) is not None and now > deadline:
                self.runner.abandon(p.future)
                self._answer(seq, p.call, None, f"{p.call.name} timed out after {p.timeout_s:g} s", now - p.t0)
            else:
                still.append(seq)
                continue
            seq.pending = None
        changed = len(still) != len(self.waiting)
        self.waiting = still
        return changed

    def wait(self) -> bool:
        """Block until a waiting call finishes, times out, or MAX_BLOCK_S passes (the engine
        has nothing else to do); then `poll`."""
        if self.waiting:
            now = time.perf_counter()
            first_deadline = min((d for s in self.waiting if (d := s.pending.deadline()) is not None),
                                 default=now + MAX_BLOCK_S)
            timeout = max(0.0, min(MAX_BLOCK_S, first_deadline - now))
            concurrent.futures.wait([s.pending.future for s in self.waiting], timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return self.poll()

    def cancel(self, seq: Any) -> None:
        """`seq` is aborted while its tool runs: it stops waiting, the call is abandoned (a
        thread cannot be killed: its result is dropped) and recorded as not finished; a
        continuation of the sample runs it again (Sequence.replay)."""
        p: PendingCall = seq.pending
        self.waiting = [s for s in self.waiting if s is not seq]
        self.runner.abandon(p.future)
        p.call.error = "not finished: the sample was aborted while the tool ran"
        p.call.latency_s = time.perf_counter() - p.t0
        seq.pending = None

    def _answer(self, seq: Any, call: ToolCall, output: str | None, error: str | None, latency: float) -> None:
        # cut first (ToolBox.max_response_chars): a huge result is never scanned or tokenized whole
        if error is None:
            text = _utf8(self.box.shown(output))
        else:
            text, error = _utf8(self.box.shown(f"Error: {error}")), _utf8(self.box.shown(error))
        call.output, call.error, call.latency_s = text, error, latency
        toks = self.responses.suffix(text)
        call.forced_start = len(seq.tokens)
        call.end = len(seq.tokens) + len(toks)
        seq.forced.extend(toks)


__all__ = ["ToolTurns", "PendingCall"]
