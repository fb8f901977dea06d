"""Rollouts inside a training loop: calls read as their prompts finish, aborted, paused.

In one process (Engine, the tiny nanochat checkpoint of tests/weights_cases.py):
- Engine.abort ends requests between steps: their finished samples as they are, running ones
  with their tokens so far (a prefix of the uninterrupted sample) and finish_reason "abort",
  unstarted ones empty; every other sample's tokens and logprobs are bit-identical to a run
  without the abort; Engine.continue_request goes on from the aborted tokens and ends with the
  uninterrupted run's tokens.

A RolloutRunner over fake workers (tests/test_cluster.py's): the replies of a call's units
still on a worker when the call failed are collected after it, so pause("wait") returns.

On a real Ray head (one pool of 2 workers for the module; `base` then `trained` weights):
- submit() of 64 prompts x 8 samples, 4 prompts running 50x longer than the rest: groups
  (all 8 rows of one prompt) come back while the long samples still run, before half the
  call's time; the rows equal generate()'s;
- abort() of the same call returns within 2 s with all 512 samples once: finished ones as in
  the full call, unfinished ones "abort" with a prefix of their full tokens;
- pause("keep"), load_weights(trained) or update_weights(trained's state dict), resume():
  samples running at the pause carry the pool's weight version v then v + 1, their version-v
  tokens are those of the call on `base` alone, and the pool serves the next call;
- one hung (SIGSTOPped) worker never holds the caller: pause("wait") and pause("keep")
  replace it, and submit() and abort(timeout_s) do not wait behind a swap held by one;
  pause("wait") while "keep" holds returns at once.
"""
from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import weights_cases
from conftest import same_rows

N_PROMPTS, N_SAMPLES, SHORT, LONG, N_LONG = 64, 8, 2, 100, 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return weights_cases.build(tmp_path_factory.mktemp("rollouts") / "ckpt")


# ---------------------------------------------------------------------------------- one process
def _run(eng, prompts, params, abort_at=None, ids=(), keep=False):
    """Every request's output; at step `abort_at`, abort `ids` (and continue them if `keep`)."""
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"q{i}", request_id=i)
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
        if steps == abort_at:
            aborted = eng.abort(ids)
            assert sorted(o.request_id for o in aborted) == sorted(ids)
            for o in aborted:
                if keep:
                    eng.continue_request(o, params)
                else:
                    outs[o.request_id] = o
    return outs


def test_engine_abort_and_continue(ckpts):
    """Engine.abort: aborted requests come back whole (finished samples kept, running ones cut
    with finish_reason abort, never-admitted ones empty), the others are bit-identical to a run
    without the abort; continue_request finishes aborted samples with the uninterrupted tokens."""
    from engine import SamplingParams, load_engine

    # 4 slots for 4 x 2 samples: requests 2 and 3 wait when the abort comes
    eng = load_engine(str(ckpts["base"]), device="cpu", dtype="float32", max_seq_len=64, max_num_seqs=4)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(4)]
    p = SamplingParams(num_samples=2, max_tokens=8, seed=3, stop_token_ids=[])
    full = _run(eng, prompts, p)
    cut = _run(eng, prompts, p, abort_at=3, ids=[0, 3])
    for i in range(4):
        for a, b in zip(full[i].samples, cut[i].samples):
            if i in (0, 3):
                assert b.finish_reason == "abort" and b.tokens == a.tokens[: len(b.tokens)]
                assert b.logprobs == a.logprobs[: len(b.tokens)] and len(b.weight_versions) == len(b.tokens)
            else:
                assert (a.tokens, a.logprobs, a.finish_reason) == (b.tokens, b.logprobs, b.finish_reason)
    assert all(0 < len(s.tokens) < 8 for s in cut[0].samples)
    assert all(s.tokens == [] for s in cut[3].samples)  # never admitted
    assert not eng.has_unfinished_requests() and eng.kv_used_bytes == 0  # every KV run freed
    assert eng.abort([0, "unknown"]) == []

    kept = _run(eng, prompts, p, abort_at=3, ids=list(range(4)), keep=True)
    for i in range(4):
        for a, b in zip(full[i].samples, kept[i].samples):
            assert b.tokens == a.tokens and b.finish_reason == a.finish_reason and b.sample_index == a.sample_index
            assert b.num_prompt_tokens == len(prompts[i]) and b.weight_versions == [0] * len(a.tokens)
            # logprobs of recomputed positions: prefill and decode agree to rounding, not bit for bit
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_continue_inside_tool_output_forces_the_rest_first(ckpts):
    """A sample aborted halfway through forced calculator output continues with the rest of
    that output (mask 0, no logprob) before it samples again, and its tool call is whole."""
    from engine import SamplingParams, load_engine
    from engine.params import RequestOutput, Sample

    eng = load_engine(str(ckpts["base"]), device="cpu", dtype="float32", max_seq_len=64)
    tok = eng.tokenizer
    sp = {n: tok.special(f"<|{n}|>") for n in ("python_start", "python_end", "output_start", "output_end")}
    sampled = [sp["python_start"], *tok.encode("1+1"), sp["python_end"]]
    forced = [sp["output_start"], *tok.encode("2")]  # <|output_end|> still to come
    prior = Sample(prompt_id="q", sample_index=2, tokens=sampled + forced, mask=[1] * len(sampled) + [0] * len(forced),
                   logprobs=[-1.0] * len(sampled) + [None] * len(forced), finish_reason="abort",
                   num_prompt_tokens=3, seed=3, weight_versions=[0] * (len(sampled) + len(forced)))
    done = Sample(prompt_id="q", sample_index=0, tokens=[5], mask=[1], logprobs=[-2.0], finish_reason="stop")
    params = SamplingParams(num_samples=3, max_tokens=16, seed=3, stop_token_ids=[])
    eng.continue_request(RequestOutput("r", "q", [1, 2, 3], [done, Sample(prompt_id="q", sample_index=1,
                                                                           finish_reason="abort"), prior]), params)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    (out,) = outs
    s0, s1, s2 = out.samples
    assert s0 is done and len(s1.tokens) == 16 and s1.num_prompt_tokens == 3
    n = len(prior.tokens)
    assert s2.tokens[:n] == prior.tokens and s2.tokens[n] == sp["output_end"]
    assert s2.mask[n] == 0 and s2.logprobs[n] is None and s2.mask[n + 1] == 1 and len(s2.tokens) == 16
    assert [(c.start, c.end, c.expr, c.output, c.error) for c in s2.tool_calls] == [(0, n + 1, "1+1", "2", None)]
    assert s2.weight_versions == [0] * 16 and s2.num_prompt_tokens == 3


# ---------------------------------------------------------------------------------- a worker, in-process
def test_worker_abort_pause_and_weights_while_held(ckpts):
    """GenerationWorker without Ray: a unit aborted before it arrives returns "abort" rows
    without generating; a unit held by pause_engine lets a weights swap through (the engine
    is idle) and, after resume_engine, finishes with versions 0 then 1; a held unit that is
    aborted returns its samples as held."""
    import threading

    from cluster.worker import GenerationWorker
    from jobs.config import load_job_spec
    from jobs.pool_task import PoolTask

    spec = load_job_spec({"model": {"path": str(ckpts["base"]), "max_seq_len": 64, "max_num_seqs": 8},
                          "sampling": {"num_samples": 2, "max_tokens": 40, "seed": 1, "stop_token_ids": []}})
    task = PoolTask(spec)
    w = GenerationWorker(task, "w0", num_threads=1)
    eng, steps, started = w.engine, [0], threading.Event()
    real_step = eng.step

    def step():
        steps[0] += 1
        if steps[0] == 3:
            started.set()
        return real_step()

    eng.step = step
    units, _ = task.make_units(["abc", "de"], None, None, 0, 1)
    more, _ = task.make_units(["fgh"], None, ["x"], 2, 1)

    w.abort_units([more[0].index])  # before the unit arrives
    rows = w.run_unit(more[0]).data.to_pylist()
    assert [(r["finish_reason"], r["tokens"]) for r in rows] == [("abort", [])] * 2 and steps[0] == 0

    results = {}
    threads = [threading.Thread(target=lambda u=u: results.__setitem__(u.index, w.run_unit(u))) for u in units]
    threads[0].start()
    assert started.wait(60)  # unit 0 decodes; unit 1 comes now, into the engine, the inbox or after the abort
    threads[1].start()
    assert w.pause_engine() >= 1 and not eng.has_unfinished_requests()
    w.stage_weights(str(ckpts["trained"]))
    assert w.commit_weights()["weights"]["path"] == str(ckpts["trained"])  # went through: the engine was idle
    w.abort_units([units[1].index])
    w.resume_engine()
    for t in threads:
        t.join(60)
    a, b = results[0].data.to_pylist(), results[1].data.to_pylist()
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == 40 for r in a)
    assert all(0 in r["weight_version"] and r["weight_version"][-1] == 1 for r in a)
    assert all(r["finish_reason"] == "abort" and set(r["weight_version"]) <= {0} for r in b)
    assert w.progress()["active_units"] == 0
    w.shutdown()


# ---------------------------------------------------------------------------------- a runner, fake workers
def test_pause_wait_collects_the_units_a_failed_call_left_on_a_worker(ray_local, tmp_path):
    """A call fails (unit 0 cannot be read, max_unit_attempts 1) while its unit 1 still runs
    on the worker, held at a gate; the gate opens after the call has ended. The runner goes
    on collecting replies with no call open, so unit 1's copy comes off the worker's books
    and pause("wait") returns once the worker is idle. (Before, rounds ran only while a
    call was open: the copy stayed booked and pause("wait") never returned.) Fake workers
    (tests/test_cluster.py), no torch in them."""
    import os

    from cluster.dispatcher import UnitDispatcher
    from cluster.rollout import RolloutRunner
    from cluster.unit import UnitFailed, WorkUnit
    from test_cluster import FakeTask, _by_value, fifo_gate

    _by_value()
    gate = fifo_gate(tmp_path / "gate")
    task = FakeTask(str(tmp_path), ["a", "b"], fail={0: "always"}, gate={1: str(tmp_path / "gate")})
    dispatcher = UnitDispatcher(task, num_workers=1, num_cpus=1, max_unit_attempts=1)
    runner = RolloutRunner(dispatcher)
    try:
        dispatcher.wait_ready()
        call = runner.submit([WorkUnit(0, "mem", 0, 1), WorkUnit(1, "mem", 1, 2)], lambda r: None)
        assert call.wait(30) and isinstance(call.error, UnitFailed), call.error
        os.write(gate, b"x")  # unit 1 finishes on the worker now, its call long ended
        assert runner.pause("wait", timeout_s=10)  # a bound: the fix returns within moments
        assert runner.call(dispatcher.workers)[0]["units"] == []
        runner.resume()
    finally:
        runner.close()
        dispatcher.close()
        os.close(gate)


def test_closing_the_pool_ends_its_calls_and_handles_stay_usable(ckpts, ray_local):
    """close() while a call runs: the call ends with RuntimeError("... closed") from
    result(), abort() of it or of a call finished before returns True (a `finally:
    h.abort()` after the pool's `with` block used to raise), a call after close raises,
    an empty one too (it used to return an empty table), and no runner thread is left.
    Its own pool of one worker, before the module's pool takes both CPUs."""
    import threading

    from jobs import GenerationPool

    config = {"model": {"path": str(ckpts["base"]), "max_num_seqs": 64, "max_seq_len": 128},
              "input": {"sampling_column": "params"},
              "sampling": {"num_samples": N_SAMPLES, "max_tokens": SHORT, "seed": 5, "stop_token_ids": []},
              "cluster": {"num_workers": 1}}
    with GenerationPool(config) as p:
        finished = p.submit(_prompts()[:2], SEED)
        finished.result(timeout_s=120)
        running = p.submit(_prompts(long_tokens=120), SEED)
        next(running.results(timeout_s=120))
    assert running.done() and running.abort() and finished.abort()
    with pytest.raises(RuntimeError, match="closed"):
        running.result()
    assert finished.result().num_rows == 2 * N_SAMPLES
    for prompts in (_prompts()[:2], []):
        with pytest.raises(RuntimeError, match="closed"):
            p.generate(prompts)
    assert not [t for t in threading.enumerate() if t.name == "batchgen-rollouts"]


# ---------------------------------------------------------------------------------- a pool
@pytest.fixture(scope="module")
def pool(ckpts, ray_local):
    from jobs import GenerationPool

    config = {"model": {"path": str(ckpts["base"]), "max_num_seqs": 64, "max_seq_len": 128},
              "input": {"sampling_column": "params"},
              "sampling": {"num_samples": N_SAMPLES, "max_tokens": SHORT, "seed": 5, "stop_token_ids": []},
              "cluster": {"num_workers": 2}}
    with GenerationPool(config) as p:
        p.generate(_prompts()[:4])  # each worker's first unit imports and warms up (about 2 s here)
        yield p


SEED = {"seed": 5}  # the config's, given: calls compared with each other draw the same noise (no fresh noise)


def _prompts(long_tokens: int = LONG) -> pa.Table:
    """64 prompts; the first N_LONG run `long_tokens` tokens, the others SHORT."""
    return pa.table({
        "prompt": [f"prompt {i} " + "x" * (i % 7) for i in range(N_PROMPTS)],
        "prompt_id": [f"p{i}" for i in range(N_PROMPTS)],
        "params": [{"max_tokens": long_tokens if i < N_LONG else SHORT} for i in range(N_PROMPTS)],
    })


def _check_groups(groups: list, expect_rows: int) -> dict:
    """Every group is one prompt's N_SAMPLES rows; every (prompt, sample) once. {key: row}."""
    rows = {}
    for g in groups:
        assert isinstance(g, pa.RecordBatch) and g.num_rows == N_SAMPLES
        assert len(set(g.column("prompt_id").to_pylist())) == 1
        assert g.column("sample_index").to_pylist() == list(range(N_SAMPLES))
        for r in g.to_pylist():
            key = (r["prompt_id"], r["sample_index"])
            assert key not in rows, f"duplicate row {key}"
            rows[key] = r
    assert len(rows) == expect_rows
    return rows


def test_submit_streams_groups_then_abort_returns_everything(pool):
    """Groups come back as prompts finish, long before the call ends; the rows equal
    generate()'s. An abort of the same call returns within 2 s with every sample once:
    finished ones as in the full call, unfinished ones "abort" with a prefix of their tokens
    (the long ones, unless the abort took longer than they did: the full suite once saw
    them finish first when they ran 60 tokens; they run the whole 100 now, and at least one
    sample must be cut)."""
    t0 = time.monotonic()
    h = pool.submit(_prompts(), SEED)
    groups, first, times = [], None, []
    for g in h.results(timeout_s=120):
        first = first or time.monotonic() - t0
        times.append(round(time.monotonic() - t0, 2))
        groups.append(g)
    total = time.monotonic() - t0
    print("\narrivals", times)
    full = _check_groups(groups, N_PROMPTS * N_SAMPLES)
    print(f"\nfirst group after {first:.2f} s of a {total:.2f} s call")
    assert first < total / 2
    assert all(len(full[(f"p{i}", j)]["tokens"]) == LONG for i in range(N_LONG) for j in range(N_SAMPLES))
    assert same_rows(h.result()) == same_rows(pool.generate(_prompts(), SEED))  # prompt order; = generate

    h = pool.submit(_prompts(), SEED)
    groups = []
    for g in h.results(timeout_s=120):
        groups.append(g)
        if len(groups) == 8:
            break
    t = time.monotonic()
    assert h.abort(timeout_s=10)
    took = time.monotonic() - t
    print(f"abort returned in {took:.2f} s")
    assert took < 2.0
    groups += list(h.results(timeout_s=10))
    rows = _check_groups(groups, N_PROMPTS * N_SAMPLES)
    reasons = {}
    for key, r in rows.items():
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
        ref = full[key]["tokens"]  # the same prompts and noise: the full call's samples
        if r["finish_reason"] == "abort":
            assert r["tokens"] == ref[: len(r["tokens"])], key
        else:
            assert r["tokens"] == ref and r["finish_reason"] == "length", key
        assert len(r["weight_version"]) == len(r["tokens"])
    print("finish reasons after the abort", reasons)
    assert reasons.get("abort", 0) >= 1
    assert reasons["length"] >= 8 * N_SAMPLES  # the groups read before the abort, at least
    assert h.result().num_rows == N_PROMPTS * N_SAMPLES


@pytest.mark.parametrize("swap", ["load_weights", "update_weights"])
def test_pause_keep_swap_weights_resume(pool, ckpts, swap):
    """Samples held across pause("keep") and a weights swap (a checkpoint, or the trainer's
    tensors from memory) continue after resume(): their weight_version is the pool's version
    v0 then v0 + 1, and their version-v0 tokens are those the call gets on the old weights alone."""
    v0 = pool.engine_states()[0]["weight_version"]
    ref = {(r["prompt_id"], r["sample_index"]): r for r in pool.generate(_prompts(long_tokens=60), SEED).to_pylist()}
    h = pool.submit(_prompts(long_tokens=60), SEED)
    next(h.results(timeout_s=120))  # the engines are running (a short prompt finished)
    assert pool.pause("keep", timeout_s=30)
    try:
        if swap == "load_weights":
            states = pool.load_weights(str(ckpts["trained"]))
        else:
            trained = ckpts["trained"] / f"model_{weights_cases.STEP:06d}.pt"
            states = pool.update_weights(torch.load(trained, weights_only=True))
        assert len(states) == 2 and {s["weight_version"] for s in states} == {v0 + 1}
    finally:
        pool.resume()
    rows = {(r["prompt_id"], r["sample_index"]): r for r in h.result(timeout_s=120).to_pylist()}
    assert len(rows) == N_PROMPTS * N_SAMPLES
    mixed = 0
    for key, r in rows.items():
        v = r["weight_version"]
        assert len(v) == len(r["tokens"]) and v == sorted(v) and set(v) <= {v0, v0 + 1}
        k = v.count(v0)
        assert r["tokens"][:k] == ref[key]["tokens"][:k]
        assert r["finish_reason"] == "length" and len(r["tokens"]) == len(ref[key]["tokens"])
        mixed += 0 < k < len(v)
    print(f"\n{mixed} samples continued across the swap")
    assert mixed >= 1
    assert all(rows[(f"p{i}", j)]["weight_version"][-1] == v0 + 1 for i in range(N_LONG) for j in range(N_SAMPLES))
    pool.load_weights(str(ckpts["base"]))  # back to `base` for the next test


def test_pause_wait_holds_new_calls_and_pause_abort_ends_open_ones(pool):
    """pause("wait") returns once no unit is on a worker, and a call submitted while paused
    gets nothing until resume(); pause("abort") ends the open call at once, every sample
    present (the long ones "abort"), and the pool serves the next call after resume()."""
    assert pool.pause("wait", timeout_s=30)
    h = pool.submit(_prompts()[:8], SEED)
    with pytest.raises(TimeoutError):
        next(h.results(timeout_s=0.5))  # nothing was dispatched
    never = pool.submit(_prompts()[8:12], SEED)
    assert never.abort(timeout_s=10)  # units no worker got: answered without an engine
    rows = never.result().to_pylist()
    assert len(rows) == 4 * N_SAMPLES and all(r["finish_reason"] == "abort" and r["tokens"] == [] and
                                              r["prompt_tokens"] and r["weight_version"] == [] for r in rows)
    pool.resume()
    assert h.result(timeout_s=120).num_rows == 8 * N_SAMPLES

    h = pool.submit(_prompts(long_tokens=120), SEED)
    next(h.results(timeout_s=120))
    assert pool.pause("abort", timeout_s=10) and h.done()
    rows = h.result().to_pylist()
    assert len({(r["prompt_id"], r["sample_index"]) for r in rows}) == len(rows) == N_PROMPTS * N_SAMPLES
    assert {r["finish_reason"] for r in rows if r["prompt_id"] in {f"p{i}" for i in range(N_LONG)}} == {"abort"}
    pool.resume()
    assert pool.generate(_prompts()[:2], SEED).num_rows == 2 * N_SAMPLES


def test_overlapping_calls_each_get_their_own_rows(pool):
    """Two calls submitted together run side by side and each gets exactly its rows, the
    rows generate() gives for the same prompts."""
    a, b = pool.submit(_prompts()[:8], SEED), pool.submit(_prompts()[8:24], SEED)
    rb, ra = b.result(timeout_s=120), a.result(timeout_s=120)
    assert same_rows(ra) == same_rows(pool.generate(_prompts()[:8], SEED))
    assert rb.column("prompt_id").to_pylist() == [f"p{i}" for i in range(8, 24) for _ in range(N_SAMPLES)]


def test_results_after_a_break_gives_every_group_not_read(pool):
    """A reader that breaks out of results() after one group, then reads the rest (the
    docs' abort loop), gets every other group once, those of the unit it broke in
    included: units of 4 prompts here. (The rest of that unit's groups used to be lost:
    3 of 8 groups.)"""
    h = pool.submit(_prompts()[:8], SEED, unit_rows=4)
    first = []
    for g in h.results(timeout_s=120):
        first.append(g)
        break
    rest = list(h.results(timeout_s=120))
    _check_groups(first + rest, 8 * N_SAMPLES)
    assert h.result().num_rows == 8 * N_SAMPLES


def test_an_interrupted_generate_ends_its_call(pool):
    """A SIGINT (Ctrl-C) while generate() waits: the exception comes through, and the call
    is aborted first, so no call is left on the workers and the next one runs at once. (The
    call used to go on running, and a 1-token call after it waited ~10 s behind it.)"""
    import os
    import signal
    import threading

    class Interrupted(Exception):
        pass

    def raise_interrupted(*_):
        raise Interrupted

    def interrupt() -> None:
        end = time.monotonic() + 60
        while not pool._runner._calls and time.monotonic() < end:  # until the call is queued
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, raise_interrupted)  # not pytest's KeyboardInterrupt
    try:
        sender = threading.Thread(target=interrupt, daemon=True)
        sender.start()
        with pytest.raises(Interrupted):
            pool.generate(_prompts(long_tokens=120), SEED)
        sender.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pool._runner.call(lambda: list(pool._runner._calls)) == []
    assert pool.generate(_prompts()[:2], SEED).num_rows == 2 * N_SAMPLES


def test_abort_replaces_a_stopped_worker_asked_for_unsent_units(pool):
    """While paused ("wait"), a call's units reach no worker; aborting it asks the first ready
    worker for their "abort" rows. That worker stopped (SIGSTOP): it is judged as a swap
    judges a hung worker (start_timeout_s, 5 s here, and no answer to progress()),
    replaced uncharged, and the other answers, so abort() returns with every sample. (It
    used to ask the stopped worker again every round, 60 s each, for ever.)"""
    import os
    import signal

    slots = pool.dispatcher.slots
    timeout = slots.start_timeout_s
    assert pool.pause("wait", timeout_s=30)
    stopped = pool._runner.call(lambda: slots.live()[0].info["pid"])
    try:
        h = pool.submit(_prompts()[:4], SEED)
        os.kill(stopped, signal.SIGSTOP)
        slots.start_timeout_s = 5.0
        assert h.abort(timeout_s=30)
    finally:
        slots.start_timeout_s = timeout
        os.kill(stopped, signal.SIGCONT)  # killed when replaced; the old code's worker answers now
        pool.resume()
    rows = h.result().to_pylist()
    assert len(rows) == 4 * N_SAMPLES and {r["finish_reason"] for r in rows} == {"abort"}
    assert pool.generate(_prompts()[:2], SEED).num_rows == 2 * N_SAMPLES
    assert stopped not in {s["pid"] for s in pool.engine_states()}


def test_calls_submitted_from_several_threads_at_once_each_get_their_own_rows(pool):
    """submit() from 6 threads at once, thread switches forced every microsecond: each call
    gets a call number and unit indices of its own, so each gets exactly its prompts' rows
    (the rows generate() gives for them) and its own fresh-noise seed. Before the pool took
    both under one lock, two calls could share unit indices and receive each other's rows."""
    import sys
    import threading

    slices = [(0, 4), (4, 12), (12, 16), (16, 28), (28, 30), (30, 40)]
    tables = [_prompts()[lo:hi] for lo, hi in slices]
    start = threading.Barrier(len(slices))
    handles: dict[int, object] = {}

    def submit(k: int) -> None:
        start.wait()
        handles[k] = pool.submit(tables[k])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=submit, args=(k,)) for k in range(len(slices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert sorted(handles) == list(range(len(slices))), "a submit raised (see the thread's traceback)"
    results = {k: h.result(timeout_s=120) for k, h in handles.items()}
    seeds = set()
    for k, (lo, hi) in enumerate(slices):
        rows = results[k]
        assert rows.column("prompt_id").to_pylist() == [f"p{i}" for i in range(lo, hi) for _ in range(N_SAMPLES)]
        seed = set(rows.column("seed").to_pylist())
        assert len(seed) == 1
        seeds |= seed
        assert same_rows(rows) == same_rows(pool.generate(_prompts()[lo:hi], {"seed": seed.pop()}))
    assert len(seeds) == len(slices)


def _stop_a_worker_holding_units(pool) -> int:
    """The pid of a worker that holds units of the running call, stopped (SIGSTOP)."""
    import os
    import signal

    pid = pool._runner.call(lambda: [w for w in pool.dispatcher.slots.live() if w.copies][0].info["pid"])
    os.kill(pid, signal.SIGSTOP)
    return pid


def _cont(pid: int) -> None:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGCONT)  # killed when replaced; the old code's worker answers now
    except ProcessLookupError:
        pass


def test_pause_wait_while_keep_holds_returns_at_once(pool):
    """pause("wait") after pause("keep"): the engines hold their samples, idle, so the pause
    holds at once; resume() continues them and the call gets every sample. (It used to
    wait for the held units to finish, which they cannot before resume: never without a
    timeout.)"""
    h = pool.submit(_prompts(long_tokens=120), SEED)
    next(h.results(timeout_s=120))
    try:
        assert pool.pause("keep", timeout_s=30)
        assert pool.pause("wait", timeout_s=5)
    finally:
        pool.resume()
    assert h.result(timeout_s=120).num_rows == N_PROMPTS * N_SAMPLES


def test_pause_wait_replaces_a_stopped_worker_holding_units(pool):
    """During pause("wait") the units on the workers still run, so their deadlines do too: a
    worker stopped (SIGSTOP) while holding units passes the unit deadline (2 s here) and,
    without progress for the suspect timeout (1 s here), is replaced; its units wait in the
    queue, pause("wait") returns, and after resume() the call gets every sample. (Deadlines
    were off during any pause: the stopped worker was never replaced and pause("wait")
    never returned.)"""
    units, slots = pool.dispatcher.units, pool.dispatcher.slots
    h = pool.submit(_prompts(long_tokens=120), SEED)
    next(h.results(timeout_s=120))
    stopped = _stop_a_worker_holding_units(pool)
    try:
        pool._runner.call(lambda: (setattr(units, "unit_timeout_s", 2.0), setattr(slots, "suspect_timeout_s", 1.0)))
        assert pool.pause("wait", timeout_s=30)
    finally:
        pool._runner.call(lambda: (setattr(units, "unit_timeout_s", None), setattr(slots, "suspect_timeout_s", None)))
        _cont(stopped)
        pool.resume()
    assert h.result(timeout_s=120).num_rows == N_PROMPTS * N_SAMPLES
    assert stopped not in {s["pid"] for s in pool.engine_states()}


def test_pause_keep_replaces_a_stopped_worker(pool):
    """pause("keep") with a worker stopped (SIGSTOP) while holding units judges it as a swap
    does (start_timeout_s, 5 s here, and no answer to progress()): it is replaced,
    uncharged, its units queued for resume(), and the call gets every sample. (It used to
    wait 60 s for it, then return True with that worker never paused: once it ran again it
    could take resume_engine before pause_engine and hold its samples for ever.)"""
    slots = pool.dispatcher.slots
    timeout = slots.start_timeout_s
    h = pool.submit(_prompts(long_tokens=120), SEED)
    next(h.results(timeout_s=120))
    stopped = _stop_a_worker_holding_units(pool)
    try:
        slots.start_timeout_s = 5.0
        assert pool.pause("keep", timeout_s=30)
        assert stopped not in pool._runner.call(lambda: [w.info["pid"] for w in slots.live()])
    finally:
        slots.start_timeout_s = timeout
        _cont(stopped)
        pool.resume()
    assert h.result(timeout_s=120).num_rows == N_PROMPTS * N_SAMPLES


def test_submit_and_abort_do_not_wait_behind_a_long_swap(pool, ckpts, monkeypatch):
    """While a weights swap waits on a stopped worker (start_timeout_s, 4 s here, then no
    answer to progress()), submit() returns at once and abort(timeout_s=1) returns False
    after about 1 s, its abort still under way; once the swap is done the call ends with
    every sample "abort". (Both used to wait for the whole swap.)"""
    import os
    import signal
    import threading

    slots = pool.dispatcher.slots
    timeout = slots.start_timeout_s
    started = threading.Event()
    swap = pool.dispatcher.load_weights
    monkeypatch.setattr(pool.dispatcher, "load_weights", lambda *a, **k: (started.set(), swap(*a, **k))[1])
    stopped = pool.engine_states()[0]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    swapping = threading.Thread(target=pool.load_weights, args=(str(ckpts["base"]),), daemon=True)
    try:
        slots.start_timeout_s = 4.0
        swapping.start()
        assert started.wait(30)
        t = time.monotonic()
        h = pool.submit(_prompts()[:8], SEED)
        assert time.monotonic() - t < 1.0
        assert not h.abort(timeout_s=1)
        assert time.monotonic() - t < 3.0
        swapping.join(120)
    finally:
        slots.start_timeout_s = timeout
        _cont(stopped)
    assert not swapping.is_alive()
    assert h.abort(timeout_s=30)
    rows = h.result().to_pylist()
    assert len(rows) == 8 * N_SAMPLES and {r["finish_reason"] for r in rows} == {"abort"}
    assert stopped not in {s["pid"] for s in pool.engine_states()}
