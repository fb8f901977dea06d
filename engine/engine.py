"""The step loop: admit, prefill once, fan out, decode everyone, finish and free.

Each `step()`:
1. the scheduler admits waiting prompts into free slots; they are prefilled together in
   one right-padded batch, each prompt once, its KV copied to the slots of its other
   samples (nanochat's "prefill once, sample many"), and every sample draws its first token;
2. every running sample decodes one token in one batch (continuous batching: rows that
   finish free their slot at once, and the next step admits waiting prompts into it);
3. finished requests are returned.

`generate()` runs steps until its prompts are done; workers use the streaming form
(`add_request` / `step`) to keep one engine full across many work units.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence as Seq

import torch

from engine.kv_cache import KVCache, StepBatch
from engine.models.base import CausalLM
from engine.params import RequestOutput, Sample, SamplingParams, error_output
from engine.sampling import request_key, sample_with_logprobs, token_logprobs
from engine.scheduler import PrefillGroup, Scheduler
from engine.sequence import Request, Sequence, ToolTokens


def _default_kv_bytes(device: torch.device) -> int:
    """KV budget when none is given: 90% of free GPU memory, or a quarter of host RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


class Engine:
    """A model, its tokenizer and a preallocated KV cache, serving requests on token ids.

    Args:
        model: a CausalLM (engine/models). tokenizer: engine.tokenizer.Tokenizer.
        max_num_seqs: most samples decoding at once (KV slots), before the budget bound.
        kv_cache_bytes: KV cache budget in bytes (default: 90% of free GPU memory, or a
            quarter of host RAM on CPU, where pages are only committed when written).
        max_seq_len: positions per slot, prompt + generated, in tokens (default and maximum:
            the model's context window). Smaller values fit more slots in the budget.
        max_prefill_tokens: bound on one prefill batch (prompts x longest prompt, tokens).
        batch_invariant: on CPU (float32), make every sample's logits, and so its tokens and
            logprobs, bit-identical whatever batch it runs in (attention row by row; the
            projections are oneDNN's batch-invariant kernels either way). False trades that
            for 9-10% more throughput (bench/bench_engine.py, GPT-2 small); tokens then match except at rare near-ties
            (logits move by about 1e-7). GPUs are not batch-invariant in either mode.
    Raises ValueError if the budget cannot hold a single slot.
    Not thread-safe: one thread drives an engine (cluster/worker.py serialises access).
    """

    def __init__(self, model: CausalLM, tokenizer, *, max_num_seqs: int = 256, kv_cache_bytes: int | None = None,
                 max_seq_len: int | None = None, max_prefill_tokens: int = 8192, batch_invariant: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        info = model.info
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_seq_len = min(max_seq_len or info.context_len, info.context_len)
        slot_bytes = KVCache.bytes_per_slot(info.n_layer, info.n_kv_head, info.head_dim, self.max_seq_len,
                                            self.dtype, info.state_dims)
        budget = kv_cache_bytes if kv_cache_bytes is not None else _default_kv_bytes(self.device)
        num_slots = min(max_num_seqs, budget // slot_bytes)
        if num_slots < 1:
            raise ValueError(f"KV cache budget of {budget} bytes cannot hold one slot of {self.max_seq_len} tokens "
                             f"({slot_bytes} bytes); raise kv_cache_bytes or lower max_seq_len")
        self.kv = KVCache(info.n_layer, info.n_kv_head, info.head_dim, num_slots, self.max_seq_len,
                          self.dtype, self.device, info.state_dims, batch_invariant=batch_invariant)
        self.scheduler = Scheduler(num_slots, max_prefill_tokens)
        self.running: dict[int, Sequence] = {}
        self._ready: list[RequestOutput] = []
        self.tools = self._tool_tokens(tokenizer)
        # the checkpoint's own end tokens (Llama family: eos_token_id) when it names any
        self.default_stop_ids = frozenset(info.stop_token_ids or tokenizer.default_stop_token_ids)
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0

    @staticmethod
    def _tool_tokens(tokenizer) -> ToolTokens | None:
        names = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
        ids = [tokenizer.special(n) for n in names]
        return None if any(i is None for i in ids) else ToolTokens(*ids)

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_tokens: Seq[int], params: SamplingParams, prompt_id: str | int,
                    request_id: object = None) -> None:
        """Queue one prompt. Never raises for a bad prompt: it finishes as an error output.

        prompt_tokens: token ids; prompt_id: keys the sampling noise with params.seed and the
        sample index (so the same prompt_id and seed give the same samples anywhere).
        request_id: returned with the output (default: prompt_id).
        """
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
        """Admit and prefill, decode one token for every running sample; return finished requests."""
        done, self._ready = self._ready, []
        for chunk in self._by_length(self.scheduler.schedule()):
            self._prefill(chunk)
        active = [s for s in self.running.values() if s.finish_reason is None]
        if active:
            self._decode(active)
        for slot in [s for s, seq in self.running.items() if seq.finish_reason is not None]:
            out = self._finish(self.running.pop(slot))
            if out is not None:
                done.append(out)
        return done

    @staticmethod
    def _by_length(groups: list[PrefillGroup], max_padding: float = 0.25) -> list[list[PrefillGroup]]:
        """Split one step's admissions into prefill batches of similar prompt lengths, so
        right-padding wastes at most about `max_padding` of the batch's tokens."""
        chunks: list[list[PrefillGroup]] = []
        cur: list[PrefillGroup] = []
        real = 0
        for g in sorted(groups, key=lambda g: len(g.request.prompt_tokens)):
            n = len(g.request.prompt_tokens)
            if cur and n * (len(cur) + 1) > (1 + max_padding) * (real + n):
                chunks.append(cur)
                cur, real = [], 0
            cur.append(g)
            real += n
        if cur:
            chunks.append(cur)
        return chunks

    def _prefill(self, groups: list[PrefillGroup]) -> None:
        lengths = [len(g.request.prompt_tokens) for g in groups]
        T = max(lengths)
        tokens = torch.zeros(len(groups), T, dtype=torch.long)
        for i, g in enumerate(groups):
            tokens[i, : lengths[i]] = torch.tensor(g.request.prompt_tokens)
        dev = self.device
        batch = StepBatch(
            slots=torch.tensor([g.slots[0] for g in groups], device=dev),
            positions=torch.arange(T, device=dev).expand(len(groups), T),
            last_index=torch.tensor(lengths, device=dev) - 1,
            prefill=True,
        )
        self.kv.initialize([s for g in groups for s in g.slots], T)
        logits = self.model.forward_step(tokens.to(dev), batch, self.kv)  # (P, V)
        self.num_prefill_tokens += sum(lengths)
        src = [g.slots[0] for g in groups for _ in g.slots[1:]]
        dst = [s for g in groups for s in g.slots[1:]]
        if dst:
            self.kv.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev), T)
        seqs, rows = [], []
        for i, g in enumerate(groups):
            for j, slot in enumerate(g.slots):
                idx = g.first_sample + j
                seq = Sequence(g.request, idx, slot, request_key(g.request.params.seed, g.request.prompt_id, idx))
                self.running[slot] = seq
                seqs.append(seq)
                rows.append(i)
        self._sample_and_append(seqs, logits[torch.tensor(rows, device=dev)])

    def _decode(self, seqs: list[Sequence]) -> None:
        seqs.sort(key=lambda s: s.slot)
        lo, hi = seqs[0].slot, seqs[-1].slot
        span = hi - lo + 1
        dev = self.device
        if span <= 2 * len(seqs):
            # Decode the whole slot range [lo, hi]: idle slots in it compute a dummy row, and
            # attention reads the cache as a view instead of gathering it.
            rows = [s.slot - lo for s in seqs]
            tokens = torch.zeros(span, dtype=torch.long)
            positions = torch.zeros(span, dtype=torch.long)
            slots = torch.arange(lo, hi + 1)
            slot_start = lo
        else:
            rows = list(range(len(seqs)))
            tokens = torch.zeros(len(seqs), dtype=torch.long)
            positions = torch.zeros(len(seqs), dtype=torch.long)
            slots = torch.tensor([s.slot for s in seqs])
            slot_start = None
        kv_len = max(s.position for s in seqs) + 1
        self.kv.initialize(slots.tolist(), kv_len)
        r = torch.tensor(rows)
        tokens[r] = torch.tensor([s.last_token for s in seqs])
        positions[r] = torch.tensor([s.position for s in seqs])
        live = None
        if len(rows) != len(tokens):
            live = [False] * len(tokens)
            for i in rows:
                live[i] = True
        batch = StepBatch(slots=slots.to(dev), positions=positions[:, None].to(dev),
                          last_index=torch.zeros(len(tokens), dtype=torch.long, device=dev), prefill=False,
                          kv_len=kv_len, slot_start=slot_start, live=live)
        logits = self.model.forward_step(tokens[:, None].to(dev), batch, self.kv)
        if len(rows) != len(tokens):  # drop the idle slots' dummy rows
            logits = logits[r.to(dev)]
        self._sample_and_append(seqs, logits)

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Pick each sequence's next token (forced tool output, or sampled from `logits`)."""
        free_rows = [i for i, s in enumerate(seqs) if not s.next_is_forced()]
        sampled: dict[int, tuple[int, float]] = {}
        if free_rows:
            sub = [seqs[i] for i in free_rows]
            lg = logits if len(free_rows) == len(seqs) else logits[torch.tensor(free_rows, device=self.device)]
            ps = [s.request.params for s in sub]
            dev = self.device
            temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
            top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
            top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
            min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
            keys = torch.tensor([s.key for s in sub], dtype=torch.long, device=dev)
            pos = torch.tensor([s.position + 1 for s in sub], dtype=torch.long, device=dev)
            processed = [p.logprobs_mode == "processed" for p in ps]
            toks, proc = sample_with_logprobs(lg, temp, top_k, top_p, min_p, keys, pos, processed=any(processed))
            # raw logprobs last: token_logprobs overwrites the logits
            raw = None if all(processed) else token_logprobs(lg, toks, inplace=True).tolist()
            proc_l = None if proc is None else proc.tolist()
            lps = [proc_l[j] if pr else raw[j] for j, pr in enumerate(processed)]  # type: ignore[index]
            for i, t, lp in zip(free_rows, toks.tolist(), lps):
                sampled[i] = (t, lp)
        for i, seq in enumerate(seqs):
            if i in sampled:
                tok, lp = sampled[i]
            else:
                tok, lp = seq.forced.popleft(), None
            seq.append(tok, lp, self.tools, self.tokenizer, self.max_seq_len)
            self.num_generated_tokens += 1

    def _finish(self, seq: Sequence) -> RequestOutput | None:
        self.scheduler.release(seq.slot)
        req = seq.request
        req.samples[seq.sample_index] = seq.to_sample(self.tokenizer)
        req.num_finished += 1
        if req.num_finished < req.params.num_samples:
            return None
        return RequestOutput(request_id=req.request_id, prompt_id=req.prompt_id, prompt_tokens=req.prompt_tokens,
                             samples=list(req.samples))

    # ------------------------------------------------------------------ weights
    def load_weights(self, path: str | Path, *, step: int | None = None) -> dict:
        """Replace the model's weights with checkpoint `path`'s, in place (an RL loop's reload).

        The checkpoint must hold the same architecture and shapes (engine/weights.py says
        what is compared); its tokenizer files are not read, so a trainer's directory with
        only config.json and weights will do, and the engine keeps its tokenizer. Nothing is
        reallocated: the parameters keep their storage, the KV cache is the same tensors.
        Afterwards the engine generates what `load_engine(path)` would (on CPU in float32:
        bit for bit), given the same tokenizer. Peak memory: one more copy of the weights,
        in host RAM. step: for a nanochat directory (default: its highest step).
        Returns {"path", "step", "description"}. Raises RuntimeError while requests are
        unfinished, FileNotFoundError / CheckpointError from the loaders, and
        engine.weights.WeightsMismatch naming what differs; on any of these the engine keeps
        its weights.
        """
        self._check_idle("load_weights")
        return self.apply_weights(self.stage_weights(path, step=step))

    def stage_weights(self, path: str | Path, *, step: int | None = None):
        """The first half of `load_weights`: load and check checkpoint `path`, change nothing.
        Only reads the engine, so it may run on another thread while the engine steps.
        Returns an engine.weights.StagedWeights for `apply_weights`; raises as load_weights."""
        from engine.weights import stage_weights

        return stage_weights(self.model, path, dtype=self.dtype, step=step)

    def apply_weights(self, staged) -> dict:
        """The second half of `load_weights`: copy staged weights into the model in place.
        Returns {"path", "step", "description"}. Raises RuntimeError while requests are
        unfinished (their cached keys and values came from the old weights)."""
        from engine.weights import apply_weights

        self._check_idle("apply_weights")
        apply_weights(self.model, staged)
        return {"path": staged.path, "step": staged.step, "description": staged.description}

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what}: the engine has unfinished requests; finish them first (their KV cache "
                               f"entries come from the current weights)")

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 prompt_ids: Seq[str | int] | None = None) -> list[list[Sample]]:
        """Generate for every prompt; returns results[i][j], sample j of prompt i.

        prompts: list of token-id lists. params: one SamplingParams for all, or one per prompt.
        prompt_ids: key each prompt's sampling noise (default: the prompt's index, "0", "1", ...);
            give stable ids to get the same samples whatever the batch.
        Raises ValueError if the lists' lengths differ; bad prompts come back as samples with
        finish_reason "error", the others go on.
        """
        n = len(prompts)
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        ids = [str(i) for i in range(n)] if prompt_ids is None else [str(x) for x in prompt_ids]
        if len(plist) != n or len(ids) != n:
            raise ValueError(f"generate: {n} prompts but {len(plist)} params and {len(ids)} prompt_ids")
        tag = object()
        for i in range(n):
            self.add_request(prompts[i], plist[i], ids[i], request_id=(tag, i))
        results: list[list[Sample] | None] = [None] * n
        others: list[RequestOutput] = []
        remaining = n
        while remaining:
            for out in self.step():
                rid = out.request_id
                if isinstance(rid, tuple) and len(rid) == 2 and rid[0] is tag:
                    results[rid[1]] = out.samples
                    remaining -= 1
                else:
                    others.append(out)
        self._ready.extend(others)  # streaming requests that finished meanwhile stay for their owner
        return results  # type: ignore[return-value]


def load_engine(path: str | Path = "smollm2", device: str = "auto", dtype: str = "auto", *, tokenizer=None,
                step: int | None = None, max_num_seqs: int = 256, kv_cache_bytes: int | None = None,
                max_seq_len: int | None = None, max_prefill_tokens: int = 8192,
                num_threads: int | None = None, batch_invariant: bool = True) -> Engine:
    """Load a checkpoint (engine/checkpoint.py: "smollm2", "tiny-random", HF Llama family or GPT-2,
    GGUF, nanochat) into an Engine.

    device: "auto" | "cpu" | "cuda[:n]"; dtype: "auto" | "float32" | "bfloat16".
    num_threads: CPU threads for torch in this process (a worker's share of the cores);
        None leaves torch's default.
    Raises FileNotFoundError / CheckpointError for bad checkpoints (see engine/checkpoint.py).
    """
    from engine.checkpoint import load_checkpoint

    if num_threads:
        torch.set_num_threads(max(1, int(num_threads)))
    model, tok = load_checkpoint(path, device=device, dtype=dtype, tokenizer=tokenizer, step=step)
    return Engine(model, tok, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes, max_seq_len=max_seq_len,
                  max_prefill_tokens=max_prefill_tokens, batch_invariant=batch_invariant)
