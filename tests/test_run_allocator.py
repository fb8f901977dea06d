"""engine.run_allocator.RunAllocator against a plain bitmap of the same blocks."""
import random

import pytest

from engine.run_allocator import RunAllocator


def test_first_fit_from_either_end_and_coalescing():
    """Runs come from the low end (or the high end on request); freed runs merge with their
    neighbours, so a fully freed arena is one range again."""
    a = RunAllocator(20)
    assert [a.allocate(4), a.allocate(4), a.allocate(3, from_end=True)] == [0, 4, 17]
    assert a.free_ranges() == [(8, 9)] and a.num_free == 9
    a.free(0, 4)
    assert a.allocate(2) == 0  # first fit takes the hole at the bottom
    assert a.allocate(5) == 8
    assert a.allocate(10) is None and a.largest_free() == 4
    for start, n in ((0, 2), (4, 4), (8, 5), (17, 3)):
        a.free(start, n)
    assert a.free_ranges() == [(0, 20)] and a.num_free == 20


def test_bad_frees_are_refused():
    a = RunAllocator(8)
    s = a.allocate(3)
    a.free(s, 3)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(s, 3)
    with pytest.raises(ValueError):
        a.free(6, 4)
    with pytest.raises(ValueError):
        a.allocate(0)


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_a_bitmap(seed):
    """Thousands of random allocations and frees: runs never overlap, free space is counted
    exactly, free ranges are never adjacent (always coalesced), and an allocation fails only
    when no free range of that length exists."""
    rng = random.Random(seed)
    N = 300
    a = RunAllocator(N)
    used = [False] * N
    live: list[tuple[int, int]] = []
    for _ in range(4000):
        if live and rng.random() < 0.45:
            start, n = live.pop(rng.randrange(len(live)))
            a.free(start, n)
            used[start:start + n] = [False] * n
        else:
            n = rng.randint(1, 40)
            start = a.allocate(n, from_end=rng.random() < 0.3)
            longest = max((len(r) for r in "".join("x" if u else "." for u in used).split("x")), default=0)
            if start is None:
                assert longest < n
                continue
            assert not any(used[start:start + n]) and start + n <= N
            used[start:start + n] = [True] * n
            live.append((start, n))
        ranges = a.free_ranges()
        assert a.num_free == used.count(False) == sum(n for _, n in ranges)
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(ranges, ranges[1:]))
        assert all(not any(used[s:s + n]) for s, n in ranges)


@pytest.mark.parametrize("seed", range(3))
def test_compact_slides_every_run_down_in_order(seed):
    """After random allocations and frees, `compact` returns the allocated stretches with where
    each goes: packed from block 0 in their order, each moved down or not at all, each ending
    at or below the next one's old start (so moving them in order overwrites nothing unmoved);
    afterwards the free blocks are one range at the top, and allocation goes on from there."""
    rng = random.Random(seed)
    N = 200
    a = RunAllocator(N)
    live: list[tuple[int, int]] = []
    for _ in range(300):
        if live and rng.random() < 0.5:
            a.free(*live.pop(rng.randrange(len(live))))
        else:
            n = rng.randint(1, 12)
            start = a.allocate(n, from_end=rng.random() < 0.3)
            if start is not None:
                live.append((start, n))
    used = N - a.num_free
    assert a.largest_free() < a.num_free  # fragmented
    stretches = a.compact()
    blocks = sorted(b for s, n in live for b in range(s, s + n))
    assert [b for s, n, _ in stretches for b in range(s, s + n)] == blocks  # exactly the allocated blocks
    assert stretches[0][2] == 0 and all(d1 + n1 == d2 for (_, n1, d1), (_, _, d2) in zip(stretches, stretches[1:]))
    assert all(d <= s for s, _, d in stretches)
    assert all(d1 + n1 <= s2 for (_, n1, d1), (s2, _, _) in zip(stretches, stretches[1:]))
    assert a.free_ranges() == [(used, N - used)] and a.num_free == N - used
    assert a.allocate(N - used) == used and a.free_ranges() == [] and a.compact() == [(0, N, 0)]


def test_copy_is_independent():
    a = RunAllocator(10)
    a.allocate(3)
    b = a.copy()
    assert b.allocate(7) == 3 and b.num_free == 0
    assert a.free_ranges() == [(3, 7)] and a.num_free == 7
