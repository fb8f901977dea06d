"""The step loop: admit, prefill once, decode everyone, finish and free.

Each `step()`:
1. the scheduler admits waiting requests into KV memory and decoding slots (memory by
   need, engine/scheduler.py); prompts admitted for the first time are prefilled together
   in one right-padded batch, each prompt once, its KV written once to its own run (a
   prompt that begins like a stored one copies that prefix's KV and is prefilled from there:
   engine/prefix_cache.py); every admitted sample draws its first token from its prompt's
   last logits (samples admitted later draw it from the same stored logits: no second
   prefill);
2. every running sample decodes one token in one batch (continuous batching: rows that
   finish free their memory at once, and the next step admits waiting samples into it).
   With prefix sharing, a sample attends to its prompt's stored KV, read once per prompt
   for all its samples, and to its own generated KV (engine/kernels/attention.py);
3. finished requests are returned.

Before step 1, if the free KV blocks are enough in total for what arrival order admits next
but cut into ranges too short for it, the arena is compacted (`_compact`): the live runs
slide down, their keys and values copied exactly, and the sequences' runs updated, so the
free blocks become one range. This happens only between steps, and changes no sample's bits
(attention reads a run the same wherever it starts).

Tools (engine/tool_turns.py): a sample whose sampled text completes a Hermes <tool_call>
leaves the decode batch while its tool runs on a thread; the others go on decoding. Once the
result is in, the template's rendering of it is fed as forced tokens (mask 0, no logprob) and
the sample samples again. With tools.parallel_calls the calls of a turn run together once the
model samples its end-of-turn token, and their tool messages are forced together. When every
running sample waits on a tool and nothing can be admitted, `step()` blocks on the tools (at
most engine/tool_turns.py MAX_BLOCK_S).

`generate()` runs steps until its prompts are done; workers use the streaming form
(`add_request` / `step`) to keep one engine full across many work units.
"""
from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Iterable, Sequence as Seq

import torch

from engine import compaction, preemption
from engine.decode_batch import DecodeBatch
from engine.kernels.kv_layout import KVLayout
from engine.kv_cache import KVCache, StepBatch, default_kv_bytes, kv_budget_basis
from engine.models.base import CausalLM
from engine.params import RequestOutput, Sample, SamplingParams, error_output
from engine.prefix_cache import plan_prefills
from engine.sampling import request_key, row_kinds, sample_step
from engine.scheduler import Admission, Scheduler, prefill_batches
from engine.sequence import Request, Sequence, ToolTokens
from engine.tool_calls import HermesScanner
from engine.tool_runner import ToolBox
from engine.tool_turns import ToolTurns

BLOCK_SIZE = 16  # KV positions per allocation unit (engine/run_allocator.py)


class Engine:
    """A model, its tokenizer and a KV cache, serving requests on token ids.

    Args:
        model: a CausalLM (engine/models). tokenizer: engine.tokenizers.base.Tokenizer.
        max_num_seqs: most samples decoding at once (the decode batch), before memory bounds it.
        kv_cache_bytes: KV cache budget in bytes (default: `kv_share` of 90% of the GPU's
            free memory, or of 50% of the host's available memory; engine/kv_cache.py
            `default_kv_bytes`; host pages are only committed when written).
            Memory is reserved by need: a prompt's KV once, plus what each sample can
            generate (min(max_tokens, max_seq_len - prompt length) positions).
        max_seq_len: the longest sequence, prompt + generated, in tokens (default and
            maximum: the model's context window).
        max_prefill_tokens: bound on one prefill batch (prompts x longest prompt, tokens).
        kv_share: this engine's share of its device, in (0, 1], for the default budget (a Ray
            worker's share of its node: cluster/worker.py `node_share`).
        batch_invariant: on CPU, make every sample's logits, and so its tokens and logprobs,
            bit-identical whatever batch it runs in (engine/kernels/attention.py; the projections are
            oneDNN's batch-invariant kernels either way). With the compiled kernels it changes
            nothing (they are invariant by construction); on torch's fallback, False prefills
            the batch in one SDPA call and decodes with torch's kernel in its own blocking, so
            tokens match except at rare near-ties (logits move by about 1e-7)
            (engine/kernels/attention_backend.py). GPUs are not batch-invariant in either mode.
        prefix_sharing: samples of a prompt attend to its stored KV, read once per prompt
            per step for all of them (cascade attention); False gives each sample its own
            copy of the prompt's KV (more memory, more reads; the logits differ in the last
            bits, the tokens only at rare near-ties).
        prefix_caching: a new prompt that begins with a stored prompt's tokens (at least one
            block of 16) copies that prefix's KV from the stored prompt's run and prefills
            only the rest (engine/prefix_cache.py); with batch_invariant its samples are
            bit-identical either way (without, as close as under another batching).
            Takes effect where prefill can resume past position 0 (the compiled CPU kernels;
            models whose per-sequence state allows it, `CausalLM.resumes_prefill`):
            `self.prefix_caching` says whether it did;
            `num_cached_prompt_tokens` counts the positions copied, `num_prefill_tokens` those
            computed.
        tools: the tools the model may call in the Hermes format (engine/tool_runner.py: a
            ToolBox, or a list of Tool / callables / dicts of Tool fields, max_turns 8; a ToolBox
            also sets max_response_chars and parallel_calls);
            None: none (nanochat's calculator does not need this).
    Attribute batched_sampling: the sampler's GPU path (engine/sampling.py: every row of a
    kind in one pass, no host synchronisation), True on a GPU; on CPU tensors it gives the
    CPU path's bits, so tests set it there.
    Raises ValueError for a max_seq_len that is not an integer >= 1, if the budget cannot hold
    one sequence of max_seq_len tokens, or when tools are given and the tokenizer cannot
    render tool messages (no chat template).
    Not thread-safe: one thread drives an engine (cluster/worker.py serialises access).
    """

    def __init__(self, model: CausalLM, tokenizer, *, max_num_seqs: int = 256, kv_cache_bytes: int | None = None,
                 max_seq_len: int | None = None, max_prefill_tokens: int = 8192, batch_invariant: bool = True,
                 prefix_sharing: bool = True, kv_share: float = 1.0, tools: ToolBox | list | None = None,
                 prefix_caching: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        info = model.info
        p = next(model.parameters())
        self.device, self.dtype = p.device, model.kv_dtype  # bfloat16 weights: a bfloat16 KV cache
        # refused, not read as "no limit" (0) or as a window no prompt fits (-5: every request an error)
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral)
                                        or max_seq_len < 1):
            raise ValueError(f"Engine: max_seq_len must be an integer >= 1 (or None for the model's context window), "
                             f"got {max_seq_len!r}")
        self.max_seq_len = min(int(max_seq_len or info.context_len), info.context_len)
        self.prefix_sharing = prefix_sharing
        bs = BLOCK_SIZE
        pos_bytes = KVCache.bytes_per_position(info.n_layer, info.n_kv_head, info.head_dim, self.dtype)
        self.block_bytes = bs * pos_bytes
        need = Scheduler.min_blocks(self.max_seq_len, bs, prefix_sharing)
        useful = max(need, max_num_seqs * (2 * -(-self.max_seq_len // bs) + 1))
        budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_bytes(self.device, kv_share)
        self.kv_budget_bytes = budget
        num_blocks = min(useful, budget // self.block_bytes)
        if num_blocks < need:
            why = (f"KV cache budget of {budget} bytes" if kv_cache_bytes is not None else
                   f"default KV cache budget of {budget} bytes ({kv_budget_basis(self.device, kv_share)})")
            raise ValueError(f"the {why} cannot hold one sequence of {self.max_seq_len} tokens "
                             f"({need * self.block_bytes} bytes); set a KV budget (model.kv_cache_gb), lower "
                             f"max_seq_len, or run fewer workers per node")
        self.kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, max_num_seqs, self.max_seq_len,
                          self.dtype, self.device, info.state_dims, batch_invariant=batch_invariant,
                          num_positions=num_blocks * bs, state_dtype=model.act_dtype)
        self.scheduler = Scheduler(max_num_seqs, num_blocks, bs, self.max_seq_len, max_prefill_tokens,
                                   prefix_sharing)
        self.prefix_caching = (prefix_caching and model.resumes_prefill
                               and self.kv.attention.resumes_prefill(model.act_dtype or p.dtype, info.head_dim))
        self.running: dict[int, Sequence] = {}
        self._batch: DecodeBatch | None = None  # the running rows on the device; None: rebuild
        self.batched_sampling = self.device.type != "cpu"
        self._ready: list[RequestOutput] = []
        self._admitting: list[Admission] = []  # the step's admissions, for `_fail` (not all running yet)
        self.tools = self._tool_tokens(tokenizer)
        box = ToolBox.of(tools)
        self.tool_turns = None if box is None else ToolTurns(box, tokenizer, max_len=self.max_seq_len)
        # the checkpoint's own end tokens (Llama family: eos_token_id) when it names any
        self.default_stop_ids = frozenset(info.stop_token_ids or tokenizer.default_stop_token_ids)
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0  # prompt tokens computed by prefills
        self.num_cached_prompt_tokens = 0  # prompt tokens copied from another prompt's run instead
        self.peak_kv_bytes = 0  # most KV memory reserved at once
        self.num_compactions = 0  # arena compactions (see _compact), the positions they moved, their time
        self.compacted_positions = 0
        self.compaction_seconds = 0.0
        self._kv_row_bytes = [0, 0]  # (sum over decode steps of reserved bytes, of running rows)
        self.weight_version = 0  # +1 per swap (a pool sets its own count); tokens record it (Sample.weight_versions)

    @staticmethod
    def _tool_tokens(tokenizer) -> ToolTokens | None:
        names = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
        ids = [tokenizer.special(n) for n in names]
        return None if any(i is None for i in ids) else ToolTokens(*ids)

    @property
    def num_slots(self) -> int:
        """Most samples decoding at once (max_num_seqs)."""
        return self.scheduler.num_slots

    @property
    def cpu_kernels(self) -> str | None:
        """Which kernels a CPU engine computes with: "compiled" (batchgen's library,
        engine/kernels/native.py) or "torch" (it did not build or load here: rows differ in
        their last bits and are not batch-invariant); None off CPU."""
        if self.device.type != "cpu":
            return None
        from engine.kernels.native import native_kernels

        return "torch" if native_kernels() is None else "compiled"

    @property
    def kv_capacity_bytes(self) -> int:
        return self.scheduler.allocator.num_blocks * self.block_bytes

    @property
    def kv_used_bytes(self) -> int:
        """KV memory reserved now (stored prompts and the samples' runs)."""
        a = self.scheduler.allocator
        return (a.num_blocks - a.num_free) * self.block_bytes

    def reset_kv_stats(self) -> None:
        """Start peak_kv_bytes and kv_bytes_per_running_sample afresh (e.g. after a warm-up)."""
        self.peak_kv_bytes = self.kv_used_bytes
        self._kv_row_bytes = [0, 0]

    def kv_bytes_per_running_sample(self) -> float:
        """Reserved KV bytes per running sample over the decode steps so far: the sum over
        steps of the bytes reserved, over the sum of the samples decoding."""
        total, rows = self._kv_row_bytes
        return total / rows if rows else 0.0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_tokens: Seq[int], params: SamplingParams, prompt_id: str | int,
                    request_id: object = None) -> None:
        """Queue one prompt. Never raises for a bad prompt: it finishes as an error output.

        prompt_tokens: token ids; prompt_id: keys the sampling noise with params.seed and the
        sample index (so the same prompt_id and seed give the same samples anywhere).
        request_id: returned with the output (default: prompt_id).
        Raises TypeError when `params` is not a SamplingParams (a dict failed later with an
        AttributeError about stop_token_ids).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"add_request: params must be an engine.params.SamplingParams, got "
                            f"{type(params).__name__} {params!r}")
        prompt_id = str(prompt_id)
        request_id = prompt_id if request_id is None else request_id
        toks = list(prompt_tokens)
        problem = self._check_prompt(toks)
        if problem is not None:
            self._ready.append(error_output(request_id, prompt_id, toks, params, problem))
            return
        stop = self.default_stop_ids if params.stop_token_ids is None else frozenset(params.stop_token_ids)
        req = Request(request_id, prompt_id, toks, params, stop, [None] * params.num_samples)
        self.scheduler.add(req)

    def _check_prompt(self, toks: list[int]) -> str | None:
        if not toks:
            return "empty prompt: no tokens"
        V = self.model.info.vocab_size
        for i, t in enumerate(toks):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                return f"prompt token {i} is {t!r}: token ids must be integers in [0, {V})"
        if len(toks) > self.max_seq_len:
            return (f"prompt has {len(toks)} tokens, more than the context window of {self.max_seq_len} tokens")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._ready or self.running or self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit and prefill, decode one token for every running sample; return finished requests.

        Raises what raised inside (the model's forward: a CUDA error, MemoryError; the
        tokenizer or a stop-string check; KeyboardInterrupt), or RuntimeError when nothing
        fits an empty KV cache. Such a step may be half done (samples admitted but not started,
        some rows advanced and not others), so first every request in flight ends (`_fail`):
        its slots, KV runs and stored prompt are freed, and it comes back from the next `step`
        with its unfinished samples as finish_reason "error" naming the exception, after the
        finished outputs this step had not returned. The engine is then empty, and later
        requests give what they give on a fresh engine.
        """
        done, self._ready = self._ready, []
        try:
            self._step(done)
        except BaseException as exc:
            self._ready[:0] = done
            self._fail(exc)
            raise
        finally:
            self._admitting = []
        return done

    def _step(self, done: list[RequestOutput]) -> None:
        """`step`'s work; appends the requests it finishes to `done`."""
        turns = self.tool_turns
        if turns is not None and turns.waiting and turns.poll():
            self._batch = None  # samples whose tool answered rejoin the batch
            self._force_first()
        admissions = self._admitting = self._schedule()
        if not admissions and not self.running and self.scheduler.waiting:
            # Nothing runs and nothing fits: stored prompts of waiting requests hold the memory.
            self.scheduler.evict_prompts()
            admissions = self._admitting = self._schedule()
            if not admissions:
                raise RuntimeError("engine: nothing running and no waiting request fits an empty KV cache")
        if admissions:
            self._admit(admissions)
            self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_used_bytes)
        if any(s.finish_reason is None and s.pending is None for s in self.running.values()):
            self._decode()
        elif turns is not None and turns.waiting and not admissions and turns.wait():
            self._batch = None
            self._force_first()
        for slot in [s for s, seq in self.running.items() if seq.finish_reason is not None]:
            out = self._finish(self.running[slot])
            del self.running[slot]  # after: a sample whose _finish raised is still in flight for _fail
            if out is not None:
                done.append(out)

    def _fail(self, exc: BaseException) -> None:
        """`step` raised `exc`: end every request in flight (running, waiting, or admitted by
        the step and not started) and leave the engine empty, as a fresh one. Its state may be
        half updated, so it is not unwound request by request: every slot and KV block becomes
        free at once (nothing else holds any), and no stored prompt is kept. Each request is
        queued as an output (`_ready`): its finished samples as they are, the others with
        finish_reason "error" and no tokens (a continuation folds into its request)."""
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        reqs: dict[int, Request] = {}
        for r in ([s.request for s in self.running.values()] + list(self.scheduler.waiting)
                  + [a.request for a in self._admitting]):
            if r.num_finished < r.params.num_samples:  # else complete, and returned already
                reqs.setdefault(id(r), r)
        if self.tool_turns is not None:
            for seq in list(self.tool_turns.waiting):
                if seq.pending is not None:
                    self.tool_turns.cancel(seq)
            self.tool_turns.waiting = []
        self.running = {}
        self._batch = None
        self.scheduler.clear()

        def error(req: Request, j: int, n_prompt: int) -> Sample:
            return Sample(prompt_id=req.prompt_id, sample_index=j, finish_reason="error", error=message,
                          num_prompt_tokens=n_prompt, seed=req.params.seed)

        parents: dict[int, Any] = {}
        for req in reqs.values():
            req.kv_block = req.first_logits = req.prompt_state = None
            if req.parent is None:
                samples = [s if s is not None else error(req, j, len(req.prompt_tokens))
                           for j, s in enumerate(req.samples)]
                self._ready.append(RequestOutput(req.request_id, req.prompt_id, req.prompt_tokens, samples))
            else:  # a continuation: its sample replaces the aborted one in its request
                parent = req.parent
                parent.samples[req.resume.sample_index] = error(req, req.resume.sample_index,
                                                                len(parent.prompt_tokens))
                parents[id(parent)] = parent
        for parent in parents.values():
            parent.pending = 0
            self._ready.append(RequestOutput(parent.request_id, parent.prompt_id, parent.prompt_tokens,
                                             list(parent.samples)))

    def _schedule(self) -> list[Admission]:
        """The step's admissions, after compacting the arena if where its free blocks lie (not
        how many there are) would hold them back."""
        if self.scheduler.fragmented():
            self._compact()
        return self.scheduler.schedule()

    def _compact(self) -> None:
        """Slide every live KV run down so the free blocks become one range (engine/compaction.py)."""
        compaction.compact(self)

    def _prefill(self, group: list[Admission], copied: dict[int, int]) -> torch.Tensor:
        """Prefill the prompts of `group` into their stored runs, each from the end of its
        cached prefix (`copied`, by id of request: positions already copied into the run);
        (len(group), V) last logits, owned (the next chunk's prefill and the decode step do
        not overwrite them)."""
        lengths = [len(a.request.prompt_tokens) for a in group]
        skip = [copied.get(id(a.request), 0) for a in group]
        T = max(n - c for n, c in zip(lengths, skip))
        tokens = torch.zeros(len(group), T, dtype=torch.long)
        for i, a in enumerate(group):
            tokens[i, : lengths[i] - skip[i]] = torch.tensor(a.request.prompt_tokens[skip[i]:])
        dev = self.device
        bs = self.scheduler.block_size
        layout = KVLayout.for_prefill([a.request.kv_block * bs for a in group], lengths, dev, cached=skip)
        t = torch.arange(T)
        # a row's inputs are positions skip .. length - 1; its padding repeats its last position
        positions = torch.minimum(torch.tensor(skip)[:, None] + t, torch.tensor(lengths)[:, None] - 1)
        batch = StepBatch(slots=torch.tensor([a.slots[0] for a in group], device=dev), positions=positions.to(dev),
                          last_index=torch.tensor([n - c - 1 for n, c in zip(lengths, skip)], device=dev),
                          prefill=True, kv_len=max(lengths), layout=layout,
                          prev_tokens=torch.tensor([a.request.prompt_tokens[c - 1] if c else -1
                                                    for a, c in zip(group, skip)], device=dev) if any(skip) else None)
        logits = self.model.forward_step(tokens.to(dev), batch, self.kv)  # (P, V)
        self.num_prefill_tokens += sum(lengths) - sum(skip)
        self.num_cached_prompt_tokens += sum(skip)
        return self.model.owned_logits(logits)  # kept across the step's other prefill chunks

    def _prefill_all(self, admissions: list[Admission]) -> dict[int, torch.Tensor]:
        """Prefill the new prompts among the step's admissions; their last logits by id of
        request. With prefix caching, prompts first copy their cached prefix from a stored
        prompt's run (engine/prefix_cache.py), in two waves when the donor is prefilled in
        this step too."""
        prefills = [a for a in admissions if a.prefill]
        waves, cached = [prefills], {}
        if self.prefix_caching and prefills:
            new = {id(a.request) for a in prefills}
            # stored prompts: those of running samples, of waiting samples, of samples admitted now
            reqs = ([s.request for s in self.running.values()] + list(self.scheduler.waiting)
                    + [a.request for a in admissions])
            stored = list({id(r): r for r in reqs if r.kv_block is not None and id(r) not in new}.values())
            waves, cached = plan_prefills(prefills, stored, self.scheduler.block_size)
        bs = self.scheduler.block_size
        copied = {k: n for k, (_, n) in cached.items()}
        first: dict[int, torch.Tensor] = {}
        for wave in waves:
            for a in wave:
                if id(a.request) in cached:
                    donor, n = cached[id(a.request)]
                    self.kv.copy_run(donor.kv_block * bs, a.request.kv_block * bs, n)
            for chunk in prefill_batches(wave, copied):
                logits = self._prefill(chunk, copied)
                for i, a in enumerate(chunk):
                    first[id(a.request)] = logits[i]
        return first

    def _admit(self, admissions: list[Admission]) -> None:
        """Prefill new prompts, start every admitted sample and draw its first token."""
        first = self._prefill_all(admissions)
        bs = self.scheduler.block_size
        dev = self.device
        seqs: list[Sequence] = []
        rows: list[torch.Tensor] = []
        copies: list[tuple[int, int, int]] = []  # (from, to, length): prompt copies without sharing
        for a in admissions:
            req = a.request
            P = len(req.prompt_tokens)
            lg = first[id(req)] if a.prefill else req.first_logits
            prompt_start = req.kv_block * bs
            size = self.scheduler.own_blocks(req)
            for j, (slot, block) in enumerate(zip(a.slots, a.own_blocks)):
                idx = a.first_sample + j if req.resume is None else req.resume.sample_index
                seq = Sequence(req, idx, slot, request_key(req.params.seed, req.prompt_id, idx), own_block=block,
                               own_blocks=size, own_start=block * bs, own_pos0=P if self.prefix_sharing else 0,
                               prefix_start=prompt_start if self.prefix_sharing else -1,
                               scanner=None if self.tool_turns is None else HermesScanner(),
                               parallel_calls=self.tool_turns is not None and self.tool_turns.box.parallel_calls)
                if not self.prefix_sharing:
                    copies.append((prompt_start, block * bs, P))
                seq.weight_version = self.weight_version
                if req.resume is not None:  # a continuation: its tokens so far, whose KV is the prompt's
                    seq.replay(req.resume, self.tools, self.tokenizer, self.max_seq_len,
                               None if self.tool_turns is None else self.tool_turns.responses)
                    if seq.new_call is not None:  # cut while its tool ran: run it again
                        self.tool_turns.start(seq)
                        seq.first_pending = seq.pending is not None
                    elif seq.resume_turn:  # parallel_calls: cut while its turn's calls ran
                        self.tool_turns.resume(seq)
                        seq.first_pending = seq.pending is not None
                self.running[slot] = seq
                seqs.append(seq)
                rows.append(lg)
            pending = req.next_sample < req.params.num_samples
            if self.kv.state:
                slots = torch.tensor(a.slots, device=dev)
                if a.prefill:  # the prefill left the state in the first sample's slot
                    self.kv.copy_state(slots[:1].expand(len(a.slots)), slots)
                    req.prompt_state = self.kv.read_state(a.slots[0]) if pending else None
                else:
                    self.kv.write_state(slots, req.prompt_state)
            if pending and a.prefill:
                req.first_logits = lg.clone()
        if copies:
            src = torch.tensor([s + i for s, _, n in copies for i in range(n)], device=dev)
            dst = torch.tensor([d + i for _, d, n in copies for i in range(n)], device=dev)
            self.kv.copy_positions(src, dst)
        for a in admissions:
            req = a.request
            if req.next_sample == req.params.num_samples:  # no sample left to admit
                if self.prefix_sharing:
                    req.first_logits = req.prompt_state = None
                else:  # every sample has its copy: the stored prompt is done
                    self.scheduler.release_prompt(req)
        self._batch = None
        self._sample_first(seqs, torch.stack(rows))

    def _sample_first(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Each new sample's first token from its prompt's last logits (N, V)."""
        ps = [s.request.params for s in seqs]
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32)
        kinds = row_kinds(temp, top_k, top_p, min_p)  # on the host tensors: no device sync
        keys = torch.tensor([s.key for s in seqs], dtype=torch.long)
        pos = torch.tensor([s.position + 1 for s in seqs], dtype=torch.long)
        dev = self.device
        top = [p.top_logprobs for p in ps]
        toks, lps, *tops = sample_step(logits, temp.to(dev), top_k.to(dev), top_p.to(dev), min_p.to(dev),
                                       keys.to(dev), pos.to(dev), kinds, [p.logprobs_mode == "processed" for p in ps],
                                       batched=self.batched_sampling, **({"top": top} if any(top) else {}))
        host = torch.stack([toks.double(), lps.double()]).tolist()
        for i, (seq, t, lp) in enumerate(zip(seqs, host[0], host[1])):
            if seq.first_pending:  # its first token is the tool's result: see _force_first
                continue
            if seq.next_is_forced():  # a continuation stopped inside (or just before) forced tool output
                t, lp = seq.forced.popleft(), None
            seq.append(int(t), lp, self.tools, self.tokenizer, self.max_seq_len)
            if tops and lp is not None and tops[0][i] is not None:  # top_logprobs: the sampled position's
                seq.top[len(seq.tokens) - 1] = tops[0][i]
            if seq.tools_due():
                self.tool_turns.start(seq)
        self.num_generated_tokens += len(seqs)

    def _force_first(self) -> None:
        """Continuations admitted while their tool ran again (`first_pending`) take the
        result's first token now, as _sample_first would have: the last replayed token's KV
        is the prompt's, so the decode must start from a token it has not seen."""
        for seq in self.running.values():
            if seq.first_pending and seq.pending is None:
                seq.first_pending = False
                seq.append(seq.forced.popleft(), None, self.tools, self.tokenizer, self.max_seq_len)

    def _decode(self) -> None:
        if self._batch is None:
            active = [s for s in self.running.values() if s.finish_reason is None and s.pending is None]
            active.sort(key=lambda s: s.own_start)
            self._batch = DecodeBatch(active, self.device)
        db = self._batch
        logits = self.model.forward_step(db.tokens[:, None], db.step_batch(), self.kv)
        toks, lps, *tops = sample_step(logits, db.temperature, db.top_k, db.top_p, db.min_p, db.keys,
                                       db.positions + 1, db.kinds, db.processed, batched=self.batched_sampling,
                                       **({"top": db.top} if any(db.top) else {}))
        host = torch.stack([toks.double(), lps.double()]).tolist()  # the step's one device-to-host copy
        forced: list[tuple[int, int]] = []
        changed = False
        for i, seq in enumerate(db.seqs):
            if seq.next_is_forced():  # its row was sampled too (it costs less than a gather); dropped
                tok, lp = seq.forced.popleft(), None
                forced.append((i, tok))
            else:
                tok, lp = int(host[0][i]), host[1][i]
            seq.append(tok, lp, self.tools, self.tokenizer, self.max_seq_len)
            if tops and lp is not None and tops[0][i] is not None:  # top_logprobs: the sampled position's
                seq.top[len(seq.tokens) - 1] = tops[0][i]
            if seq.tools_due():  # a call closed (or, parallel_calls, a turn ended)
                self.tool_turns.start(seq)  # runs the tool (the sample waits) or queues its answer
            changed |= seq.finish_reason is not None or seq.pending is not None
        self.num_generated_tokens += len(db.seqs)
        self._kv_row_bytes[0] += self.kv_used_bytes
        self._kv_row_bytes[1] += len(db.seqs)
        if changed:
            self._batch = None
        else:
            db.advance(toks, forced)

    def _finish(self, seq: Sequence) -> RequestOutput | None:
        self.scheduler.release_sample(seq.slot, seq.own_block, seq.own_blocks)
        self._batch = None
        req = seq.request
        sample = seq.to_sample(self.tokenizer)
        prior = req.resume.weight_versions if req.resume is not None else []
        sample.weight_versions = list(prior) + [seq.weight_version] * (len(sample.tokens) - len(prior))
        if req.params.top_logprobs > 0:
            _top_lists(sample, req.resume, seq.top)
        req.samples[0 if req.parent is not None else seq.sample_index] = sample
        req.num_finished += 1
        if req.num_finished < req.params.num_samples:
            return None
        return preemption.complete(self, req)

    # ------------------------------------------------------------------ weights
    def load_weights(self, path: str | Path, *, step: int | None = None) -> dict:
        """Replace the model's weights with checkpoint `path`'s, in place (an RL loop's reload).

        The checkpoint must hold the same architecture and shapes (engine/loading/weight_swap.py
        says what is compared); its tokenizer files are not read, so a trainer's directory with
        only config.json and weights will do, and the engine keeps its tokenizer. Nothing is
        reallocated: the parameters keep their storage, the KV cache is the same tensors.
        Afterwards the engine generates what `load_engine(path)` would (on CPU in float32:
        bit for bit), given the same tokenizer. Host memory above the model: one tensor at a
        time for Hugging Face and nanochat directories (read file by file); one more copy of
        the weights for a GGUF file. step: for a nanochat directory (default: its highest).
        Returns {"path", "step", "description", "weight_version"}. Raises RuntimeError while
        requests are unfinished, FileNotFoundError / CheckpointError from the loaders, and
        engine.loading.weight_swap.WeightsMismatch naming what differs; on any of these the
        engine keeps its weights.
        """
        self._check_idle("load_weights")
        return self.apply_weights(self.stage_weights(path, step=step))

    def stage_weights(self, path: str | Path, *, step: int | None = None):
        """The first half of `load_weights`: check checkpoint `path`, change nothing.
        Only reads the engine, so it may run on another thread while the engine steps.
        Returns an engine.loading.weight_swap.StagedWeights for `apply_weights`; raises as
        load_weights."""
        from engine.loading.weight_swap import stage_weights

        return stage_weights(self.model, path, dtype=self.dtype, step=step)

    def apply_weights(self, staged, *, version: int | None = None) -> dict:
        """The second half of `load_weights`: copy staged weights into the model in place.
        version: the weight_version to take (default: one more). Returns {"path", "step",
        "description", "weight_version"}. Raises RuntimeError while requests are unfinished
        (their cached keys and values came from the old weights)."""
        from engine.loading.weight_swap import apply_weights

        self._check_idle("apply_weights")
        # before the copy: a half-done swap is not the old weights either
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        apply_weights(self.model, staged)
        return self.weights_swapped(staged.path, staged.step, staged.description, self.weight_version)

    def update_weights(self, named_tensors: Any) -> dict:
        """Replace the model's weights with a trainer's tensors from memory, in place: a
        mapping or an iterable of (name, tensor), named as the trainer's model names them
        (transformers' names for the Llama family and GPT-2, nanochat's own for nanochat),
        any floating dtype and device, cast and fused as the loaders do
        (engine/loading/weight_map.py), so the engine then generates what it would on a
        checkpoint of those tensors. All are checked before any is copied: every tensor of
        the model named once, in its shape. Returns as load_weights (path "<memory>").
        Raises RuntimeError while requests are unfinished, WeightsMismatch naming every
        difference, TypeError naming an entry that is not a (name, tensor) pair or a tensor
        without data (meta device, sparse); on any of these the engine keeps its weights."""
        from engine.loading.weight_swap import MEMORY, check_tensors, copy_tensors, tensor_pairs

        self._check_idle("update_weights")
        pairs = tensor_pairs(named_tensors)
        check_tensors(self.model, [(n, str(t.dtype).replace("torch.", ""), tuple(t.shape)) for n, t in pairs])
        self.weight_version += 1  # before the copy, as apply_weights
        copy_tensors(self.model, pairs)
        self.model.weights_changed()
        return self.weights_swapped(MEMORY, None, self.model.info.description, self.weight_version)

    def weights_swapped(self, path: str, step: int | None, description: str, version: int | None = None) -> dict:
        """Record a finished swap: weight_version becomes `version` (default: one more).
        Returns {"path", "step", "description", "weight_version"}."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return {"path": path, "step": step, "description": description, "weight_version": self.weight_version}

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what}: the engine has unfinished requests; finish them first (their KV cache "
                               f"entries come from the current weights)")

    # ------------------------------------------------------------------ aborting and continuing
    def abort(self, request_ids: Iterable[Any]) -> list[RequestOutput]:
        """End requests now (vLLM's abort_request), between steps; returns their outputs:
        finished samples as they are, running ones with their tokens so far and finish_reason
        "abort", unadmitted ones with none. The other samples go on unchanged (bit-identical
        on CPU). engine/preemption.py `abort` says it all."""
        return preemption.abort(self, request_ids)

    def continue_request(self, output: RequestOutput, params: SamplingParams, request_id: Any = None) -> None:
        """Queue again a request that `abort` ended, its aborted samples going on from their
        tokens (KV recomputed with the current weights, noise keyed as before); one output
        comes from `step` when all are done. engine/preemption.py `continue_request`."""
        preemption.continue_request(self, output, params, request_id)

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 prompt_ids: Seq[str | int] | None = None) -> list[list[Sample]]:
        """Generate for every prompt; returns results[i][j], sample j of prompt i.

        prompts: list of token-id lists. params: one SamplingParams for all, or one per prompt.
        prompt_ids: key each prompt's sampling noise (default: the prompt's index, "0", "1", ...);
            give stable ids to get the same samples whatever the batch.
        Raises ValueError if the lists' lengths differ, TypeError for params that are not
        SamplingParams (before any request is queued); bad prompts come back as samples with
        finish_reason "error", the others go on. Whatever raises meanwhile (a step's failure,
        see `step`; KeyboardInterrupt; a prompt that is not a sequence) propagates, and this
        call's requests end with it (none is left queued, running or holding KV memory), so
        the engine's next call gives what it gives on a fresh engine; streaming requests that
        finished meanwhile stay for their owner.
        """
        n = len(prompts)
        if isinstance(params, SamplingParams):
            plist = [params] * n
        else:
            plist = None if params is None or isinstance(params, (dict, str)) else list(params)
            if plist is None or not all(isinstance(p, SamplingParams) for p in plist):
                raise TypeError(f"generate: params must be a SamplingParams or a list of them, got {params!r}")
        ids = [str(i) for i in range(n)] if prompt_ids is None else [str(x) for x in prompt_ids]
        if len(plist) != n or len(ids) != n:
            raise ValueError(f"generate: {n} prompts but {len(plist)} params and {len(ids)} prompt_ids")
        tag = object()

        def mine(out: RequestOutput) -> bool:
            rid = out.request_id
            return isinstance(rid, tuple) and len(rid) == 2 and rid[0] is tag

        results: list[list[Sample] | None] = [None] * n
        others: list[RequestOutput] = []
        try:
            for i in range(n):
                self.add_request(prompts[i], plist[i], ids[i], request_id=(tag, i))
            remaining = n
            while remaining:
                for out in self.step():
                    if mine(out):
                        results[out.request_id[1]] = out.samples
                        remaining -= 1
                    else:
                        others.append(out)
        except BaseException:
            self.abort([(tag, i) for i in range(n)])  # raised between steps (a failed step ended them all)
            self._ready = [out for out in self._ready if not mine(out)]
            raise
        finally:
            self._ready.extend(others)  # streaming requests that finished meanwhile stay for their owner
        return results  # type: ignore[return-value]


def _top_lists(sample: Sample, prior: Sample | None, top: dict[int, tuple[list[int], list[float]]]) -> None:
    """Fill sample.top_logprob_ids / top_logprobs (SamplingParams.top_logprobs > 0): one list
    per token, the replayed tokens' from the aborted sample `prior` (a continuation), the
    others from the sequence's record `top` (index in tokens -> (ids, logprobs)); None where
    forced."""
    n0 = 0 if prior is None else len(prior.tokens)
    ids: list = [None] * len(sample.tokens)
    vals: list = [None] * len(sample.tokens)
    if prior is not None and prior.top_logprob_ids is not None:
        ids[:n0] = prior.top_logprob_ids[:n0]
        vals[:n0] = prior.top_logprobs[:n0]
    for i, (a, b) in top.items():
        if n0 <= i < len(ids):
            ids[i], vals[i] = a, b
    sample.top_logprob_ids, sample.top_logprobs = ids, vals


def load_engine(path: str | Path = "smollm2", device: str = "auto", dtype: str = "auto", *, tokenizer=None,
                step: int | None = None, max_num_seqs: int = 256, kv_cache_bytes: int | None = None,
                max_seq_len: int | None = None, max_prefill_tokens: int = 8192,
                num_threads: int | None = None, batch_invariant: bool = True, prefix_sharing: bool = True,
                kv_share: float = 1.0, tools: ToolBox | list | None = None, prefix_caching: bool = True) -> Engine:
    """Load a checkpoint (engine/loading/checkpoint.py: "smollm2", "tiny-random", HF Llama family
    or GPT-2, GGUF, nanochat) into an Engine.

    device: "auto" | "cpu" | "cuda[:n]"; dtype: "auto" | "float32" | "bfloat16".
    num_threads: CPU threads for torch in this process (a worker's share of the cores);
        None leaves torch's default.
    kv_share: this engine's share of its device's free memory for the default KV budget
        (engine/kv_cache.py `default_kv_bytes`; a Ray worker passes its share of the node).
    tools: the Hermes-format tools (see Engine); prefix_caching: see Engine.
    Raises FileNotFoundError / CheckpointError for bad checkpoints (see
    engine/loading/checkpoint.py).
    """
    from engine.loading.checkpoint import load_checkpoint

    if num_threads:
        torch.set_num_threads(max(1, int(num_threads)))
    model, tok = load_checkpoint(path, device=device, dtype=dtype, tokenizer=tokenizer, step=step)
    return Engine(model, tok, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes, max_seq_len=max_seq_len,
                  max_prefill_tokens=max_prefill_tokens, batch_invariant=batch_invariant,
                  prefix_sharing=prefix_sharing, kv_share=kv_share, tools=tools, prefix_caching=prefix_caching)
