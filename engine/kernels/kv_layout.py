"""Where each row of a step keeps its keys and values, and how its attention is grouped.

The KV cache is one arena of positions per layer (engine/kv_cache.py). A decoding row's
sequence lives in at most two runs of it:
- a shared prefix: its prompt's run, positions [0, P), written once by the prompt's
  prefill and read by all of the prompt's samples (prefix sharing on);
- its own run: positions own_pos0, own_pos0 + 1, ... at arena positions own_start, own_start
  + 1, ... (own_pos0 = P with prefix sharing, 0 without: then the run holds the sample's own
  copy of the prompt too).

`KVLayout` holds those numbers for every row (host ints, built by the engine when the set of
running rows changes, advanced by one position per decode step) and derives what attention
needs. Attention is split at the end of the prompt (`prompt_len`, a property of the row):
- generated groups: rows with as many generated positions so far whose generated keys sit
  at a regular stride (a cohort of samples admitted together, including the holes its
  finished samples left), so one attention call reads them all as one strided view;
- prompt calls: the rows of one stored prompt put their queries into one attention call
  against one read of the prompt's keys (cascade attention: Hydragen, arXiv 2402.05099;
  FlashInfer's cascade kernels); rows holding their own copy of the prompt are grouped like
  the generated part, over their copies;
- for the batched path (any device): gather indices and masks as device tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


# Most bytes of keys a run group may read for its holes (finished samples' slots) before a
# second attention call is cheaper: a call costs tens of microseconds, about what reading
# half a MiB takes on a CPU core.
HOLE_BYTES = 512 << 10


@dataclass(slots=True)
class RunGroup:
    """Rows of the step whose keys of one part (generated, or a copy of the prompt) start at
    arena positions start + slot * stride (slot in [0, num_slots)) and cover the same
    positions relative to that start: [0, length0 + t) for a generated part (length0 when the
    layout was built, one more per step since), [0, length0) for a prompt copy; position0 is
    the rows' common position when the layout was built (prompt copies).

    rows: the step's rows in slot order; slots: their slots (increasing). A slot that no row
    holds (a hole: a sample of the cohort finished, its run freed) is read with a stand-in
    query and its result dropped: one attention call serves the cohort instead of one per
    unbroken run of it. At most half of the slots are holes, their keys under HOLE_BYTES.
    gather: (num_slots,) int64 row whose query each slot takes (a hole takes the first row's);
        None when the slots are rows rows[0], rows[0] + 1, ... in order (a plain slice).
    scatter: with gather, (rows, slots) as int64 tensors, to put the slots' results back
        (made once here: attention runs once per layer and step).
    """

    rows: list[int]
    slots: list[int]
    num_slots: int
    start: int
    stride: int
    length0: int
    position0: int
    gather: torch.Tensor | None = None
    scatter: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class PrefixCalls:
    """One layer window's prefix attention, as calls over a gathered query block.

    calls: (start, lo, hi, offset, rows) per call: the rows attend to arena positions
        [start + lo, start + hi) (prompt positions [lo, hi)); their queries are slots
        [offset, offset + rows) of the gathered block (rows a multiple of 4, see
        engine/kernels/attention.py).
    gather: (sum of rows,) int64, per slot of the block the flattened query row it takes,
        row * g + j (query head j of the group), or B * g for a zero dummy.
    scatter: (B * g,) int64, per flattened query row its slot in the block, or the sum of
        rows for "no prefix" (a sentinel slot with output 0 and log-sum-exp -inf).
    """

    calls: list[tuple[int, int, int, int, int]]
    gather: torch.Tensor
    scatter: torch.Tensor


@dataclass
class KVLayout:
    """Per-row KV placement for one prefill or a run of decode steps (see the module docstring).

    Decode (`for_decode`): own_start, own_pos0, prefix_start (-1: none), position0 (each row's
    position at the first step) and prompt_len (where attention is split: the prompt's
    length; 0 for no split) are lists of host ints, one per row. `advance()` moves every
    row one position on (the next decode step) and drops per-step caches.
    Prefill (`for_prefill`): own_start is where each row's prompt goes (position 0), lengths
    its tokens, position0 the first position this prefill computes (the length of a prefix
    already stored in the run, `Engine` prefix caching; 0 for the whole prompt): a row's
    inputs are positions position0 .. lengths - 1, right-padded to T.
    """

    own_start: list[int]
    own_pos0: list[int]
    prefix_start: list[int]
    position0: list[int]
    prompt_len: list[int]
    device: torch.device
    prefill: bool = False
    lengths: list[int] = field(default_factory=list)
    t: int = 0
    _step: dict = field(default_factory=dict)  # per-step caches (cleared by advance)
    _static: dict = field(default_factory=dict)  # caches valid for the layout's lifetime

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_decode(cls, own_start: list[int], own_pos0: list[int], prefix_start: list[int], position0: list[int],
                   device: torch.device | str, prompt_len: list[int] | None = None) -> KVLayout:
        n = len(own_start)
        prompt_len = list(own_pos0) if prompt_len is None else list(prompt_len)
        if not (len(own_pos0) == len(prefix_start) == len(position0) == len(prompt_len) == n):
            raise ValueError("KVLayout.for_decode: per-row lists of different lengths")
        for s, p0, ps, pos, P in zip(own_start, own_pos0, prefix_start, position0, prompt_len):
            if not (p0 <= P <= pos and (ps < 0 or p0 == P)):
                raise ValueError(f"KVLayout.for_decode: inconsistent row (own_pos0 {p0}, prompt_len {P}, "
                                 f"position {pos}, prefix_start {ps})")
        return cls(list(own_start), list(own_pos0), list(prefix_start), list(position0), prompt_len,
                   torch.device(device))

    @classmethod
    def for_prefill(cls, own_start: list[int], lengths: list[int], device: torch.device | str,
                    cached: list[int] | None = None) -> KVLayout:
        n = len(own_start)
        cached = [0] * n if cached is None else list(cached)
        if len(lengths) != n or len(cached) != n or any(not 0 <= c < m for c, m in zip(cached, lengths)):
            raise ValueError("KVLayout.for_prefill: each row needs a length and a cached prefix shorter than it")
        return cls(list(own_start), [0] * n, [-1] * n, cached, [0] * n, torch.device(device), prefill=True,
                   lengths=list(lengths))

    @property
    def resumes(self) -> bool:
        """Prefill: some row starts past position 0 (a cached prefix is already stored)."""
        return any(self.position0)

    @classmethod
    def static_slots(cls, slots: list[int], positions: list[int], slot_len: int, device: torch.device | str,
                     prefill: bool = False, lengths: list[int] | None = None) -> KVLayout:
        """The static-slot layout: row r's sequence at arena positions slots[r] * slot_len + p,
        attended as one part."""
        starts = [s * slot_len for s in slots]
        if prefill:
            return cls.for_prefill(starts, lengths or [], device)
        n = len(slots)
        return cls.for_decode(starts, [0] * n, [-1] * n, positions, device, prompt_len=[0] * n)

    def advance(self) -> None:
        """Every row moves one position on (one more decode step)."""
        self.t += 1
        self._step.clear()

    # ------------------------------------------------------------------ host views
    @property
    def num_rows(self) -> int:
        return len(self.own_start)

    def positions(self) -> list[int]:
        return [p + self.t for p in self.position0]

    def has_prefix(self) -> bool:
        return any(s >= 0 for s in self.prefix_start)

    def _run_groups(self, rows: list[int], starts: list[int], keys: list[tuple], length: list[int],
                    key_bytes: int) -> list[RunGroup]:
        """`rows` in groups of equal keys whose starts lie on one regular stride (RunGroup),
        grown greedily in arena order while at most half of a group's slots are holes and the
        holes' keys (length x key_bytes each, read for nothing) stay under HOLE_BYTES: past
        that, a second call is cheaper than reading them."""
        by_key: dict[tuple, list[int]] = {}
        for r in sorted(rows, key=lambda r: starts[r]):
            by_key.setdefault(keys[r], []).append(r)
        groups: list[RunGroup] = []
        for members in by_key.values():
            cur, stride = [members[0]], 0
            for r in members[1:]:
                gap = starts[r] - starts[cur[0]]
                s = math.gcd(stride, gap)
                slots = gap // s + 1 if s > 0 else 0
                holes = slots - len(cur) - 1
                if s > 0 and slots <= 2 * (len(cur) + 1) and holes * length[r] * key_bytes <= HOLE_BYTES:
                    cur.append(r)
                    stride = s
                else:
                    groups.append(self._run_group(cur, stride or 1, starts, length))
                    cur, stride = [r], 0
            groups.append(self._run_group(cur, stride or 1, starts, length))
        return groups

    def _run_group(self, rows: list[int], stride: int, starts: list[int], length: list[int]) -> RunGroup:
        base = starts[rows[0]]
        slots = [(starts[r] - base) // stride for r in rows]
        n = slots[-1] + 1
        gather = scatter = None
        if slots != list(range(len(rows))) or rows != list(range(rows[0], rows[0] + len(rows))):
            by_slot = [rows[0]] * n
            for r, j in zip(rows, slots):
                by_slot[j] = r
            dev = self.device
            gather = torch.tensor(by_slot, dtype=torch.long, device=dev)
            scatter = (torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(slots, dtype=torch.long, device=dev))
        return RunGroup(rows, slots, n, base, stride, length[rows[0]], self.position0[rows[0]], gather, scatter)

    def generated_groups(self, key_bytes: int = 0) -> list[RunGroup]:
        """The generated part (positions prompt_len .. position) of every row, in run groups
        of rows with as many generated positions (cohorts admitted at one step). key_bytes:
        what one key position costs to read in a layer (K and V), which bounds the holes."""
        if "generated" not in self._static:
            start = [s + P - p0 for s, P, p0 in zip(self.own_start, self.prompt_len, self.own_pos0)]
            length = [pos - P for pos, P in zip(self.position0, self.prompt_len)]
            self._static["generated"] = self._run_groups(list(range(self.num_rows)), start,
                                                         [(n,) for n in length], length, key_bytes)
        return self._static["generated"]

    def generated_pick(self) -> torch.Tensor | None:
        """(B,) int64: where each row's result lies in the generated groups' results laid end to
        end (slot-major, in `generated_groups` order); None when that is the rows in order.
        Call after `generated_groups`."""
        if "generated_pick" not in self._static:
            groups = self.generated_groups()
            pick = [0] * self.num_rows
            offset = 0
            for grp in groups:
                for r, j in zip(grp.rows, grp.slots):
                    pick[r] = offset + j
                offset += grp.num_slots
            same = offset == self.num_rows and pick == list(range(self.num_rows))
            self._static["generated_pick"] = None if same else torch.tensor(pick, dtype=torch.long,
                                                                             device=self.device)
        return self._static["generated_pick"]

    def copy_groups(self, key_bytes: int = 0) -> list[RunGroup]:
        """The prompt part of rows that hold their own copy of it (positions 0 .. prompt_len - 1
        at the start of their own run), in run groups of rows with the same prompt length
        and position (key_bytes as for generated_groups)."""
        if "copies" not in self._static:
            rows = [r for r in range(self.num_rows) if self.prefix_start[r] < 0 and self.prompt_len[r] > 0]
            keys = [(P, pos) for P, pos in zip(self.prompt_len, self.position0)]
            self._static["copies"] = self._run_groups(rows, self.own_start, keys, self.prompt_len, key_bytes)
        return self._static["copies"]

    @staticmethod
    def key_range(position: int, first: int, end: int, window: int | None) -> tuple[int, int]:
        """Positions [lo, hi) of [first, end) that a query at `position` sees with a left
        `window` (keys position - window .. position; None: all)."""
        lo = first if window is None else max(first, position - window)
        return lo, min(end, position + 1)

    # ------------------------------------------------------------------ prefix groups
    def prefix_calls(self, window: int | None, g: int, multiple: int = 4) -> PrefixCalls | None:
        """The prefix attention of a decode step for layers with this window, with `g` query
        heads per KV head and each call's query rows padded to a multiple of `multiple`; None
        when no row sees any shared prefix keys."""
        key = (window, g, multiple)
        cache = self._static if window is None else self._step  # windowed ranges move each step
        if key in cache:
            return cache[key]
        groups: dict[tuple[int, int, int], list[int]] = {}
        t = self.t
        for r, ps in enumerate(self.prefix_start):
            if ps < 0:
                continue
            lo, hi = self.key_range(self.position0[r] + t, 0, self.own_pos0[r], window)
            if lo < hi:
                groups.setdefault((ps, lo, hi), []).append(r)
        if not groups:
            cache[key] = None
            return None
        B = self.num_rows
        sentinel_in = B * g
        gather: list[int] = []
        scatter = [-1] * (B * g)
        calls = []
        for (ps, lo, hi), rows in groups.items():
            offset = len(gather)
            for r in rows:
                for j in range(g):
                    scatter[r * g + j] = len(gather)
                    gather.append(r * g + j)
            n = -(-len(rows) * g // multiple) * multiple
            gather.extend([sentinel_in] * (n - len(rows) * g))
            calls.append((ps, lo, hi, offset, n))
        total = len(gather)
        scatter = [total if s < 0 else s for s in scatter]
        dev = self.device
        pc = PrefixCalls(calls, torch.tensor(gather, dtype=torch.long, device=dev),
                         torch.tensor(scatter, dtype=torch.long, device=dev))
        cache[key] = pc
        return pc

    # ------------------------------------------------------------------ compiled kernel
    def native_segments(self, window: int | None, num_positions: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's runs for the compiled decode kernel (engine/kernels/native.py), CPU int64:
        seg (B, 4) per row (prompt start, prompt length, own start, own length) in arena
        positions: the keys [lo, hi) of key_range split at prompt_len, the prompt part in the
        stored prompt's run (prefix sharing) or in the row's own copy; group_ptr (G + 1,) and
        order (B,): rows grouped by shared prompt run (a row without one is a group alone).
        Raises ValueError if a run leaves the arena's num_positions (the kernel does not check).
        """
        key = ("native", window, num_positions)
        if key in self._step:
            return self._step[key]
        if window is None and "native_base" in self._static:
            base, group_ptr, order = self._static["native_base"]
        else:  # without a window only the own lengths move with t: built once, advanced below
            t = self.t if window is not None else 0
            seg, groups = [], {}
            for r in range(self.num_rows):
                pos, p0, P, ps, own = (self.position0[r] + t, self.own_pos0[r], self.prompt_len[r],
                                       self.prefix_start[r], self.own_start[r])
                lo, hi = self.key_range(pos, 0 if ps >= 0 else p0, P if ps < 0 else p0, window)
                s0 = (ps + lo if ps >= 0 else own + lo - p0, hi - lo) if hi > lo else (0, 0)
                lo, hi = self.key_range(pos, P, pos + 1, window)
                seg.append((*s0, own + lo - p0, hi - lo))
                groups.setdefault(s0 if ps >= 0 and s0[1] > 0 else ("row", r), []).append(r)
            order = [r for rows in groups.values() for r in rows]
            ptr = [0]
            for rows in groups.values():
                ptr.append(ptr[-1] + len(rows))
            base = torch.tensor(seg, dtype=torch.long).view(-1, 4)
            group_ptr, order = torch.tensor(ptr, dtype=torch.long), torch.tensor(order, dtype=torch.long)
            if window is None:
                self._static["native_base"] = (base, group_ptr, order)
        seg = base
        if window is None and self.t:
            seg = base.clone()
            seg[:, 3] += self.t  # one more own key per step
        ends = torch.maximum(seg[:, 0] + seg[:, 1], seg[:, 2] + seg[:, 3])
        if self.num_rows and (int(seg[:, [0, 2]].min()) < 0 or int(ends.max()) > num_positions):
            raise ValueError("KVLayout.native_segments: a run outside the arena")
        self._step[key] = out = (seg, group_ptr, order)
        return out

    # ------------------------------------------------------------------ device tensors
    def _tensor(self, name: str, values: list[int]) -> torch.Tensor:
        t = self._static.get(name)
        if t is None:
            t = self._static[name] = torch.tensor(values, dtype=torch.long, device=self.device)
        return t

    def write_index(self) -> torch.Tensor:
        """Decode: (B,) arena position where each row's token of this step goes."""
        if "write" not in self._step:
            base = self._tensor("write0", [s - p0 + p for s, p0, p in zip(self.own_start, self.own_pos0,
                                                                            self.position0)])
            self._step["write"] = base + self.t if self.t else base
        return self._step["write"]

    def prefill_runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Prefill: (arena position of each prompt's first token, its length, its cached
        prefix or None when no row has one), (B,) int64 on the CPU each, for the compiled
        prefill kernel."""
        key = "prefill_runs"
        if key not in self._static:
            self._static[key] = (torch.tensor(self.own_start, dtype=torch.long),
                                 torch.tensor(self.lengths, dtype=torch.long),
                                 torch.tensor(self.position0, dtype=torch.long) if self.resumes else None)
        return self._static[key]

    def prefill_write(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: (arena positions, flat row * T + t indices) of every token this prefill
        computes (positions position0 .. length - 1 of each row)."""
        key = ("prefill_write", T)
        if key not in self._static:
            dst, src = [], []
            for r, (s, n, c) in enumerate(zip(self.own_start, self.lengths, self.position0)):
                dst.extend(range(s + c, s + n))
                src.extend(range(r * T, r * T + n - c))
            dev = self.device
            self._static[key] = (torch.tensor(dst, dtype=torch.long, device=dev),
                                 torch.tensor(src, dtype=torch.long, device=dev))
        return self._static[key]

    def own_gather(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batched path: (index (B, L), valid (B, L), key positions (B, L)) of each row's own keys.

        index holds arena positions (padding points at a written position of the row, so
        every gathered value is finite); valid is False for padding and keys outside the window.
        """
        key = ("own", window)
        if key not in self._step:
            dev = self.device
            pos = self._tensor("pos0", self.position0) + self.t
            pos0 = self._tensor("own_pos0", self.own_pos0)
            start = self._tensor("own_start", self.own_start)
            L = max(p + self.t - p0 + 1 for p, p0 in zip(self.position0, self.own_pos0))
            j = torch.arange(L, device=dev)[None, :]
            kpos = pos0[:, None] + j
            valid = kpos <= pos[:, None]
            if window is not None:
                valid &= pos[:, None] - kpos <= window
            index = torch.where(valid, start[:, None] + j, start[:, None] + (pos - pos0)[:, None])
            self._step[key] = (index, valid, kpos)
        return self._step[key]

    def prefix_gather(self, window: int | None) -> tuple | None:
        """Batched path: the shared prompts as one padded block, or None without any.

        Returns (index (R, P), valid (R, Nq, P), rows (n,), slots (n,), num_slots): R distinct
        prompts, P the longest, Nq the most rows of one prompt; `rows` are the rows with a
        prefix and `slots` their query slot prompt * Nq + i (i: the row's place among its
        prompt's rows), num_slots = R * Nq. index holds arena positions (padding points at the
        prompt's first position, so every gathered value is finite); valid[r, i, p]: query slot
        i of prompt r sees prompt position p (prompt length and window).
        """
        key = ("prefix", window)
        if key in self._step:
            return self._step[key]
        if not self.has_prefix():
            self._step[key] = None
            return None
        stat = self._static.get("prefix_struct")
        if stat is None:
            prompts: dict[int, int] = {}
            counts: list[int] = []
            lens: list[int] = []
            rows, slots = [], []
            for r, (ps, p0) in enumerate(zip(self.prefix_start, self.own_pos0)):
                if ps < 0:
                    continue
                if ps not in prompts:
                    prompts[ps] = len(prompts)
                    counts.append(0)
                    lens.append(p0)
                i = prompts[ps]
                rows.append(r)
                slots.append((i, counts[i]))
                counts[i] += 1
            nq = max(counts)
            stat = self._static["prefix_struct"] = (list(prompts), lens, nq, rows, [i * nq + c for i, c in slots])
        starts, lens, nq, rows, slots = stat
        dev = self.device
        P = max(lens)
        R = len(starts)
        j = torch.arange(P, device=dev)
        st = self._tensor("prefix_starts", starts)
        ln = self._tensor("prefix_lens", lens)
        in_prompt = j[None, :] < ln[:, None]  # (R, P)
        index = torch.where(in_prompt, st[:, None] + j[None, :], st[:, None])
        rows_t = self._tensor("prefix_rows", rows)
        slots_t = self._tensor("prefix_slots", slots)
        valid = in_prompt[:, None, :].expand(R, nq, P)
        if window is not None:
            # each query slot's position (dummy slots: 0; their outputs are never read)
            pos = torch.zeros(R * nq, dtype=torch.long, device=dev)
            pos.index_copy_(0, slots_t, (self._tensor("pos0", self.position0) + self.t).index_select(0, rows_t))
            valid = valid & (pos.view(R, nq, 1) - j[None, None, :] <= window)
        out = (index, valid, rows_t, slots_t, R * nq)
        self._step[key] = out
        return out
