"""cluster/ (worker, pool) and jobs.runner on a real local Ray instance (one per module).

The jobs are tiny (demo model, a few prompts, max_tokens 4) so the module stays fast on
2 cores; most of its time is Ray and worker start-up (each worker imports torch).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

from cluster.dispatcher import run_units  # noqa: E402
from cluster.unit import UnitFailed, UnitRequest, UnitResult, WorkUnit  # noqa: E402
from cluster.worker import GenerationWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ shared helpers

def write_inputs(d: Path, sizes=(7, 5)) -> Path:
    """Two Parquet files (a multi-file input) with ids, a passthrough column and one null prompt."""
    d.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(sizes):
        prompts = [f"Question {k}.{i}: what is {i} + {k}?" for i in range(n)]
        if k == 0:
            prompts[2] = None  # an error row, never an exception
        pq.write_table(pa.table({"id": [f"f{k}-{i:03d}" for i in range(n)], "prompt": prompts,
                                 "extra": list(range(n))}), d / f"part-{k}.parquet")
    return d


def make_spec(inp: Path, out: Path, num_workers: int = 1, **sampling):
    from jobs.spec import JobSpec

    return JobSpec.from_dict({
        "model": {"path": "tiny-random", "max_num_seqs": 32},
        "input": {"path": str(inp), "format": "text", "column": "prompt", "id_column": "id",
                  "passthrough": ["extra"]},
        "output": {"path": str(out)},
        "sampling": {"num_samples": 2, "max_tokens": 4, "temperature": 1.0, "top_k": 0, "seed": 7, **sampling},
        "cluster": {"num_workers": num_workers, "cpus_per_worker": 1, "unit_rows": 3, "max_unit_attempts": 3},
    })


def read_dataset(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("part-*.parquet")):
        rows.extend(pq.read_table(f).to_pylist())
    return sorted(rows, key=lambda r: (r["prompt_id"], r["sample_index"]))


def assert_same_dataset(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    assert [(r["prompt_id"], r["sample_index"]) for r in a] == [(r["prompt_id"], r["sample_index"]) for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k == "logprobs":  # batch composition may move the last float bits
                assert x[k] == pytest.approx(y[k], abs=1e-3), (x["prompt_id"], k)
            else:
                assert x[k] == y[k], (x["prompt_id"], x["sample_index"], k)


# ------------------------------------------------------------------ fakes (no torch in the worker)
# Pickled by value so that a worker unpickling them imports neither this module nor torch.

@dataclass
class FakeOut:
    request_id: object
    prompt_id: str
    prompt_tokens: list
    samples: list


class FakeTokenizer:
    vocab_size = 256

    def encode(self, s):
        return list(s.encode())

    def decode(self, t):
        return bytes(t).decode(errors="replace")


class FakeEngine:
    """Finishes one request per step; a request's 'sample' is its reversed prompt. A step
    takes `step_s` (work, not synchronisation) and raises on prompt `poison` (a CUDA error).
    A checkpoint "swaps in" by its name only (stage_weights, apply_weights)."""

    def __init__(self, dtype=None, step_s=0.0, poison=None):
        self.tokenizer = FakeTokenizer()
        if dtype is not None:
            self.dtype = dtype
        self.q = []
        self.num_generated_tokens = 0
        self.step_s, self.poison = step_s, poison

    def add_request(self, prompt_tokens, params, prompt_id, request_id=None):
        self.q.append((request_id, prompt_id, list(prompt_tokens)))

    def has_unfinished_requests(self):
        return bool(self.q)

    def step(self):
        if self.step_s:
            time.sleep(self.step_s)
        rid, pid, toks = self.q.pop(0)
        if self.poison is not None and bytes(toks) == self.poison.encode():
            raise RuntimeError("CUDA error: device-side assert triggered")
        self.num_generated_tokens += len(toks)
        return [FakeOut(rid, pid, toks, [toks[::-1]])]

    def stage_weights(self, path, step=None):
        if step is None and path.startswith("saving:"):  # a trainer saving steps 1, 2, ...: each
            for n in itertools.count(1):                  # call finds one step newer than the last
                try:
                    os.close(os.open(os.path.join(path[len("saving:"):], str(n)), os.O_CREAT | os.O_EXCL))
                    step = n
                    break
                except FileExistsError:
                    continue
        return FakeStaged(path, step)

    def apply_weights(self, staged, version=None):
        return {"path": staged.path, "step": staged.step, "description": "fake", "weight_version": version}


@dataclass
class FakeStaged:
    path: str
    step: int | None
    description: str = "fake"


@dataclass
class FakeParams:
    num_samples: int = 1
    seed: int = 0


@dataclass
class FakeTask:
    """Units over an in-memory list of prompts; writes part-<index>.txt atomically.

    fail: unit index -> "once" (fails its first attempt; a marker file records it),
    "always" (read_unit raises). broken_engine: the worker's engine cannot load (True), or
    only in the first worker that tries ("once"). poison_first_worker: every unit fails in
    the first worker process that reads one (its pid is recorded in a marker file).
    hang_unit: the first read of this unit hangs (a stuck filesystem) for 120 s.
    gate: unit index -> a FIFO the unit's read waits on until the test writes a byte to it
    (the test holds the FIFO open read-write, so the worker's open never blocks).
    poison_prompt: the engine raises when it steps this prompt; step_s: seconds per step.
    """

    out_dir: str
    prompts: list
    fail: dict = field(default_factory=dict)
    broken_engine: object = False
    poison_first_worker: bool = False
    hang_unit: int | None = None
    first_dtype: str | None = None  # the first worker's engine reports this dtype, later ones "float32"
    gate: dict = field(default_factory=dict)
    poison_prompt: str | None = None
    step_s: float = 0.0
    engine_kwargs: dict = field(default_factory=dict)
    params: FakeParams = field(default_factory=FakeParams)

    def _first(self, name):
        """True in the first process to ask (atomic: O_EXCL), and forever in that process."""
        marker = os.path.join(self.out_dir, name)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
        except FileExistsError:
            return open(marker).read() == str(os.getpid())

    def load_engine(self):
        if self.broken_engine is True or (self.broken_engine == "once" and self._first("broken-engine")):
            raise FileNotFoundError("checkpoint /nowhere/model.pt not found")
        if self.first_dtype is not None:
            return FakeEngine(self.first_dtype if self._first("dtype") else "float32")
        return FakeEngine(step_s=self.step_s, poison=self.poison_prompt)

    def read_unit(self, unit, tokenizer):
        if self.poison_first_worker and self._first("poisoned"):
            raise OSError(f"stale NFS handle (unit {unit.index})")
        if unit.index == self.hang_unit and self._first("hung"):
            threading.Event().wait(120)  # a hang, not a synchronisation: the test never waits for it
        if unit.index in self.gate:
            fd = os.open(self.gate[unit.index], os.O_RDONLY)
            try:
                os.read(fd, 1)  # until the test opens the gate
            finally:
                os.close(fd)
        mode = self.fail.get(unit.index)
        marker = os.path.join(self.out_dir, f"failed-{unit.index}")
        if mode == "always" or (mode == "once" and not os.path.exists(marker)):
            open(marker, "w").close()
            raise ValueError(f"cannot read unit {unit.index}")
        return [UnitRequest(prompt_id=str(unit.row_start + i), prompt_tokens=tokenizer.encode(p))
                for i, p in enumerate(self.prompts[unit.row_start:unit.row_end])]

    def write_unit(self, unit, requests, outputs, tokenizer):
        text = "\n".join(f"{o.prompt_id}\t{tokenizer.decode(o.samples[0])}" for o in outputs)
        path = os.path.join(self.out_dir, f"part-{unit.index}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        return UnitResult(index=unit.index, path=path, prompts=len(requests), rows=len(outputs))


def _by_value():
    import ray.cloudpickle as cp

    cp.register_pickle_by_value(sys.modules[__name__])


def fake_units(n_prompts: int, unit_rows: int) -> list[WorkUnit]:
    return [WorkUnit(i, "mem", a, min(a + unit_rows, n_prompts)) for i, a in enumerate(range(0, n_prompts, unit_rows))]


def fifo_gate(path: Path) -> int:
    """A FIFO for FakeTask.gate, held open read-write by the test (so that a worker's
    read-only open returns at once); os.write(fd, b"x") opens the gate for one read."""
    os.mkfifo(path)
    return os.open(path, os.O_RDWR)


# ------------------------------------------------------------------ worker, directly (no Ray)

def test_worker_takes_a_second_unit_while_the_first_is_in_flight(tmp_path):
    """A unit boundary does not drain the engine: unit 1's prompts join the running batch
    while unit 0 still decodes, and both units come out complete and committed."""
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job
    from jobs.task import JobTask

    spec = make_spec(write_inputs(tmp_path / "in"), tmp_path / "out", max_tokens=8)
    plan = plan_job(spec)
    OutputDir(spec.output.path).prepare(plan, spec)
    w = GenerationWorker(JobTask(spec, plan), "w0", num_threads=1)
    eng = w.engine
    log: list[set[int]] = []  # units with unfinished requests at each step
    active: dict[tuple, int] = {}
    unit0_in = threading.Event()
    real_add, real_step = eng.add_request, eng.step

    def add_request(tokens, params, prompt_id, request_id=None):
        active[request_id] = request_id[0]
        real_add(tokens, params, prompt_id, request_id=request_id)
        if request_id[0] == 0:
            unit0_in.set()

    def step():
        log.append(set(active.values()))
        outs = real_step()
        for o in outs:
            active.pop(o.request_id, None)
        return outs

    eng.add_request, eng.step = add_request, step
    u0, u1 = plan.units[0], plan.units[1]
    results = {}
    t0 = threading.Thread(target=lambda: results.__setitem__(0, w.run_unit(u0)))
    t0.start()
    assert unit0_in.wait(60)
    t1 = threading.Thread(target=lambda: results.__setitem__(1, w.run_unit(u1)))
    t1.start()
    t0.join(120)
    t1.join(120)
    assert set(results) == {0, 1}
    assert any(s == {0, 1} for s in log), "unit 1 never ran alongside unit 0"
    assert not any(s == set() for s in log)  # the loop never stepped an empty engine
    assert results[0].rows == u0.num_rows * 2 and results[1].rows == u1.num_rows * 2
    p = w.progress()
    assert p["finished_units"] == 2 and p["generated_tokens"] > 0 and p["active_units"] == 0
    assert OutputDir(spec.output.path).committed_units() == {0, 1}
    w.shutdown()


def test_worker_engine_failure_fails_the_units_and_breaks_the_worker(tmp_path):
    """An engine exception fails the unit (no hang), and the worker never builds a second
    engine in the same process: it drops the first and refuses further units, so that the
    driver replaces the process (see test_faults for the replacement on Ray)."""
    from cluster.worker import EngineLoopError

    task = FakeTask(str(tmp_path), ["boom", "ok"])
    w = GenerationWorker(task, "w0")

    def bad_step():
        raise RuntimeError("CUDA error: device-side assert")

    w.engine.step = bad_step
    with pytest.raises(EngineLoopError, match="device-side assert"):
        w.run_unit(WorkUnit(0, "mem", 0, 2))
    assert w.engine is None and "device-side assert" in w.progress()["broken"]
    with pytest.raises(EngineLoopError, match="engine failed earlier"):
        w.run_unit(WorkUnit(1, "mem", 0, 2))
    assert not (tmp_path / "part-1.txt").exists()
    w.shutdown()


# ------------------------------------------------------------------ pool (Ray, fake task)

def test_pool_dispatch_retry_and_failures(ray_local, tmp_path):
    _by_value()
    prompts = [f"prompt {i}" for i in range(23)]
    units = fake_units(len(prompts), 3)
    seen = []
    progress = []
    res = run_units(FakeTask(str(tmp_path), prompts, fail={2: "once"}), units, num_workers=2, num_cpus=1,
                    num_gpus=0, max_unit_attempts=2, on_result=seen.append, on_progress=progress.append,
                    progress_interval_s=0.05)
    assert sorted(r.index for r in res) == list(range(len(units))) == sorted(r.index for r in seen)
    assert all(r.worker.startswith("worker-") for r in res)
    assert os.path.exists(tmp_path / "failed-2")  # unit 2 failed once, then succeeded
    lines = [ln for u in units for ln in (tmp_path / f"part-{u.index}.txt").read_text().splitlines()]
    assert lines == [f"{i}\t{p[::-1]}" for i, p in enumerate(prompts)]
    assert progress and progress[-1]["generated_tokens"] > 0

    # a unit that keeps failing fails the run, naming the unit and the error
    t = time.time()
    with pytest.raises(UnitFailed, match=r"unit 1 \(mem rows 3-6\) failed 2 times.*cannot read unit 1"):
        run_units(FakeTask(str(tmp_path), prompts, fail={1: "always"}), units, num_workers=2, num_cpus=1,
                  num_gpus=0, max_unit_attempts=2, on_result=None, on_progress=None)
    # a worker that cannot load its model is started again; the run fails once every slot
    # failed 3 starts in a row, with the load error
    with pytest.raises(UnitFailed, match=r"workers keep failing to start \(3 attempts in a row for each of 2 worker "
                                         r"slot\(s\)\); last error: worker worker-\d+ could not start: "
                                         r"FileNotFoundError: checkpoint /nowhere/model.pt not found"):
        run_units(FakeTask(str(tmp_path), prompts, broken_engine=True), units, num_workers=2, num_cpus=1,
                  num_gpus=0, max_unit_attempts=3, on_result=None, on_progress=None)
    assert time.time() - t < 240


def test_workers_resolving_dtype_auto_differently_are_refused(ray_local, tmp_path):
    """With model dtype "auto" each worker's engine resolves it for its own GPU; the first
    ready worker binds the run, and a worker that resolved another dtype (an older GPU) is
    refused by name: the run's rows never mix dtypes, and the units still all run."""
    _by_value()
    from cluster.dispatcher import UnitDispatcher

    prompts = [f"prompt {i}" for i in range(8)]
    task = FakeTask(str(tmp_path), prompts, first_dtype="bfloat16", engine_kwargs={"dtype": "auto"})
    recorded = []  # the job runner records the binding in the output's manifest (jobs/runner.py)
    with UnitDispatcher(task, num_workers=2, num_cpus=1, max_start_failures=2, on_auto_dtype=recorded.append) as d:
        assert d.wait_ready() >= 1  # both slots started (and retried) before any unit runs
        res = d.run(fake_units(len(prompts), 2))
        assert sorted(r.index for r in res) == list(range(4))
        bound = d.auto_dtype  # whichever engine was ready first: bfloat16 (the first loaded) or float32
    assert recorded == [bound]
    other = {"bfloat16": "float32", "float32": "bfloat16"}[bound]
    refused = [detail for _, kind, detail in d.events if f"resolved model.dtype auto to {other}" in detail]
    assert refused and f"this run's workers use {bound}: set model.dtype" in refused[0]


def test_dispatcher_runs_several_batches_on_the_same_workers(ray_local, tmp_path):
    """Started once, several runs: the workers (and their engines) live across runs, and a
    failed start (the first constructor raises) is retried without failing anything."""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = [f"prompt {i}" for i in range(12)]
    units = fake_units(len(prompts), 2)
    task = FakeTask(str(tmp_path), prompts, broken_engine="once")
    with UnitDispatcher(task, num_workers=2, num_cpus=1) as pool:
        assert pool.wait_ready() == 2
        first = pool.run(units[:3])
        names = sorted(w["name"] for w in pool.workers())
        second = pool.run(units[3:])
        assert sorted(w["name"] for w in pool.workers()) == names  # no new workers for the second run
        assert all(w["state"] == "ready" for w in pool.workers())
        kinds = [k for _, k, _ in pool.events]
    assert sorted(r.index for r in first) == [0, 1, 2] and sorted(r.index for r in second) == [3, 4, 5]
    assert kinds.count("start") == 3 and kinds.count("ready") == 2  # one constructor failed and was retried
    assert any(k == "replaced" and "could not start: FileNotFoundError" in d for _, k, d in pool.events)
    lines = [ln for u in units for ln in (tmp_path / f"part-{u.index}.txt").read_text().splitlines()]
    assert lines == [f"{i}\t{p[::-1]}" for i, p in enumerate(prompts)]


def test_a_worker_that_fails_every_unit_is_replaced(ray_local, tmp_path):
    """One worker fails each unit it reads (say a broken mount on its node): after 3 in a
    row it is replaced, its units are retried on the other worker, and the run completes
    without any unit reaching max_unit_attempts."""
    _by_value()
    prompts = [f"prompt {i}" for i in range(16)]
    units = fake_units(len(prompts), 2)
    from cluster.dispatcher import UnitDispatcher

    with UnitDispatcher(FakeTask(str(tmp_path), prompts, poison_first_worker=True), num_workers=2, num_cpus=1,
                        max_unit_attempts=3) as pool:
        res = pool.run(units)
        events = list(pool.events)
    assert sorted(r.index for r in res) == list(range(len(units)))
    replaced = [d for _, k, d in events if k == "replaced"]
    assert len(replaced) == 1 and "3 units failed in a row on it" in replaced[0], replaced
    # the third failure in a row replaces it; a unit it held beside that one (2 in flight per
    # worker) may fail too before the replacement lands
    assert 3 <= sum(k == "unit_failed" for _, k, _ in events) <= 3 + 1
    assert all("stale NFS handle" in d for _, k, d in events if k == "unit_failed")


def test_overdue_unit_gets_a_second_copy_and_the_first_commit_wins(ray_local, tmp_path):
    """A unit whose read hangs on one worker passes unit_timeout_s: a second copy runs on
    the other worker and commits; the run completes with every unit once, without waiting
    for the hung copy."""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = [f"prompt {i}" for i in range(12)]
    units = fake_units(len(prompts), 2)
    t = time.time()
    with UnitDispatcher(FakeTask(str(tmp_path), prompts, hang_unit=2), num_workers=2, num_cpus=1,
                        unit_timeout_s=3) as pool:
        res = pool.run(units)
        events = [(k, d) for _, k, d in pool.events]
    assert time.time() - t < 100  # well before the 120 s hang ends
    hung_on = open(tmp_path / "hung").read()
    overdue = [d for k, d in events if k == "overdue" and d.startswith("unit 2 on ")]
    assert overdue and any(k == "hedge" and d.startswith("unit 2 second copy on ") for k, d in events), events
    assert sorted(r.index for r in res) == list(range(len(units)))  # each unit reported once
    assert [r.index for r in res].count(2) == 1 and hung_on  # the copy that committed is not the hung one
    lines = [ln for u in units for ln in (tmp_path / f"part-{u.index}.txt").read_text().splitlines()]
    assert lines == [f"{i}\t{p[::-1]}" for i, p in enumerate(prompts)]


def test_a_unit_stuck_beside_busy_units_on_the_only_worker_is_run_again(ray_local, tmp_path):
    """One worker; unit 0's read hangs (a stuck filesystem) and unit 1's read waits at a gate.
    Both pass unit_timeout_s; no other worker can take a second copy. The gate opens once
    the worker is suspect, so unit 1 commits on it: that proves nothing about unit 0, and
    the worker stays suspect (no new units, no "alive") until unit 0 has shown no progress
    of its own for suspect_timeout_s; then it is replaced and unit 0 runs again on the fresh
    worker, long before its hang ends. (Before, unit 1's commit made the worker ready again,
    its overdue unit 0 was never looked at again, and the run waited out the 120 s hang.)"""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = [f"prompt {i}" for i in range(8)]
    gate = fifo_gate(tmp_path / "gate")
    opened: list[str] = []
    pool = UnitDispatcher(FakeTask(str(tmp_path), prompts, hang_unit=0, gate={1: str(tmp_path / "gate")}),
                          num_workers=1, num_cpus=1, unit_timeout_s=1, suspect_timeout_s=3)

    def watchdog():
        if not opened:
            suspect = [w["name"] for w in pool.workers() if w["state"] == "suspect"]
            if suspect:
                opened.append(suspect[0])
                os.write(gate, b"x")
        if time.monotonic() - t0 > 30:  # a bound for the test, not a wait: the fix needs about 6 s
            raise TimeoutError("the run is waiting for the stuck unit 0")

    try:
        with pool:
            pool.wait_ready()
            t0 = time.monotonic()
            res = pool.run(fake_units(len(prompts), 2), watchdog=watchdog)
            events = [(k, d) for _, k, d in pool.events]
    finally:
        os.close(gate)
    first = opened[0]
    assert sorted(r.index for r in res) == [0, 1, 2, 3]
    assert {r.index: r.worker for r in res}[1] == first  # unit 1 committed on the suspect worker ...
    assert ("alive", first) not in events  # ... which stayed suspect for its stuck unit 0
    replaced = [d for k, d in events if k == "replaced"]
    assert replaced == [f"{first}: stalled: no progress within 3s after unit(s) [0] passed the deadline of 1s"], events
    assert {r.index: r.worker for r in res}[0] != first
    lines = [ln for u in fake_units(len(prompts), 2) for ln in (tmp_path / f"part-{u.index}.txt").read_text().splitlines()]
    assert lines == [f"{i}\t{p[::-1]}" for i, p in enumerate(prompts)]


def test_a_slow_unit_that_progresses_keeps_its_worker(ray_local, tmp_path):
    """A unit generating slowly (its engine steps go on) passes unit_timeout_s on the only
    worker: the steps are progress of that unit's own, so the worker is "alive" and is not
    replaced, and the unit commits there (the counterpart of the stuck unit above). (Before,
    the run loop slept past the pings a suspect timeout this short needs, and replaced it.)"""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = [f"prompt {i}" for i in range(40)]  # one unit of 40 steps of 0.1 s
    with UnitDispatcher(FakeTask(str(tmp_path), prompts, step_s=0.1), num_workers=1, num_cpus=1,
                        unit_timeout_s=1, suspect_timeout_s=2) as pool:
        pool.wait_ready()
        res = pool.run(fake_units(len(prompts), len(prompts)))
        events = [(k, d) for _, k, d in pool.events]
    name = res[0].worker
    assert ("suspect", name) in events and ("alive", name) in events, events
    assert not [d for k, d in events if k == "replaced"], events


def test_a_broken_engine_on_a_units_last_attempt_is_replaced(ray_local, tmp_path):
    """The engine raises on unit 0 (max_unit_attempts 1): the run fails naming it, and the
    broken worker is replaced all the same, so the next run's healthy units run on a fresh
    worker. (Before, the unit's last charge raised before the replacement: the broken
    worker stayed ready and failed the next run's units with "engine failed earlier".)"""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = ["boom"] + [f"prompt {i}" for i in range(1, 5)]
    with UnitDispatcher(FakeTask(str(tmp_path), prompts, poison_prompt="boom"), num_workers=1, num_cpus=1,
                        max_unit_attempts=1) as pool:
        pool.wait_ready()
        with pytest.raises(UnitFailed, match=r"unit 0 .* failed 1 times .*engine failed while running unit 0"):
            pool.run([WorkUnit(0, "mem", 0, 1)])
        assert pool.workers() == []  # its slot is refilled by the next run
        res = pool.run([WorkUnit(i, "mem", i, i + 1) for i in range(1, 5)])
        events = [(k, d) for _, k, d in pool.events]
    assert sorted(r.index for r in res) == [1, 2, 3, 4]
    assert [d for k, d in events if k == "replaced"] == [
        "worker-0: its engine failed: worker worker-0: engine failed while running unit 0: "
        "RuntimeError('CUDA error: device-side assert triggered')"]


def test_a_broken_engine_on_a_settled_units_copy_is_replaced(ray_local, tmp_path):
    """The engine breaks on a copy whose unit is settled already (its call ended: unit 0
    failed, and RolloutRunner forgets the call's units): the worker is replaced all the
    same. (Before, a settled copy's error was ignored whole, and the broken worker stayed
    ready.) Driven as cluster/rollout.py drives a dispatcher: add_units, advance, forget."""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    gate = fifo_gate(tmp_path / "gate")
    task = FakeTask(str(tmp_path), ["a", "boom"], fail={0: "always"}, poison_prompt="boom",
                    gate={1: str(tmp_path / "gate")})
    pool = UnitDispatcher(task, num_workers=1, num_cpus=1, max_unit_attempts=1)
    try:
        pool.wait_ready()
        pool.add_units([WorkUnit(0, "mem", 0, 1), WorkUnit(1, "mem", 1, 2)])  # both on the worker at once
        end = time.monotonic() + 20
        with pytest.raises(UnitFailed, match="cannot read unit 0"):
            while time.monotonic() < end:
                pool.advance(lambda r: None, 0.5)
        assert pool.workers()[0]["units"] == [1]
        pool.units.forget([0, 1])  # the call ended
        os.write(gate, b"x")  # unit 1 reads on, and the engine breaks on its prompt
        end = time.monotonic() + 10
        while not any(k == "replaced" for _, k, _ in pool.events):
            assert time.monotonic() < end, "the broken worker was kept"
            pool.advance(lambda r: None, 0.5)
        replaced = [d for _, k, d in pool.events if k == "replaced"]
        assert len(replaced) == 1 and "its engine failed" in replaced[0] and "device-side assert" in replaced[0]
    finally:
        pool.close()
        os.close(gate)


def test_a_slot_ray_cannot_place_does_not_hold_wait_ready(ray_local, tmp_path):
    """Three one-CPU workers on the 2-CPU Ray instance: Ray can never place the third. Once
    start_timeout_s passes its start counts as failed (its slot starts another), and
    wait_ready, the GenerationPool constructor's and each weights swap's wait, returns with
    the ready workers instead of waiting for ever; a later wait_ready does not wait for that
    slot again. A weights swap restarts a still-starting worker after the swap (it was
    created with the old weights), and runs use the ready workers. (Before, only a run with
    no worker at all ever timed out: wait_ready never returned.)"""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    prompts = [f"prompt {i}" for i in range(8)]
    # 8 s: a fake worker is ready in 1-3 s on 2 busy cores; one slower than that only makes
    # its slot late too (this test then sees one ready worker, not two)
    pool = UnitDispatcher(FakeTask(str(tmp_path), prompts), num_workers=3, num_cpus=1, start_timeout_s=8)
    got: list[int] = []

    def late():
        return [d for _, k, d in pool.events if k == "replaced" and "was not ready within 8s" in d]

    def starting():
        return [w["slot"] for w in pool.workers() if w["state"] == "starting"]

    try:
        waiter = threading.Thread(target=lambda: got.append(pool.wait_ready()), daemon=True)
        waiter.start()
        waiter.join(40)  # a bound for the test: the fix returns after about 8 s
        assert not waiter.is_alive(), "wait_ready() is still waiting for the slot Ray cannot place"
        # (the books change only inside the dispatcher's calls: these reads agree with each other)
        assert got and got[0] >= 1 and got[0] + len(starting()) == 3, list(pool.events)
        assert len(late()) >= len(starting()) >= 1  # each still-starting slot's start timed out
        before = len(late())
        assert pool.wait_ready() == got[0]  # at once: no second start timeout is waited for
        assert len(late()) == before
        states = pool.load_weights("ckpt-2")
        assert len(states) == got[0] and all(s["weights"]["path"] == "ckpt-2" for s in states)
        kinds = [(k, d) for _, k, d in pool.events]
        swapped = kinds.index(("weights", "ckpt-2 (step None)"))
        assert any(k == "replaced" and "the pool's weights are swapped" in d for k, d in kinds[:swapped]), kinds
        assert starting()
        for slot in starting():  # started again after the swap: with its weights
            assert any(k == "start" and d.endswith(f"in slot {slot}") for k, d in kinds[swapped:]), kinds
        res = pool.run(fake_units(len(prompts), 2))
        assert sorted(r.index for r in res) == [0, 1, 2, 3]
    finally:
        pool.close()


def test_workers_that_find_different_newest_steps_all_load_the_newest(ray_local, tmp_path):
    """load_weights(path) without a step: each worker takes the newest step it finds, and a
    trainer saving meanwhile makes them find different ones (here the fake's listing finds a
    newer step at every call). The pool stages the newest of them everywhere: every worker
    holds the same step, the one the pool records. (Before, each swapped in its own.)"""
    from cluster.dispatcher import UnitDispatcher

    _by_value()
    with UnitDispatcher(FakeTask(str(tmp_path), ["a"]), num_workers=2, num_cpus=1) as pool:
        assert pool.wait_ready() == 2
        states = pool.load_weights(f"saving:{tmp_path}")
        assert [s["weights"]["step"] for s in states] == [2, 2]
        assert pool.weights.step == 2


def test_no_node_can_host_a_worker(ray_local, tmp_path):
    """Workers needing a resource no alive node has: a local Ray instance fails the run in
    seconds saying so; where an autoscaler may add nodes the progress report says the run
    is waiting for nodes (and start_timeout_s still bounds the wait)."""
    _by_value()
    units = fake_units(4, 2)
    task = FakeTask(str(tmp_path), ["a", "b", "c", "d"])
    t = time.time()
    with pytest.raises(UnitFailed, match=r"no Ray node can host a worker: none of the 1 alive Ray nodes has the "
                                         r"resources of one worker \(CPU 1, tpu_v9 1\)"):
        run_units(task, units, num_workers=1, actor_options={"resources": {"tpu_v9": 1}})
    assert time.time() - t < 30
    reports = []
    with pytest.raises(UnitFailed, match=r"no worker became ready within 3s .*waiting|no worker became ready within 3s"):
        run_units(task, units, num_workers=1, actor_options={"resources": {"tpu_v9": 1}}, may_add_nodes=True,
                  start_timeout_s=3, on_progress=reports.append, progress_interval_s=0.2)
    assert reports and "none of the 1 alive Ray nodes" in reports[-1]["waiting_for_nodes"]


# ------------------------------------------------------------------ run_job end to end

def test_run_job_one_and_two_workers_resume_and_fingerprint(ray_local, tmp_path, capsys):
    from jobs.errors import OutputError
    from jobs.outputs.output_dir import OutputDir
    from jobs.runner import run_job

    inp = write_inputs(tmp_path / "in")
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_job(make_spec(inp, one, num_workers=1)) == 0
    assert run_job(make_spec(inp, two, num_workers=2)) == 0
    a, b = read_dataset(one), read_dataset(two)
    assert len(a) == 12 * 2
    assert_same_dataset(a, b)
    assert sum(r["finish_reason"] == "error" for r in a) == 2  # the null prompt, both samples
    for out in (one, two):
        od = OutputDir(str(out))
        assert od.verify() == []
        st = od.status()
        assert st["success"] and st["units_done"] == st["units_total"] == 5 and st["rows"] == 24
    assert "samples (rows):   24" in capsys.readouterr().out

    # rerun: a no-op resume (no unit runs again, files untouched)
    before = {f.name: f.stat().st_mtime_ns for f in one.glob("part-*.parquet")}
    assert run_job(make_spec(inp, one, num_workers=1)) == 0
    assert {f.name: f.stat().st_mtime_ns for f in one.glob("part-*.parquet")} == before
    assert OutputDir(str(one)).status()["summary"]["units_this_run"] == 0

    # another job's output: refused (exit code 2) before any work, unless overwrite
    with pytest.raises(OutputError, match="another job") as e:
        run_job(make_spec(inp, one, seed=8))
    assert e.value.exit_code == 2
    assert {f.name: f.stat().st_mtime_ns for f in one.glob("part-*.parquet")} == before
    assert run_job(make_spec(inp, one, num_workers=2, seed=8), overwrite=True) == 0
    assert OutputDir(str(one)).verify() == []
    c = read_dataset(one)
    assert len(c) == 24 and [r["tokens"] for r in c] != [r["tokens"] for r in a]


# ------------------------------------------------------------------ submit (mocked job server)

def test_submit_leaves_out_what_git_ignores(tmp_path, monkeypatch):
    """`submit` ships the project directory as Ray's working_dir, and Ray leaves out what
    .gitignore files name but not .git/info/exclude (nor the user's global excludes): a large
    folder ignored there once pushed the upload past the job server's 100 MB. `git_ignored`
    lists all of git's ignored paths, anchored at the root (directories whole, untracked but
    unignored files kept); nothing outside a git checkout or with Ray's switch to ship them;
    submit_job adds them to the excludes, except a path that holds the config itself."""
    from jobs import submit
    from jobs.submit import git_ignored, submit_job

    repo = tmp_path / "repo"
    (repo / "big" / "sub").mkdir(parents=True)
    (repo / "big" / "sub" / "weights.bin").write_bytes(b"x")
    (repo / "notes.tmp").write_text("x")
    (repo / "keep.py").write_text("x")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("*.tmp\n")
    (repo / ".git" / "info" / "exclude").write_text("/big/\n")
    assert sorted(git_ignored(repo)) == ["/big", "/notes.tmp"]
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    assert git_ignored(repo) == []
    monkeypatch.delenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE")
    assert git_ignored(tmp_path) == []  # not a checkout

    class FakeClient:
        def submit_job(self, **kw):
            self.kw = kw
            return "raysubmit_1"

    monkeypatch.setattr(submit, "git_ignored", lambda root: ["/.dev", "/configs", "/configs-old"])
    client = FakeClient()
    assert submit_job(str(ROOT / "configs/demo.yaml"), "http://head:8265", [], client=client) == 0
    excludes = client.kw["runtime_env"]["excludes"]
    assert "/.dev" in excludes and "/configs-old" in excludes and "/configs" not in excludes


def test_submit_job_with_a_mocked_client(tmp_path, monkeypatch, capsys):
    import ray.job_submission

    from jobs.cli import main
    from jobs.errors import JobError, SpecError
    from jobs.submit import submit_job

    calls = []

    class FakeClient:
        def __init__(self, address):
            calls.append(("init", address))

        def submit_job(self, **kw):
            calls.append(("submit", kw))
            return "raysubmit_123"

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", FakeClient)
    assert main(["submit", str(ROOT / "configs/demo.yaml"), "--address", "http://head:8265",
                 "--set", "sampling.max_tokens=8"]) == 0
    (_, addr), (_, kw) = calls
    assert addr == "http://head:8265"
    assert kw["entrypoint"] == ("python -m jobs.cli run configs/demo.yaml --set sampling.max_tokens=8 "
                                "--set cluster.address=auto")
    env = kw["runtime_env"]
    assert env["working_dir"] == str(ROOT) and ".git" in env["excludes"] and "/out/demo" in env["excludes"]  # anchored
    printed = capsys.readouterr().out
    assert "raysubmit_123" in printed and "ray job logs --follow raysubmit_123 --address http://head:8265" in printed

    # a bad config fails (exit 2) before anything is submitted
    calls.clear()
    assert main(["submit", str(ROOT / "configs/demo.yaml"), "--address", "http://head:8265", "--set", "sampling.nope=1"]) == 2
    outside = tmp_path / "job.yaml"
    outside.write_text((ROOT / "configs/demo.yaml").read_text())
    with pytest.raises(SpecError, match="inside"):
        submit_job(str(outside), "http://head:8265", [])
    assert calls == []

    # an unreachable job server: one clear line and a hint, exit 1, no traceback
    class Unreachable:
        def submit_job(self, **kw):
            raise ConnectionError("Failed to connect to Ray at address: http://head:8265.")

    with pytest.raises(JobError, match=r"(?s)cannot submit to the Ray job server at http://head:8265: "
                                       r"ConnectionError: Failed to connect.*dashboard port") as e:
        submit_job(str(ROOT / "configs/demo.yaml"), "http://head:8265", [], client=Unreachable())
    assert e.value.exit_code == 1

    # a head whose job agent is not up yet (just started): the submission is retried
    class AgentStarting:
        tries = 0

        def submit_job(self, **kw):
            AgentStarting.tries += 1
            if AgentStarting.tries < 3:
                raise RuntimeError("Request failed with status code 500: No available agent to submit job, "
                                   "please try again later..")
            return "raysubmit_456"

    monkeypatch.setattr("jobs.submit.time.sleep", lambda s: None)
    assert submit_job(str(ROOT / "configs/demo.yaml"), "http://head:8265", [], client=AgentStarting()) == 0
    assert AgentStarting.tries == 3
