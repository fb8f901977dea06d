"""Ending requests early and continuing them: `Engine.abort`, `Engine.continue_request`.

vLLM's abort_request and pause_generation(mode="keep"), for one engine, between steps:

- `abort(engine, ids)`: each request comes back whole, as a finished one does. Its
  finished samples stay as they are; its running samples end at once with their tokens
  so far and finish_reason "abort", their KV runs and decoding slots freed as when a
  sample finishes; its samples not admitted yet come back with no tokens and "abort"; it
  leaves the waiting queue. The rest of the batch is untouched: the decode batch is rebuilt
  without the rows, so on CPU with batch_invariant every other sample is bit-identical to a
  run without the abort.
- `continue_request(engine, output, params)`: an aborted request queued again. Each
  aborted sample becomes a continuation: a request of one sample whose prompt is the
  original prompt followed by the sample's tokens (prefilled again, so its KV is recomputed
  with the weights loaded now; nothing of the old KV is kept), keyed by the sample's own
  index, so its noise goes on at the position where it stopped; its tokens are replayed
  through the sample's state machine (Sequence.replay: stop strings, an open calculator
  call, tool output still to force). Continuations fold back into their request
  (`complete`), which `step` returns once all its samples are done. A request none of whose
  samples started is simply queued again (its samples share one prefill).

Weights change only while the engine is idle (Engine.apply_weights), so a sequence's tokens
share one weight version; a continued sample carries its earlier tokens' versions
(Sample.weight_versions).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from engine.params import RequestOutput, Sample, SamplingParams
from engine.sequence import Request


@dataclass(slots=True, eq=False)
class Continued:
    """A request continued by `continue_request`: its samples (aborted ones replaced as their
    continuations finish) and how many continuations are still running."""

    request_id: Any
    prompt_id: str
    prompt_tokens: list[int]
    samples: list[Sample]
    pending: int = 0


def abort(engine: Any, request_ids: Iterable[Any]) -> list[RequestOutput]:
    """End requests `request_ids` of `engine` (see the module docstring); returns their
    outputs. A continued request is aborted by its request_id. Ids not in the engine
    (unknown, or finished already: a finished output still comes from `step`) are ignored."""
    ids = set(request_ids)

    def aborted(req: Request) -> bool:
        return req.request_id in ids or (req.parent is not None and req.parent.request_id in ids)

    sched = engine.scheduler
    reqs: dict[int, Request] = {}
    for r in [s.request for s in engine.running.values()] + list(sched.waiting):
        if aborted(r):
            reqs.setdefault(id(r), r)
    if not reqs:
        return []
    sched.waiting = type(sched.waiting)(r for r in sched.waiting if not aborted(r))
    for req in reqs.values():  # samples never admitted
        for j in range(req.next_sample, req.params.num_samples):
            req.samples[j] = req.resume if req.resume is not None else Sample(
                prompt_id=req.prompt_id, sample_index=j, finish_reason="abort",
                num_prompt_tokens=len(req.prompt_tokens), seed=req.params.seed)
            req.num_finished += 1
        req.next_sample = req.params.num_samples
    running = {id(s.request) for s in engine.running.values()}
    outs: list[RequestOutput] = []
    for req in reqs.values():  # nothing running: done now (else its last running sample completes it)
        out = None if id(req) in running else complete(engine, req)
        if out is not None:
            outs.append(out)
    for slot in [slot for slot, seq in engine.running.items() if aborted(seq.request)]:
        seq = engine.running.pop(slot)
        seq.finish_reason = seq.finish_reason or "abort"
        out = engine._finish(seq)
        if out is not None:
            outs.append(out)
    return outs


def continue_request(engine: Any, output: RequestOutput, params: SamplingParams, request_id: Any = None) -> None:
    """Queue `output` (a request that `abort` ended) again to finish it (see the module
    docstring). params: the request's SamplingParams, as first given. request_id: default
    output.request_id. A sample with nothing left to generate (max_tokens or the context
    window reached) ends as "length"."""
    rid = output.request_id if request_id is None else request_id
    prompt = list(output.prompt_tokens)
    samples = sorted(output.samples, key=lambda x: x.sample_index)
    if all(x.finish_reason == "abort" and not x.tokens for x in samples):
        engine.add_request(prompt, params, output.prompt_id, request_id=rid)
        return
    parent = Continued(rid, output.prompt_id, prompt, list(samples))
    stop = engine.default_stop_ids if params.stop_token_ids is None else frozenset(params.stop_token_ids)
    one = dataclasses.replace(params, num_samples=1)
    for x in samples:
        if x.finish_reason != "abort":
            continue
        if len(prompt) + len(x.tokens) >= engine.max_seq_len or (
                params.max_tokens is not None and len(x.tokens) >= params.max_tokens):
            x.finish_reason = "length"  # nothing left to generate
            continue
        parent.pending += 1
        engine.scheduler.add(Request((rid, x.sample_index), output.prompt_id, prompt + list(x.tokens), one, stop,
                                     [None], resume=x, parent=parent))
    if not parent.pending:
        engine._ready.append(RequestOutput(rid, output.prompt_id, prompt, parent.samples))


def complete(engine: Any, req: Request) -> RequestOutput | None:
    """Every sample of `req` is done: free its stored prompt and return its output (for a
    continuation: fold its sample into its request, returned once all are done)."""
    engine.scheduler.release_prompt(req)
    parent = req.parent
    if parent is None:
        return RequestOutput(request_id=req.request_id, prompt_id=req.prompt_id, prompt_tokens=req.prompt_tokens,
                             samples=list(req.samples))
    sample = req.samples[0]
    sample.num_prompt_tokens = len(parent.prompt_tokens)
    parent.samples[sample.sample_index] = sample
    parent.pending -= 1
    if parent.pending:
        return None
    return RequestOutput(request_id=parent.request_id, prompt_id=parent.prompt_id,
                         prompt_tokens=parent.prompt_tokens, samples=list(parent.samples))
