"""One sample's state while it decodes: its tokens, mask, logprobs and tool state machine.

The tool protocol is nanochat's (nanochat/engine.py): tokens the model samples between
<|python_start|> and <|python_end|> are decoded and handed to the calculator; its result
is then forced into the sequence as <|output_start|> result <|output_end|>, one token per
step, with mask 0 and no logprob. Unlike nanochat, a failed call is not silent: the model
sees "Error: <why>" as the output, and every call is recorded as a ToolCall: one that
<|python_start|> again leaves open (nanochat drops its tokens: so do we) as not finished, one
whose <|python_end|> ends the sample (nothing can be forced) as not run.

Hermes tool calls (engine/tool_calls.py): with an engine's tools, the sampled tokens' bytes
feed a `HermesScanner`; a completed <tool_call>...</tool_call> is left in `new_call` for the
engine, which runs it on a thread while the sample waits (`pending`) outside the decode batch,
then forces the template's rendering of the result, as the calculator's output is forced.
With tools.parallel_calls (`parallel_calls`) a closed call is only recorded (`turn_calls`); a
sampled stop token that ends the template's assistant turn then runs the turn's calls
(engine/tool_turns.py), and the sample goes on after their forced tool messages.

A sample ends on a stop token (kept as its last token, with mask 1 and its logprob: the
model chose to stop, and a trainer must score that choice), on a stop string completed in
its sampled text (engine/tokenizers/stop_strings.py; every token kept; forced tool output is
not matched), or at max_tokens / the context window.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.params import Sample, SamplingParams, ToolCall
from engine.tokenizers.stop_strings import StopStringMatcher, token_bytes
from engine.tool_calls import HermesScanner, ToolResponses
from engine.tools import calculator


def _decode(tokenizer, ids: list[int]) -> str:
    """Decode an expression; ids the tokenizer lacks (a model vocabulary padded past the
    tokenizer's) become U+FFFD rather than an exception, and the calculator rejects them."""
    try:
        return tokenizer.decode(ids)
    except ValueError:
        return "".join(tokenizer.decode([i]) if 0 <= i < tokenizer.vocab_size else "\ufffd" for i in ids)


@dataclass(slots=True)
class ToolTokens:
    """The special token ids of the calculator protocol, or None when the tokenizer lacks them."""

    python_start: int
    python_end: int
    output_start: int
    output_end: int


@dataclass(slots=True)
class Request:
    """A prompt waiting for, or holding, KV memory and decoding slots.

    next_sample counts samples already admitted, num_finished those done. While some of its
    samples still wait, a prefilled prompt keeps its KV run (`kv_block`: the first block of
    the run, None before the prefill; a compaction moves it: Engine._compact), the logits its first tokens are drawn from
    (`first_logits`, (vocab,) float32) and the model state after it (`prompt_state`, for
    models with per-sequence state), so that those samples join later without a prefill.
    """

    request_id: object
    prompt_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    samples: list[Sample | None]
    next_sample: int = 0
    num_finished: int = 0
    kv_block: int | None = None
    first_logits: Any = None
    prompt_state: dict | None = None
    resume: Sample | None = None  # a continuation (Engine.continue_request): the aborted sample it goes on from
    parent: Any = None  # ... and the request it belongs to (engine.preemption.Continued)
    block_hashes: list[int] | None = None  # its prompt's chained block hashes (engine/prefix_cache.py)


@dataclass(slots=True)
class Sequence:
    """One sample decoding in one slot, with its own run of the KV arena.

    `last_token` is the token to feed at `position` on the next decode step; `key` keys its
    sampling noise (see engine/sampling.py). slot: its row of per-sequence model state and
    its key in Engine.running. KV (engine/kernels/kv_layout.py): sequence positions own_pos0, ... live
    at arena positions own_start, ...; prefix_start is the arena position of its prompt's
    shared run (-1: it has its own copy of the prompt, own_pos0 = 0). own_block, own_blocks:
    the run as the scheduler allocated it.
    """

    request: Request
    sample_index: int
    slot: int
    key: tuple[int, int]
    own_block: int = 0
    own_blocks: int = 0
    own_start: int = 0
    own_pos0: int = 0
    prefix_start: int = -1
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    forced: deque = field(default_factory=deque)
    in_python: bool = False
    expr_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_matcher: StopStringMatcher | None = None
    num_prior: int = 0  # tokens replayed from an aborted sample (`replay`); they are in the prompt's KV too
    weight_version: int = 0  # the engine's weight_version when the sample was admitted
    scanner: HermesScanner | None = None  # Hermes tool calls in the sampled text (engine tools only)
    new_call: tuple[int, str] | None = None  # (start token, call text) completed by the last token
    pending: Any = None  # engine.engine.PendingCall while a tool runs: the sample waits
    num_turns: int = 0  # tool results forced so far (Hermes calls)
    calls_by_name: dict = field(default_factory=dict)
    first_pending: bool = False  # a continuation whose first token is a tool result still running
    parallel_calls: bool = False  # tools.parallel_calls: calls run when the model ends its turn
    turn_calls: list = field(default_factory=list)  # ... the turn's closed calls (ToolCall), not run yet
    resume_turn: list | None = None  # a continuation cut while its turn's calls ran: those calls (replay)
    top: dict = field(default_factory=dict)  # top_logprobs: index in tokens -> (ids, logprobs), sampled ones

    def __post_init__(self) -> None:
        if self.request.params.stop:
            self.stop_matcher = StopStringMatcher(self.request.params.stop, self.request.params.skip_special_tokens)

    @property
    def position(self) -> int:
        """Position of the last token in the sequence (prompt + generated), 0-based."""
        return len(self.request.prompt_tokens) + len(self.tokens) - 1 - self.num_prior

    @property
    def num_cached(self) -> int:
        """Positions of the sequence whose keys and values are in the KV cache (0, 1, ...,
        num_cached - 1; in its prompt's run or its own): all but the last token's, which the
        next decode step feeds, except in a continuation waiting for its first token
        (`first_pending`), whose last token is its prompt's last, prefilled."""
        return self.position + 1 if self.first_pending else self.position

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def next_is_forced(self) -> bool:
        return bool(self.forced)

    def append(self, token: int, logprob: float | None, tools: ToolTokens | None, tokenizer, max_len: int) -> None:
        """Take the step's token (the sampled one, or the next forced one) and update state.

        Sets finish_reason when the sample ends: "stop" for a sampled stop token (kept as the
        last token) or a completed stop string (stop_reason says which), "length" at
        max_tokens or when the sequence fills `max_len` positions. Stop strings are matched on
        the sampled text only: forced tool output is not the model's, so it neither completes
        a stop string (a chat template's "<|im_end|>" in a tool message would end every call)
        nor joins the text a match spans. With params.skip_special_tokens a sampled special
        token's text is left out of the matched text (vLLM's default), as if it were empty.
        """
        forced = logprob is None
        if forced and self.parallel_calls and self.mask and self.mask[-1] == 1 \
                and self.tokens[-1] in self.request.stop_ids:
            self.end_turn_scan()  # the first token of a turn's tool messages (replay meets it here too)
        self.tokens.append(token)
        self.mask.append(0 if forced else 1)
        self.logprobs.append(logprob)
        if not forced and token in self.request.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
            return
        scan = not forced and (self.stop_matcher is not None or self.scanner is not None)
        data = token_bytes(tokenizer, token) if scan else b""
        if self.stop_matcher is not None:
            if forced:
                self.stop_matcher.reset()
            elif not self.stop_matcher.skips(token, tokenizer) and (hit := self.stop_matcher.feed(data)) is not None:
                self.finish_reason, self.stop_reason = "stop", hit
                return
        if self.scanner is not None and not forced:
            self.new_call = self.scanner.feed(len(self.tokens) - 1, data)
        limit = self.request.params.max_tokens  # None: only the context window ends it
        if (limit is not None and len(self.tokens) >= limit) or self.position + 1 >= max_len:
            self.finish_reason = "length"
        if tools is not None and not forced and self.request.params.calculator:
            self._tool_step(token, tools, tokenizer)  # after the length check: a call the last token closes is not run

    def full(self, max_len: int) -> bool:
        """Whether no token may follow: max_tokens reached, or the sequence fills max_len."""
        limit = self.request.params.max_tokens
        return (limit is not None and len(self.tokens) >= limit) or self.position + 1 >= max_len

    def end_turn_scan(self) -> None:
        """tools.parallel_calls: the assistant's turn ended on its stop token and its calls run.
        A <tool_call> the turn left open is over (the next turn starts a new search): it is
        recorded as not finished, its span up to the stop token."""
        sc = self.scanner
        if sc is not None and sc.open_at is not None:
            self.tool_calls.append(ToolCall(start=sc.open_start, end=len(self.tokens) - 1, expr=sc.open_text(),
                                            output=None, error="call not finished: the turn ended before </tool_call>"))
            self.tool_calls.sort(key=lambda c: c.start)
        if sc is not None:
            sc.reset()

    def tools_due(self) -> bool:
        """Whether the engine's ToolTurns.start must see the last token: it closed a Hermes call,
        or (tools.parallel_calls) it ended a sample whose turn holds closed calls."""
        return self.new_call is not None or (bool(self.turn_calls) and self.finish_reason is not None)

    def _tool_step(self, token: int, tools: ToolTokens, tokenizer) -> None:
        if token == tools.python_start:
            if self.in_python:  # <|python_start|> again before <|python_end|>: the open call is dropped
                call = self.tool_calls[-1]  # (nanochat forgets its tokens too), recorded as not finished
                call.expr = _decode(tokenizer, self.expr_tokens)
                call.error = "call not finished: <|python_start|> again"
                call.end = len(self.tokens) - 1
            self.in_python = True
            self.expr_tokens = []
            self.tool_calls.append(ToolCall(start=len(self.tokens) - 1, end=len(self.tokens), expr="",
                                            output=None, error=None, name="calculator"))
        elif token == tools.python_end and self.in_python:
            self.in_python = False
            call = self.tool_calls[-1]
            call.expr = _decode(tokenizer, self.expr_tokens)
            if self.finish_reason is not None:  # the sample ends on <|python_end|>: nothing is shown to the model
                call.error = f"not run: the sample ended ({self.finish_reason}) with the call"
                call.end = len(self.tokens)
                return
            t0 = time.perf_counter()
            result = calculator(call.expr) if call.expr.strip() else None
            call.latency_s = time.perf_counter() - t0
            if result is None:
                call.error = "empty expression"
                text = "Error: empty expression"
            elif result.error is not None:
                call.error = result.error
                text = f"Error: {result.error}"
            else:
                text = result.output
            call.output = text
            call.forced_start = len(self.tokens)
            out = [tools.output_start, *tokenizer.encode(text), tools.output_end]
            self.forced.extend(out)
            call.end = len(self.tokens) + len(out)
        elif self.in_python:
            self.expr_tokens.append(token)

    def to_sample(self, tokenizer) -> Sample:
        """The finished Sample (tool-call spans clipped to the tokens actually generated)."""
        n = len(self.tokens)
        if self.in_python:  # the sample ended inside <|python_start|> ... : record the open call
            call = self.tool_calls[-1]
            call.expr = _decode(tokenizer, self.expr_tokens)
            call.error = "call not finished: the sample ended before <|python_end|>"
            call.end = n
        for call in self.turn_calls:  # tools.parallel_calls: closed calls whose turn never ended
            call.error = f"not run: the sample ended ({self.finish_reason or 'length'}) before the turn's calls ran"
        self.turn_calls = []
        if self.scanner is not None and self.scanner.open_at is not None:  # inside <tool_call> ...
            self.tool_calls.append(ToolCall(start=self.scanner.open_start, end=n, expr=self.scanner.open_text(),
                                            output=None, error="call not finished: the sample ended before "
                                            "</tool_call>"))
        for call in self.tool_calls:
            call.end = min(call.end, n)
            if call.forced_start is not None and call.forced_start >= n:
                call.forced_start = None
        p = self.request.params
        return Sample(prompt_id=self.request.prompt_id, sample_index=self.sample_index, tokens=self.tokens,
                      mask=self.mask, logprobs=self.logprobs, finish_reason=self.finish_reason or "length",
                      tool_calls=self.tool_calls, error=None, num_prompt_tokens=len(self.request.prompt_tokens),
                      seed=p.seed, stop_reason=self.stop_reason)

    def replay(self, prior: Sample, tools: ToolTokens | None, tokenizer, max_len: int,
               responses: ToolResponses | None = None) -> None:
        """Take an aborted sample's tokens as this sample's first ones (a continuation: its
        request's prompt is the original prompt followed by them, so their KV is the
        prompt's). Each token goes through `append` again, sampled or forced as it was, so
        the stop-string matcher, the tool state machine (an open call, tool output still to
        force) and the tool calls are what they were when the sample stopped; the calculator
        runs again on finished calls (a pure function). responses: the engine's renderer of
        Hermes tool messages (ToolTurns.responses), needed when the sample has a scanner."""
        self.num_prior = len(prior.tokens)
        for tok, lp in zip(prior.tokens, prior.logprobs):
            if lp is None and self.forced:
                self.forced.popleft()
            self.new_call = None  # only a call the last token closes is still to handle
            self.append(tok, lp, tools, tokenizer, max_len)
            if self.parallel_calls and self.finish_reason == "stop" and lp is not None and tok in self.request.stop_ids:
                # the end of a tool turn: an aborted sample never holds the stop token that ended it
                self.finish_reason = self.stop_reason = None
        if self.scanner is not None and self.parallel_calls:
            self._restore_parallel_calls(prior, responses)
        elif self.scanner is not None:
            self._restore_hermes_calls(prior, responses)

    def _restore_hermes_calls(self, prior: Sample, responses: ToolResponses) -> None:
        """Hermes calls are recorded by the engine's ToolTurns, not by `append`: take the prior
        sample's records, and its turn and per-tool counts, as they were. A call the abort cut
        while its tool ran ("not finished") is left out: its closing token, the last replayed,
        leaves it in `new_call`, and the engine runs it again. So is an open call (the scanner
        holds it again). The last answered call's result tokens that the abort cut off (all
        of them when it came before the first was fed: a call refused at once) are queued in
        `forced` again, and its record gets back the forced span `to_sample` clipped."""
        cut = self.new_call[0] if self.new_call is not None else None
        last = None  # the answered call latest in the sample: only its result can be unfinished
        for c in prior.tool_calls:
            if c.name == "calculator" or (c.error or "").startswith(("call not finished", "not finished")):
                continue
            if c.start == cut:  # answered or refused already: nothing to run again
                self.new_call = None
            call = dataclasses.replace(c)
            self.tool_calls.append(call)
            if call.output is not None and (last is None or call.start > last.start):
                last = call
            if not (c.error or "").startswith("not run"):
                self.num_turns += 1
                if c.name is not None:
                    self.calls_by_name[c.name] = self.calls_by_name.get(c.name, 0) + 1
        self.tool_calls.sort(key=lambda c: c.start)
        if last is not None:
            # ToolTurns._answer queued the result's tokens, and it does not run on replay. The
            # rendering is a function of the output text, so it gives the same tokens again.
            # to_sample dropped a forced_start at the sample's end: then none had been fed.
            toks = responses.suffix(last.output)
            n = len(prior.tokens)
            first = n if last.forced_start is None else last.forced_start
            last.forced_start, last.end = first, first + len(toks)
            self.forced.extend(toks[n - first:])

    def _restore_parallel_calls(self, prior: Sample, responses: ToolResponses) -> None:
        """`_restore_hermes_calls` for tools.parallel_calls, where a turn's calls run together
        once its stop token is sampled (engine/tool_turns.py). From the prior sample's records:
        - a forced turn's calls (forced_start set: one block per turn) are kept, and the rest of
          the latest block, if the abort cut it, is queued in `forced` again;
        - calls "not run: the sample ended (abort) ..." are the turn the abort cut before its
          stop token: they wait in `turn_calls` again, to run when the turn ends;
        - calls with no forced_start otherwise (answered, or "not finished" while their tool ran)
          are the turn whose stop token is the last replayed token: `resume_turn`, which the
          engine (ToolTurns.resume) completes, running the unfinished ones again;
        - "call not finished" records are skipped: the replay's scanner makes them again.
        Turns and per-tool counts are those of every turn that ran (forced or resumed)."""
        self.new_call = None  # a closing call is recorded when it closes (it runs with its turn): see its record
        blocks: dict[int, list[ToolCall]] = {}
        resume: list[ToolCall] = []
        for c in prior.tool_calls:
            err = c.error or ""
            if c.name == "calculator" or err.startswith("call not finished"):
                continue
            call = dataclasses.replace(c)
            self.tool_calls.append(call)
            if err.startswith("not run"):
                call.error = None
                self.turn_calls.append(call)
            elif call.forced_start is not None:
                blocks.setdefault(call.forced_start, []).append(call)
            else:
                resume.append(call)
        self.tool_calls.sort(key=lambda c: c.start)
        self.turn_calls.sort(key=lambda c: c.start)
        resume.sort(key=lambda c: c.start)
        for calls in [*blocks.values(), *([resume] if resume else [])]:
            self.num_turns += 1
            for c in calls:
                if c.name is not None:
                    self.calls_by_name[c.name] = self.calls_by_name.get(c.name, 0) + 1
        if resume:
            self.end_turn_scan()  # as ToolTurns.end_turn did when the turn ended
            self.resume_turn = resume
        elif blocks:
            # the latest block: the forced tokens of its turn that the abort cut off
            first = max(blocks)
            last = sorted(blocks[first], key=lambda c: c.start)
            toks = responses.after_turn_end([c.output for c in last])
            for c in last:
                c.end = first + len(toks)
            self.forced.extend(toks[len(prior.tokens) - first:])
