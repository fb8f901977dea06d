"""Which prompts get slots, and when (continuous batching under a fixed KV budget).

The KV cache has a fixed number of slots; a sample holds one slot from its prefill to its
last token, and gives it back at once when it finishes, so waiting prompts are admitted
while others are still decoding (continuous batching, as in vLLM / nano-vllm). A prompt's
samples are admitted together when they fit, so the prompt is prefilled once and its KV
fanned out; a prompt with more samples than the whole cache has slots is admitted in
groups (each group prefills the prompt again; sampling is keyed per sample, so the result
is the same). Free slots are handed out lowest first, which keeps the decode batch a
compact range of slots that attention can read without copying.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from engine.sequence import Request


@dataclass(slots=True)
class PrefillGroup:
    """Samples [first_sample, first_sample + len(slots)) of `request`, prefilled together."""

    request: Request
    first_sample: int
    slots: list[int]


class Scheduler:
    """Admission control over `num_slots` KV slots.

    max_prefill_tokens: bound on one prefill batch's padded size (prompts x longest prompt,
    in tokens), which bounds prefill activation memory; a single longer prompt still runs alone.
    """

    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.free: list[int] = list(range(num_slots))
        heapq.heapify(self.free)
        self.waiting: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def schedule(self) -> list[PrefillGroup]:
        """Admit what fits now, in arrival order (a prompt that does not fit is passed over)."""
        groups: list[PrefillGroup] = []
        longest = 0
        kept: deque[Request] = deque()
        while self.waiting:
            req = self.waiting.popleft()
            remaining = req.params.num_samples - req.next_sample
            if remaining <= len(self.free):
                n = remaining
            elif remaining > self.num_slots and self.free:
                n = len(self.free)  # more samples than the cache holds: admit a group now
            else:
                kept.append(req)
                continue
            new_longest = max(longest, len(req.prompt_tokens))
            if groups and (len(groups) + 1) * new_longest > self.max_prefill_tokens:
                kept.append(req)
                kept.extend(self.waiting)
                self.waiting.clear()
                break
            longest = new_longest
            slots = [heapq.heappop(self.free) for _ in range(n)]
            groups.append(PrefillGroup(req, req.next_sample, slots))
            req.next_sample += n
            if req.next_sample < req.params.num_samples:
                kept.append(req)
        self.waiting = kept
        return groups
