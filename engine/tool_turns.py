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

Parallel calls (ToolBox.parallel_calls, config tools.parallel_calls): a closed call is recorded
and left in `Sequence.turn_calls`; the sample keeps sampling. When it samples a stop token that
is the template's end of an assistant turn (ToolResponses.ends_turn: <|im_end|> for Qwen) and
its turn holds calls, `end_turn` keeps the stop token as sampled (mask 1, its logprob), refuses
or submits every call of the turn in order (max_calls counted in order, the turn counted once
towards max_turns) and the sample waits (`PendingTurn`) until all are answered, each within its
own timeout; then the tokens the template renders after the end-of-turn token for one tool
message per call, in call order, and the next assistant header are forced at once
(ToolResponses.after_turn_end). Past max_turns, or when the stop token is another one (or no
token may follow it), the calls are recorded as not run and the sample ends on that token, as
one without tools. A sample that ends otherwise records its turn's calls as not run
(Sequence.to_sample).

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


@dataclass(slots=True)
class PendingTurn:
    """tools.parallel_calls: a sample whose turn's calls run. `calls`: every call of the turn,
    in order (answered ones have their output); `running`: those whose tool still runs."""

    calls: list[ToolCall]
    running: list[PendingCall]


def _running(p: "PendingCall | PendingTurn") -> list[PendingCall]:
    return p.running if isinstance(p, PendingTurn) else [p]


class ToolTurns:
    """The engine's tools (a ToolBox), their threads, and the samples waiting on them.

    ToolTurns(box, tokenizer, max_len=...): `max_len` the engine's longest sequence (tokens),
    which a turn's end needs room under. Raises ValueError when the tokenizer cannot render tool
    messages (engine/tool_calls.py ToolResponses), and with parallel_calls when it cannot render
    two in a row (`_check_parallel`)."""

    def __init__(self, box: ToolBox, tokenizer: Any, max_workers: int = 16, max_len: int | None = None):
        self.box = box
        self.max_len = max_len
        self.responses = ToolResponses(tokenizer, box.schemas())
        if box.parallel_calls:
            self._check_parallel(tokenizer)
        self.runner = ToolRunner(max_workers)
        self.waiting: list[Any] = []  # Sequences with a pending call

    def _check_parallel(self, tokenizer: Any) -> None:
        """parallel_calls forces a turn's tool messages as one block: a template that cannot
        render two tool messages in a row is refused when the engine loads, not found in a
        step (where it would fail every request of the step). Raises ValueError naming it."""
        try:
            self.responses.suffix(["a", "b"])
        except ValueError as e:
            name = getattr(tokenizer, "name", tokenizer)
            raise ValueError(f"tools.parallel_calls: the chat template of {name!r} cannot render two tool messages "
                             f"in a row: {e}") from None

    def start(self, seq: Any) -> None:
        """Handle `seq.new_call` (set by its last token): record it, then answer it, run it or
        refuse it. A sample that has ended (max_tokens, context) records it as not run.
        With parallel_calls: record it in the turn (`seq.turn_calls`), and end the turn when
        the last token is a sampled stop token (`end_turn`)."""
        if self.box.parallel_calls:
            if seq.new_call is not None:
                call, _ = self._record_call(seq)
                seq.turn_calls.append(call)
            if seq.turn_calls and seq.finish_reason == "stop" and isinstance(seq.stop_reason, int):
                self.end_turn(seq)
            return  # another end (max_tokens, a stop string): Sequence.to_sample records the turn's calls
        call, parsed = self._record_call(seq)
        if seq.finish_reason is not None:
            call.error = f"not run: the sample ended ({seq.finish_reason}) with the call"
            return
        if seq.num_turns >= self.box.max_turns:
            call.error = f"not run: the sample reached max_turns ({self.box.max_turns})"
            return
        seq.num_turns += 1
        tool, error = self._check(seq, call, parsed)
        if error is not None:
            self._answer(seq, call, None, error, 0.0)
            return
        seq.pending = self._submit(call, tool, parsed)
        self.waiting.append(seq)

    def _record_call(self, seq: Any) -> tuple[ToolCall, Any]:
        """The record of `seq.new_call` (appended to seq.tool_calls) and its ParsedCall."""
        start, text = seq.new_call
        seq.new_call = None
        call = ToolCall(start=start, end=len(seq.tokens), expr=text, output=None, error=None)
        seq.tool_calls.append(call)
        parsed = parse_tool_call(text)
        call.name = None if parsed.name is None else _utf8(parsed.name)
        call.arguments = None if parsed.arguments is None else _arguments_text(parsed.arguments)
        return call, parsed

    def _check(self, seq: Any, call: ToolCall, parsed: Any) -> tuple[Any, str | None]:
        """(tool, None) for a call to run, or (None / tool, why it is refused); counts it."""
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
        return tool, error

    def _submit(self, call: ToolCall, tool: Any, parsed: Any) -> PendingCall:
        t0 = time.perf_counter()  # before submit: a quick call's thread may return before submit does
        return PendingCall(call, self.runner.submit(tool, parsed.arguments), t0, float(tool.timeout_s))

    def end_turn(self, seq: Any) -> None:
        """parallel_calls: `seq` sampled stop token `seq.stop_reason` with closed calls in its
        turn. Past max_turns, or on a stop token that does not end the template's assistant
        turn, or with no room for another token, its calls are recorded as not run and the
        sample ends there. Otherwise the sample goes on (the stop token stays, sampled), the
        calls are refused or submitted in order, and the sample waits for them (PendingTurn);
        when none runs, their tool messages are forced at once."""
        calls, seq.turn_calls = seq.turn_calls, []
        why = None
        if seq.num_turns >= self.box.max_turns:
            why = f"not run: the sample reached max_turns ({self.box.max_turns})"
        elif not self.responses.ends_turn(seq.stop_reason) or (self.max_len is not None and seq.full(self.max_len)):
            why = f"not run: the sample ended ({seq.finish_reason}) before the turn's calls ran"
        if why is not None:
            for call in calls:
                call.error = why
            return
        seq.finish_reason = seq.stop_reason = None  # the model ended its turn, not the sample
        seq.end_turn_scan()
        seq.num_turns += 1
        running = []
        for call in calls:
            parsed = parse_tool_call(call.expr)
            tool, error = self._check(seq, call, parsed)
            if error is not None:
                self._record(call, None, error, 0.0)
            else:
                running.append(self._submit(call, tool, parsed))
        self._wait_turn(seq, calls, running)

    def resume(self, seq: Any) -> None:
        """parallel_calls: a continuation cut while its turn's calls ran (`seq.resume_turn`,
        Sequence._restore_parallel_calls): the calls answered before the abort keep their
        answers, those that were running run again (counted already), and the sample waits."""
        calls, seq.resume_turn = seq.resume_turn, None
        running = []
        for call in calls:
            if call.output is not None:
                continue
            call.error = call.latency_s = None
            parsed = parse_tool_call(call.expr)
            tool = None if parsed.error else self.box.by_name.get(parsed.name)
            if tool is None:  # it ran before: only an engine with other tools gets here
                self._record(call, None, parsed.error or f"unknown tool {parsed.name!r}", 0.0)
            else:
                running.append(self._submit(call, tool, parsed))
        self._wait_turn(seq, calls, running)

    def _wait_turn(self, seq: Any, calls: list[ToolCall], running: list[PendingCall]) -> None:
        if running:
            seq.pending = PendingTurn(calls, running)
            self.waiting.append(seq)
        else:
            self._force_turn(seq, calls)

    def poll(self) -> bool:
        """Answer every waiting sample whose call finished or ran past its timeout. Returns
        True if any sample left the waiting list (the decode batch must be rebuilt)."""
        now = time.perf_counter()
        still = []
        for seq in self.waiting:
            if isinstance(seq.pending, PendingTurn):
                if self._poll_turn(seq, now):
                    seq.pending = None
                else:
                    still.append(seq)
                continue
            p: PendingCall = seq.pending
            got = self._outcome(p, now)
            if got is None:
                still.append(seq)
                continue
            self._answer(seq, p.call, *got)  # outside _outcome: the answer's own failure is not the tool's
            seq.pending = None
        changed = len(still) != len(self.waiting)
        self.waiting = still
        return changed

    def _outcome(self, p: PendingCall, now: float) -> tuple[str | None, str | None, float] | None:
        """(output, error, latency_s) of a call that finished or ran past its timeout (then
        abandoned), None while it runs."""
        if p.future.done():
            took = getattr(p.future, "batchgen_done_at", now) - p.t0  # queue + run, not our polling
            try:
                return p.future.result(), None, took
            except ToolError as e:
                return None, str(e), took
            except BaseException as e:  # noqa: BLE001 - a tool's own failure, never the engine's
                return None, f"{p.call.name} raised {type(e).__name__}: {e}", took
        if (deadline := p.deadline()) is not None and now > deadline:
            self.runner.abandon(p.future)
            return None, f"{p.call.name} timed out after {p.timeout_s:g} s", now - p.t0
        return None

    def _poll_turn(self, seq: Any, now: float) -> bool:
        """poll for a PendingTurn: record each call that finished or timed out; once none runs,
        force the turn's tool messages. Returns True then."""
        turn: PendingTurn = seq.pending
        left = []
        for p in turn.running:
            got = self._outcome(p, now)
            if got is None:
                left.append(p)
            else:
                self._record(p.call, *got)
        turn.running = left
        if left:
            return False
        self._force_turn(seq, turn.calls)
        return True

    def wait(self) -> bool:
        """Block until a waiting call finishes, times out, or MAX_BLOCK_S passes (the engine
        has nothing else to do); then `poll`."""
        if self.waiting:
            now = time.perf_counter()
            running = [p for s in self.waiting for p in _running(s.pending)]
            first_deadline = min((d for p in running if (d := p.deadline()) is not None),
                                 default=now + MAX_BLOCK_S)
            timeout = max(0.0, min(MAX_BLOCK_S, first_deadline - now))
            concurrent.futures.wait([p.future for p in running], timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return self.poll()

    def cancel(self, seq: Any) -> None:
        """`seq` is aborted while its tool runs: it stops waiting, the call is abandoned (a
        thread cannot be killed: its result is dropped) and recorded as not finished; a
        continuation of the sample runs it again (Sequence.replay). With parallel_calls, every
        call of the turn still running is; the turn's answered calls keep their answers."""
        self.waiting = [s for s in self.waiting if s is not seq]
        for p in _running(seq.pending):
            self.runner.abandon(p.future)
            p.call.error = "not finished: the sample was aborted while the tool ran"
            p.call.latency_s = time.perf_counter() - p.t0
        seq.pending = None

    def _record(self, call: ToolCall, output: str | None, error: str | None, latency: float) -> None:
        """Set the call's answer: what the model is shown (`output`), `error`, `latency_s`."""
        # cut first (ToolBox.max_response_chars): a huge result is never scanned or tokenized whole
        if error is None:
            text = _utf8(self.box.shown(output))
        else:
            text, error = _utf8(self.box.shown(f"Error: {error}")), _utf8(self.box.shown(error))
        call.output, call.error, call.latency_s = text, error, latency

    def _answer(self, seq: Any, call: ToolCall, output: str | None, error: str | None, latency: float) -> None:
        self._record(call, output, error, latency)
        toks = self.responses.suffix(call.output)
        call.forced_start = len(seq.tokens)
        call.end = len(seq.tokens) + len(toks)
        seq.forced.extend(toks)

    def _force_turn(self, seq: Any, calls: list[ToolCall]) -> None:
        """Queue the tool messages of a turn's answered calls (after the sampled end-of-turn
        token): every call of the turn gets the block's span [forced_start, end)."""
        toks = self.responses.after_turn_end([c.output for c in calls])
        for call in calls:
            call.forced_start = len(seq.tokens)
            call.end = len(seq.tokens) + len(toks)
        seq.forced.extend(toks)


__all__ = ["ToolTurns", "PendingCall", "PendingTurn"]
