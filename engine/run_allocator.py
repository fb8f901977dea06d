"""Which KV-cache blocks are free: a first-fit allocator of contiguous runs of blocks.

The KV cache (engine/kv_cache.py) is one arena of `num_blocks x block_size` positions per
layer. Every allocation here is one contiguous run of blocks, so that attention reads a
run as a strided view of the arena instead of gathering it (a prompt's keys, or a
sample's generated keys, are one run each; see engine/scheduler.py for who asks for what).

Free space is kept as a sorted list of disjoint (start, length) ranges; `allocate` takes
the first range long enough (first fit: it keeps the low end of the arena dense, so runs
allocated one after another are adjacent; or, on request, the end of the last range that
fits, for runs that should stay out of the way), `free` puts a run back and merges it with its
free neighbours (coalescing: the arena with nothing allocated is always one free range,
so a request that fits an empty cache is never refused for fragmentation there).
Costs are O(number of free ranges) per call. Knuth, TAOCP vol. 1, 2.5 (first fit with
boundary merging).

Free space can still be cut into ranges too short for a request although there are enough
free blocks in total (runs freed here and there between live ones). `compact` is the way out:
it slides every allocated stretch down to the low end of the arena, in order, so the free
blocks become one range at the top, and returns the moves for the owner of the runs to apply
(the engine copies their keys and values and updates where its sequences' runs start:
Engine._compact). Live runs keep their order, and each moves down or stays, never up (Knuth,
TAOCP vol. 1, 2.5, compacting; the "sliding" compaction of mark-compact collectors).
"""
from __future__ import annotations

import bisect


class RunAllocator:
    """First-fit allocator of contiguous runs of blocks in [0, num_blocks).

    Raises ValueError for a bad request (non-positive size, a run that is not allocated).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"RunAllocator needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._lengths: list[int] = [num_blocks]
        self.num_free = num_blocks

    def allocate(self, n: int, from_end: bool = False) -> int | None:
        """The first block of a new run of `n` contiguous blocks, or None if no free range fits.

        from_end: take the run from the end of the last free range that fits instead of the
        start of the first (so that two kinds of runs grow from opposite ends of the arena
        and runs of one kind allocated one after another stay adjacent).
        """
        if n < 1:
            raise ValueError(f"cannot allocate {n} blocks")
        order = range(len(self._lengths) - 1, -1, -1) if from_end else range(len(self._lengths))
        for i in order:
            length = self._lengths[i]
            if length >= n:
                start = self._starts[i] + (length - n if from_end else 0)
                if length == n:
                    del self._starts[i], self._lengths[i]
                elif from_end:
                    self._lengths[i] -= n
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                self.num_free -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        """Give back the run [start, start + n); it merges with free neighbours."""
        if n < 1 or start < 0 or start + n > self.num_blocks:
            raise ValueError(f"cannot free blocks [{start}, {start + n}) of {self.num_blocks}")
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + n) or \
                (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start):
            raise ValueError(f"blocks [{start}, {start + n}) overlap free space: freed twice?")
        merge_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        merge_right = i < len(self._starts) and self._starts[i] == start + n
        if merge_left and merge_right:
            self._lengths[i - 1] += n + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += n
        elif merge_right:
            self._starts[i] = start
            self._lengths[i] += n
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, n)
        self.num_free += n

    def copy(self) -> RunAllocator:
        """An independent allocator in the same state (for a dry run of a schedule)."""
        other = RunAllocator.__new__(RunAllocator)
        other.num_blocks, other.num_free = self.num_blocks, self.num_free
        other._starts, other._lengths = list(self._starts), list(self._lengths)
        return other

    def compact(self) -> list[tuple[int, int, int]]:
        """Slide every allocated stretch down to the low end: afterwards the free blocks are the
        one range [num_blocks - num_free, num_blocks).

        Returns (start, length, new_start) per maximal stretch of allocated blocks, by start
        (new_start <= start; a run inside a stretch moves by start - new_start blocks). The
        caller must move the runs' contents accordingly: in order of start, each run's
        destination lies below its source and below every later run's source.
        """
        stretches: list[tuple[int, int, int]] = []
        end, new = 0, 0  # end of the last free range seen; where the next stretch goes
        for start, length in zip(self._starts + [self.num_blocks], self._lengths + [0]):
            if start > end:
                stretches.append((end, start - end, new))
                new += start - end
            end = start + length
        self._starts, self._lengths = ([new], [self.num_free]) if self.num_free else ([], [])
        return stretches

    def largest_free(self) -> int:
        """Length of the longest free range, in blocks (0 when full)."""
        return max(self._lengths, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as (start, length), sorted by start."""
        return list(zip(self._starts, self._lengths))
