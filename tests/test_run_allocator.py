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
