"""Prefix caching across prompts: a new prompt that begins with the same blocks of tokens as a
prompt already stored in the KV cache copies those positions' keys and values from that
prompt's run and is prefilled from there on.

Why: RL rollouts and synthetic-data jobs send many prompts behind one long prefix (a system
prompt, few-shot examples: bench_rl.py's 8 GSM8K questions share an 8-shot prefix of about
1,100 tokens), and without this every prompt prefills it again. vLLM's automatic prefix
caching and SGLang's radix cache share such blocks between requests; here the prefix is
copied into the new prompt's own run instead, so decode attention and the scheduler's memory
accounting are unchanged (each prompt keeps one contiguous run) and only the prefill's
compute is saved. A copy of a position costs its bytes of KV (46 KiB for SmolLM2 in float32);
computing it costs a forward of one token through every layer.

Correctness rests on the engine's batch invariance: a position's keys and values depend only
on the tokens up to it, and prefill attention computes a row the same way whether or not the
positions before its chunk were cached (engine/kernels/csrc/prefill_attention.cpp), so a
prompt's samples are bit-identical with and without the cache. The engine turns it on only
where that holds: the compiled CPU kernels, and models that can resume a prefill
(`CausalLM.resumes_prefill`: those without per-sequence state, and nanochat, whose smear
reads the cached prefix's last token from `StepBatch.prev_tokens`).

Matching follows vLLM's block hashes: a prompt's full blocks of `block_size` tokens are
chained (each block's hash covers every token before it), a new prompt walks its chain
through the index of stored prompts, and the candidate's tokens are compared before use (a
hash collision costs a comparison, never a wrong prefix); the prefix then runs on past the
whole blocks as far as the two prompts agree (a copy need not be whole blocks). The last
token of a prompt is always computed, since its logits start every sample.
"""
from __future__ import annotations

from engine.scheduler import Admission
from engine.sequence import Request


def block_hashes(req: Request, block_size: int) -> list[int]:
    """The chained hashes of `req`'s full blocks of prompt tokens: entry i covers tokens [0,
    (i + 1) * block_size). Made once per request (`Request.block_hashes`)."""
    if req.block_hashes is None:
        toks, h, out = req.prompt_tokens, 0, []
        for i in range(len(toks) // block_size):
            h = hash((h, *toks[i * block_size:(i + 1) * block_size]))
            out.append(h)
        req.block_hashes = out
    return req.block_hashes


class PrefixIndex:
    """Stored prompts by the hashes of their leading blocks.

    block_size: tokens per hashed block (the scheduler's KV block); a donor is found by whole
    blocks, and `match` then extends the prefix token by token.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._by_hash: dict[int, Request] = {}

    def add(self, req: Request) -> None:
        """Index `req`'s prompt (its KV is, or will be by the time it is read, in its run)."""
        for h in block_hashes(req, self.block_size):
            self._by_hash.setdefault(h, req)

    def match(self, req: Request) -> tuple[Request | None, int]:
        """(donor, n): the indexed prompt sharing the most whole blocks with `req`, and n, the
        length of their common prefix (past those blocks too) but at most len(prompt) - 1;
        or (None, 0)."""
        donor, blocks = None, 0
        for i, h in enumerate(block_hashes(req, self.block_size)):
            cand = self._by_hash.get(h)
            if cand is None:
                break
            donor, blocks = cand, i + 1
        if donor is None:
            return None, 0
        mine, theirs = req.prompt_tokens, donor.prompt_tokens
        n = blocks * self.block_size
        if theirs[:n] != mine[:n]:
            return None, 0  # a hash collision: compute the prompt whole
        end = min(len(theirs), len(mine) - 1)  # past the whole blocks, the donor's tokens as far as they agree
        while n < end and theirs[n] == mine[n]:
            n += 1
        n = min(n, len(mine) - 1)
        return (donor, n) if n > 0 else (None, 0)


def plan_prefills(prefills: list[Admission], stored: list[Request], block_size: int
                  ) -> tuple[list[list[Admission]], dict[int, tuple[Request, int]]]:
    """Split one step's prefills into waves and pick each prompt's cached prefix.

    prefills: the step's admissions that prefill, in admission order; stored: requests whose
    prompt KV is already in the cache (their runs are complete). Returns (waves, cached):
    cached maps id(request) to (donor, n), the request's first n positions to be copied from
    the donor's run; a prompt whose donor is another prompt of this step goes in the second
    wave, after its donor's prefill (a donor is always in the first wave, so two waves do).
    """
    index = PrefixIndex(block_size)
    for req in stored:
        index.add(req)
    first: list[Admission] = []
    second: list[Admission] = []
    cached: dict[int, tuple[Request, int]] = {}
    this_step: set[int] = set()
    for a in prefills:
        donor, n = index.match(a.request)
        if donor is not None:
            cached[id(a.request)] = (donor, n)
        if donor is not None and id(donor) in this_step:
            second.append(a)
        else:
            first.append(a)
            index.add(a.request)
            this_step.add(id(a.request))
    return [w for w in (first, second) if w], cached
