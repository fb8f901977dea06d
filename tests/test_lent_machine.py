"""bench/lent_machine.py: issue 18's checks in one call of a lent machine.

What this proves, without one: the CPU sets it pins the benches to never share a physical
core (or, on a small machine, fall back to the same two CPUs for all), and its summary finds
bench_dtypes' rates in the logs and reports bfloat16 / float32 per workload, across the two
processes of the RL shape and for the forced-tiles runs (whose float32 is the plain run's).
"""
from __future__ import annotations

import subprocess

from conftest import bench_module


def _lent():
    return bench_module("lent_machine")


def _fake_lscpu(monkeypatch, lent, rows: list[str], allowed: set[int]):
    out = "# CPU,Core,Socket\n" + "\n".join(rows) + "\n"
    monkeypatch.setattr(lent.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out, stderr=""))
    monkeypatch.setattr(lent.os, "sched_getaffinity", lambda pid: allowed)


def test_cpu_sets_use_distinct_physical_cores(monkeypatch):
    """16 CPUs on 8 cores (siblings c and c + 8): 3 sets of 2 take one CPU of 6 distinct cores,
    the rest is every CPU of the other cores; with 2 cores every set is the same pair."""
    lent = _lent()
    rows = [f"{c},{c % 8},0" for c in range(16)]
    _fake_lscpu(monkeypatch, lent, rows, set(range(16)))
    sets, rest = lent.cpu_sets(3)
    assert sets == [[0, 1], [2, 3], [4, 5]]
    assert sorted(rest) == [6, 7, 14, 15]
    pinned = [c % 8 for s in sets for c in s]
    assert len(set(pinned)) == 6 and not set(pinned) & {c % 8 for c in rest}
    _fake_lscpu(monkeypatch, lent, ["0,0,0", "1,1,0"], {0, 1})
    assert lent.cpu_sets(3) == ([[0, 1]] * 3, [0, 1])


def test_summary_reports_ratios_per_workload(tmp_path):
    """Rates in bench_dtypes' format give bfloat16 / float32 and auto / float32 per workload,
    the RL shape's from two logs, the forced and vector-attention runs' against the plain
    float32 (a dtype's rate the mean of its runs in the log: float32 400 and 600); bench_peers'
    verdict kept."""
    lent = _lent()
    line = "  {:8s} ({}): 1000 tokens in 1.0 s = {} tokens/s (prefill 10 prompt tokens, 0 cached)\n"
    (tmp_path / "dtypes_smollm2.log").write_text(
        "machine: X\n" + line.format("float32", "float32", "400.0") + line.format("bfloat16", "bfloat16", "1000.0")
        + line.format("auto", "bfloat16", "980.0") + line.format("bfloat16", "bfloat16", "1000.0")
        + line.format("float32", "float32", "600.0"))
    (tmp_path / "dtypes_rl_f32.log").write_text(line.format("float32", "float32", "200.0"))
    (tmp_path / "dtypes_rl_bf16.log").write_text(line.format("bfloat16", "bfloat16", "300.0"))
    (tmp_path / "forced_rl.log").write_text(line.format("bfloat16", "bfloat16", "500.0"))
    (tmp_path / "vector_smollm2.log").write_text(line.format("bfloat16", "bfloat16", "800.0"))
    (tmp_path / "peers_rl.log").write_text("  rl: llama-f32 50.0, batchgen 300.0; best peer llama-f32 50.0; "
                                           "batchgen / best peer = 6.00x\n")
    (tmp_path / "prep.log").write_text("amx_verdict: (None, 'refused')\n")
    text = lent._summarise(tmp_path, ["dtypes_smollm2", "dtypes_rl_f32", "dtypes_rl_bf16", "forced_rl", "vector_smollm2",
                                     "peers_rl", "pytest"])
    assert "smollm2: bfloat16 / float32 = 2.00x (1000.0 / 500.0 tokens/s)" in text
    assert "smollm2: auto / float32 = 1.96x" in text
    assert "rl: bfloat16 / float32 = 1.50x" in text
    assert "forced rl: bfloat16 / float32 = 2.50x" in text
    assert "vector smollm2: bfloat16 / float32 = 1.60x (800.0 / 500.0 tokens/s)" in text
    assert "batchgen / best peer = 6.00x" in text
    assert "amx_verdict: (None, 'refused')" in text


def test_a_base_engine_adds_the_gemm_comparisons(tmp_path):
    """`prepare --base REV` leaves REV's engine/ in the folder; only then does `run` time
    bench_gemm against it (--base), on 2 threads and on 1, weights read from memory."""
    lent = _lent()
    names = lambda: [n for n, _ in lent._jobs("M", "D", tmp_path / "base")[1]]  # noqa: E731
    assert not [n for n in names() if n.startswith("gemm_base")]
    (tmp_path / "base" / "engine").mkdir(parents=True)
    jobs = dict(lent._jobs("M", "D", tmp_path / "base")[1])
    assert jobs["gemm_base_t2_cold"][-4:] == ["--layers", "30", "--base", str(tmp_path / "base")]
    assert "gemm_base_t1_cold" in jobs
