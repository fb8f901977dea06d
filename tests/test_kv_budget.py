"""Workers on one node divide its memory (issue 20, item 4). Each worker's default KV budget
used to be a quarter of the host's RAM (or 90% of its GPU's free memory) whatever else ran
there: eight CPU workers asked for 200% of RAM and Ray's OOM killer replaced them in a loop.
Now the default is a fraction of what is free times the worker's share of its node (its
CPUs over the node's, or the fraction of a GPU it holds), and a worker whose share cannot
hold one sequence fails to start with the numbers."""
from __future__ import annotations

import pytest
import torch

import engine.kv_cache as kv_cache

CPU = torch.device("cpu")


def test_the_default_budget_is_a_share_of_what_is_free(monkeypatch):
    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 8 << 30)
    assert kv_cache.default_kv_bytes(CPU) == 4 << 30  # half of what the host has free
    assert kv_cache.default_kv_bytes(CPU, 0.125) == 512 << 20  # one of eight one-CPU workers
    shares = [kv_cache.default_kv_bytes(CPU, 1 / 8) for _ in range(8)]
    assert sum(shares) <= kv_cache.default_kv_bytes(CPU)  # eight workers ask for no more than one did
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="share must be in"):
            kv_cache.default_kv_bytes(CPU, bad)


def test_the_host_free_memory_is_what_linux_says_is_available():
    """MemAvailable, not the physical size: memory other processes use is not ours to take."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(kv_cache.free_memory_bytes(CPU) - avail) < 0.2 * avail


def test_a_share_too_small_for_one_sequence_fails_with_the_numbers(monkeypatch):
    from engine import load_engine

    monkeypatch.setattr(kv_cache, "free_memory_bytes", lambda device: 1 << 20)
    with pytest.raises(ValueError) as e:
        load_engine("tiny-random", device="cpu", dtype="float32", kv_share=0.125)
    msg = str(e.value)
    assert "default KV cache budget of 65536 bytes" in msg and "1048576 bytes free on this host" in msg
    assert "share of it, 0.125" in msg and "model.kv_cache_gb" in msg and "fewer workers per node" in msg


def test_workers_on_one_node_divide_it(ray_local):
    """Two one-CPU workers on the 2-CPU local node: each engine's budget is half of what one
    worker alone would get (the machine's free memory moves a little while they load)."""
    from jobs import GenerationPool

    alone = kv_cache.default_kv_bytes(CPU)
    with GenerationPool({"model": {"path": "tiny-random"},
                         "cluster": {"num_workers": 2, "cpus_per_worker": 1}}) as pool:
        budgets = [s["kv_budget_bytes"] for s in pool.engine_states()]
    assert len(budgets) == 2
    for b in budgets:
        assert 0.35 * alone < b < 0.65 * alone, (b, alone)
    assert sum(budgets) < 1.15 * alone
