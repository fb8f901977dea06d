"""Fault injection (issue 4) on a real local Ray instance: killed workers, a killed driver,
a crash between writing a unit file and committing it, workers that keep dying.

Every test compares against `reference`: the same job run in-process, unit by unit, by a
GenerationWorker without Ray. Exactly-once means: every (prompt_id, sample_index) once,
and the rows equal the uninterrupted run's.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")

from cluster.dispatcher import run_units  # noqa: E402
from cluster.unit import UnitFailed  # noqa: E402
from jobs.outputs.layout import TMP_RE, part_name  # noqa: E402
from jobs.task import JobTask  # noqa: E402
from conftest import descendants, kill_driver_once, sigkill  # noqa: E402
from test_cluster import ROOT, assert_same_dataset, make_spec, read_dataset, write_inputs  # noqa: E402

N_FILES, ROWS = 3, 8  # 24 prompts, unit_rows 2 -> 12 units


def job_spec(inp: Path, out: Path, **cluster):
    spec = make_spec(inp, out, num_workers=cluster.pop("num_workers", 2), max_tokens=4)
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"unit_rows": 2, **cluster})})


def prepared(spec):
    from jobs.outputs.output_dir import OutputDir
    from jobs.plan.planner import plan_job

    plan = plan_job(spec)
    out = OutputDir(spec.output.path)
    out.prepare(plan, spec)
    return plan, out


@pytest.fixture(scope="module")
def ray_local(ray_local):
    """The shared local Ray instance (conftest.py), with this module pickled by value."""
    import ray.cloudpickle as cp

    cp.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting tasks below
    yield


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("in"), sizes=(ROWS,) * N_FILES)


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The uninterrupted run, in this process: one unit at a time through one worker."""
    from cluster.worker import GenerationWorker

    out = tmp_path_factory.mktemp("reference")
    spec = job_spec(inputs, out)
    plan, _ = prepared(spec)
    w = GenerationWorker(JobTask(spec, plan), "reference", num_threads=1)
    for u in plan.units:
        w.run_unit(u)
    w.shutdown()
    rows = read_dataset(out)
    assert len(rows) == N_FILES * ROWS * 2
    return rows


def check_exactly_once(out: Path, reference: list[dict]) -> None:
    from jobs.outputs.output_dir import OutputDir

    assert OutputDir(str(out)).verify() == []
    rows = read_dataset(out)
    keys = [(r["prompt_id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert_same_dataset(rows, reference)


# ------------------------------------------------------------------ kill -9 workers mid-unit

class KillSelfMidUnit(JobTask):
    """SIGKILLs its own worker process in the middle of each unit of `units`, once per unit
    (a marker file per unit remembers): after the unit's tokens are generated and before its
    part file is written, while the worker may hold a prefetched unit too.

    The worker kills itself rather than the test killing it from outside, so the kill always
    lands mid-unit: these units take milliseconds, less than a progress report's interval."""

    def __init__(self, spec, plan, units, marker_dir):
        super().__init__(spec, plan)
        self.kill_units, self.marker_dir = set(units), marker_dir

    def write_unit(self, unit, requests, outputs, tokenizer=None):
        if unit.index in self.kill_units:
            try:  # O_EXCL: only the first attempt at this unit dies, whichever worker runs it
                os.close(os.open(os.path.join(self.marker_dir, f"killed-{unit.index}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().write_unit(unit, requests, outputs, tokenizer)


def test_kill_workers_mid_unit(ray_local, inputs, reference, tmp_path):
    """Three workers SIGKILLed mid-unit (units 1, 4 and 7, each on its first attempt): each is
    replaced, its units run again, and the dataset equals the uninterrupted run exactly once."""
    spec = job_spec(inputs, tmp_path / "out", max_unit_attempts=6)
    plan, out = prepared(spec)
    markers = tmp_path / "markers"
    markers.mkdir()
    results = run_units(KillSelfMidUnit(spec, plan, (1, 4, 7), str(markers)), plan.units, num_workers=2,
                        num_cpus=1, num_gpus=0, max_unit_attempts=6, on_result=None, on_progress=None)
    assert sorted(p.name for p in markers.iterdir()) == ["killed-1", "killed-4", "killed-7"]
    assert sorted(r.index for r in results) == [u.index for u in plan.units]
    out.cleanup_temp_files()  # a kill during a write leaves a temp file (run_job does this too)
    check_exactly_once(tmp_path / "out", reference)


# ------------------------------------------------------------------ crash between write and commit

class CrashBeforeCommit(JobTask):
    """Writes unit `crash_unit`'s temporary file completely, then the process dies before
    the link that commits it (once: a marker file remembers)."""

    def __init__(self, spec, plan, crash_unit, marker):
        super().__init__(spec, plan)
        self.crash_unit, self.marker = crash_unit, marker

    def write_unit(self, unit, requests, outputs, tokenizer=None):
        if unit.index == self.crash_unit and not os.path.exists(self.marker):
            open(self.marker, "w").close()

            # Units are written concurrently by the actor's call threads, so only this unit's
            # commit (a hard link) may die; another unit's goes through as usual.
            real_link = os.link

            def die_instead_of_commit(src, dst):
                if os.path.basename(src).startswith(f".tmp-part-{self.crash_unit:06d}-"):
                    assert os.path.getsize(src) > 0  # the temp file was fully written
                    os._exit(17)
                return real_link(src, dst)

            os.link = die_instead_of_commit
        return super().write_unit(unit, requests, outputs, tokenizer)


def test_crash_between_write_and_commit_then_rerun(ray_local, inputs, reference, tmp_path):
    from jobs.runner import run_job

    spec = job_spec(inputs, tmp_path / "out", num_workers=1)
    plan, out = prepared(spec)
    marker = str(tmp_path / "crashed")
    # The worker dies holding unit 3 and the unit it prefetched; either may be the one reported.
    with pytest.raises(UnitFailed, match=r"unit \d+ .* failed 1 times .*died"):
        run_units(CrashBeforeCommit(spec, plan, 3, marker), plan.units, num_workers=1, num_cpus=1, num_gpus=0,
                  max_unit_attempts=1, on_result=None, on_progress=None)
    assert os.path.exists(marker)
    # the half-committed unit is invisible: a temp file, no part file, nothing duplicated
    assert 3 not in out.committed_units()
    # (another unit may have been mid-write when the process died: its temp file is an orphan
    # too; or mid-commit, linked into place but its temp not yet removed: then the temp is the
    # committed part itself, the same file, and readers never see temps)
    temps = out.temp_files()
    assert any(t.startswith(".tmp-part-000003-") for t in temps), temps
    for t in temps:
        index = int(TMP_RE.match(t).group(1))
        if index in out.committed_units():
            assert os.path.samefile(tmp_path / "out" / t, tmp_path / "out" / part_name(index)), temps
    partial = read_dataset(tmp_path / "out")
    assert len({(r["prompt_id"], r["sample_index"]) for r in partial}) == len(partial)
    # rerun (resume) completes and equals the uninterrupted run
    assert run_job(spec) == 0
    assert out.temp_files() == []
    check_exactly_once(tmp_path / "out", reference)


# ------------------------------------------------------------------ workers that keep dying

class DieOnRead(JobTask):
    def read_unit(self, unit, tokenizer):
        os._exit(3)


def test_workers_that_keep_dying_fail_the_job(ray_local, inputs, tmp_path):
    from jobs.errors import JobFailed
    from jobs.runner import run_job

    spec = job_spec(inputs, tmp_path / "out", num_workers=1, max_unit_attempts=2)
    t = time.time()
    with pytest.raises(JobFailed, match=r"unit [01] .* failed 2 times \(max_unit_attempts=2\).*died") as e:
        run_job(spec, task_factory=DieOnRead)
    assert e.value.exit_code == 1
    assert time.time() - t < 150


# ------------------------------------------------------------------ the driver loses its storage

class SlowUnits(JobTask):
    """Each unit works 1 s longer before it commits: the job outlasts the lease's give-up time."""

    def write_unit(self, unit, requests, outputs, tokenizer=None):
        time.sleep(1.0)  # work, not synchronisation
        return super().write_unit(unit, requests, outputs, tokenizer)


def test_driver_whose_lease_heartbeats_fail_stops_committing(ray_local, inputs, tmp_path, monkeypatch):
    """The driver loses its access to the output directory (every read and write of its
    filesystem fails, as on a dropped mount) just as its workers start; the workers can still
    write. Its lease heartbeats fail, and before another driver could take the lease over
    (lease_timeout_s 5: it gives up 2.5 s after its last heartbeat) it stops the job: JobFailed
    (exit 1) naming the failed heartbeats and the error, the workers stopped with units left
    uncommitted, no _SUCCESS."""
    from jobs.errors import JobFailed
    from jobs import runner
    from jobs.outputs import output_dir
    from test_lease import BrokenFS

    fs = BrokenFS()
    real_resolve, real_record = output_dir.resolve_output, output_dir.OutputDir.record_kernels
    monkeypatch.setattr(output_dir, "resolve_output", lambda path: (fs, real_resolve(path)[1]))

    def record_then_lose_storage(self, kernels):
        real_record(self, kernels)  # the first worker is ready and its kernels recorded (before any unit)
        fs.broken.set()

    monkeypatch.setattr(output_dir.OutputDir, "record_kernels", record_then_lose_storage)
    out = tmp_path / "out"
    spec = job_spec(inputs, out, num_workers=1)
    spec = spec.model_copy(update={"output": spec.output.model_copy(update={"lease_timeout_s": 5})})
    t = time.monotonic()
    with pytest.raises(JobFailed, match=r"output lease heartbeats have failed for \d+s.*Input/output error.*"
                                        r"\(injected\).*stops committing") as e:
        runner.run_job(spec, task_factory=SlowUnits)
    assert e.value.exit_code == 1
    assert time.monotonic() - t < 60
    assert len(list(out.glob("part-*.parquet"))) < 12 and not (out / "_SUCCESS").exists()


# ------------------------------------------------------------------ kill the driver, rerun

@pytest.mark.slow
def test_kill_driver_then_rerun(inputs, reference, tmp_path):
    """`batchgen run` in a subprocess with its own Ray instance, SIGKILLed once a unit is
    committed; the same command again resumes and completes the dataset."""
    out = tmp_path / "out"
    spec = job_spec(inputs, out, num_workers=1)
    cfg = tmp_path / "job.yaml"
    data = spec.to_dict()
    cfg.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(cfg)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    kill_driver_once(proc, lambda: bool(list(out.glob("part-*.parquet"))), timeout_s=180)
    from jobs.outputs.output_dir import OutputDir

    committed = OutputDir(str(out)).committed_units()
    assert 1 <= len(committed)
    assert not (out / "_SUCCESS").exists()
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                           start_new_session=True)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    st = OutputDir(str(out)).status()
    assert st["success"] and st["summary"]["units_this_run"] == 12 - len(committed)
    check_exactly_once(out, reference)


# ------------------------------------------------------------------ a stopped (hung) worker

def test_stopped_worker_is_replaced_and_its_units_run_again(ray_local, inputs, reference, tmp_path):
    """SIGSTOP the only worker once it has committed a unit: its units pass
    cluster.unit_timeout_s (no other worker can take a second copy), it shows no progress
    when pinged, so it is replaced and its units run again on the fresh worker; the dataset
    equals the uninterrupted run. (Second copies on a live worker: test_cluster.)"""
    from cluster.dispatcher import UnitDispatcher

    spec = job_spec(inputs, tmp_path / "out", max_unit_attempts=6)
    plan, out = prepared(spec)
    stopped: list[tuple[str, int]] = []
    pool = UnitDispatcher(JobTask(spec, plan), num_workers=1, num_cpus=1, max_unit_attempts=6, unit_timeout_s=5,
                          suspect_timeout_s=5)

    def on_result(result):
        if not stopped:
            w = pool.workers()[0]
            os.kill(w["info"]["pid"], signal.SIGSTOP)
            stopped.append((w["name"], w["info"]["pid"]))

    try:
        with pool:
            results = pool.run(plan.units, on_result=on_result)
            events = [(k, d) for _, k, d in pool.events]
    finally:
        sigkill([pid for _, pid in stopped])  # ray.kill asks a process to exit; a stopped one cannot: end it
    name = stopped[0][0]
    assert any(k == "overdue" and d.endswith(f"on {name}") for k, d in events), events
    assert ("suspect", name) in events
    replaced = [i for i, (k, d) in enumerate(events) if k == "replaced" and d.startswith(f"{name}: stalled: no progress")]
    assert replaced, events
    assert any(k == "ready" for k, _ in events[replaced[0]:]), events  # a fresh worker took over
    assert sorted(r.index for r in results) == [u.index for u in plan.units]
    # The units it held when stopped ran again elsewhere (a unit it had finished just before the
    # SIGSTOP landed may still come back from it: its result was already on the way).
    overdue = {int(d.split()[1]) for k, d in events if k == "overdue" and d.endswith(f"on {name}")}
    assert all(r.worker != name for r in results if r.index in overdue), (overdue, results)
    out.cleanup_temp_files()
    check_exactly_once(tmp_path / "out", reference)


# ------------------------------------------------------------------ an engine that raises

class EngineFailsOnce(JobTask):
    """The real engine, whose step raises once across all workers (a marker file, created
    exclusively, decides which call)."""

    def __init__(self, spec, plan, marker, staged=None):
        super().__init__(spec, plan, staged=staged)
        self.marker = marker

    def load_engine(self):
        from engine import load_engine

        eng = load_engine(**self.engine_kwargs, num_threads=1)
        real_step = eng.step

        def step():
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return real_step()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        eng.step = step
        return eng


def test_worker_whose_engine_raises_is_replaced(ray_local, inputs, reference, tmp_path):
    from cluster.dispatcher import UnitDispatcher

    spec = job_spec(inputs, tmp_path / "out", max_unit_attempts=3)
    plan, out = prepared(spec)
    marker = str(tmp_path / "engine-failed")
    with UnitDispatcher(EngineFailsOnce(spec, plan, marker), num_workers=2, num_cpus=1, max_unit_attempts=3) as pool:
        results = pool.run(plan.units)
        events = [(k, d) for _, k, d in pool.events]
    assert os.path.exists(marker)
    replaced = [d for k, d in events if k == "replaced"]
    assert len(replaced) == 1 and "its engine failed: " in replaced[0], replaced
    assert "RuntimeError('CUDA error: an illegal memory access was encountered')" in replaced[0]
    assert [k for k, _ in events].count("start") == 3  # the failed worker's slot got a fresh process
    assert any(k == "unit_failed" and "illegal memory access" in d for k, d in events)
    assert sorted(r.index for r in results) == [u.index for u in plan.units]
    check_exactly_once(tmp_path / "out", reference)


# ------------------------------------------------------------------ the raylet dies; a second driver

def _raylet_of(pid: int) -> int:
    for p in descendants(pid):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"/raylet"):
                return p
        except OSError:
            continue
    raise AssertionError(f"no raylet under pid {pid}")


@pytest.mark.slow
def test_raylet_killed_then_rerun_and_a_second_driver_refused(inputs, reference, tmp_path):
    """`batchgen run` (its own local Ray instance): once a unit is committed the node dies:
    its raylet and the worker processes under it are SIGKILLed together (as when the
    machine or the raylet's cgroup goes; actor calls do not pass through the raylet, so
    workers left alive would go on until the GCS declares the node dead). The driver exits 1
    within 60 s naming the cause, and releases its lease. The rerun completes the job
    identically; while it runs, a second `batchgen run` on the same output exits 2 naming
    the rerun's pid and leaves the rerun's lease alone."""
    out = tmp_path / "out"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(job_spec(inputs, out, num_workers=1).to_dict()))
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(cfg)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    # Ray's GCS declares a node dead after health_check_failure_threshold failed checks,
    # health_check_period_ms apart: 5 x 3 s by default, which was 16 of this test's 43 s.
    env.update(RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="3")
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    ray_procs: list[int] = []
    try:
        deadline = time.time() + 180
        while not list(out.glob("part-*.parquet")):  # bounded poll for the first committed unit
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.time() < deadline, "no unit committed within 180s"
            time.sleep(0.1)
        ray_procs = descendants(first.pid)
        raylet = _raylet_of(first.pid)
        for p in [raylet] + descendants(raylet):
            os.kill(p, signal.SIGKILL)
        killed = time.monotonic()
        said = first.communicate(timeout=120)[0]
        took = time.monotonic() - killed
    finally:
        sigkill(descendants(first.pid) + ray_procs)
    error = [ln for ln in said.splitlines() if ln.startswith("error: ")]
    print(f"driver exited {took:.1f}s after the node died: {error}")
    assert first.returncode == 1, said[-3000:]
    assert took < 60, (took, said[-3000:])
    assert "error: job failed after" in said and "no Ray node can host a worker" in said, said[-3000:]
    assert "the Ray node this job runs on died" in said, said[-3000:]
    assert not (out / "_batchgen" / "lease.json").exists()
    assert not (out / "_SUCCESS").exists()

    rerun = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        lease = out / "_batchgen" / "lease.json"
        deadline = time.time() + 120
        while not (lease.exists() and f'"pid": {rerun.pid}' in lease.read_text()):  # bounded poll: rerun holds it
            assert rerun.poll() is None, rerun.stdout.read()[-3000:]
            assert time.time() < deadline, "the rerun took no lease within 120s"
            time.sleep(0.05)
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"is in use by another batchgen driver: pid {rerun.pid} on host" in second.stderr, second.stderr
        assert f'"pid": {rerun.pid}' in lease.read_text()  # the lease is still the rerun's
        said = rerun.communicate(timeout=300)[0]
    finally:
        sigkill(descendants(rerun.pid))
    assert rerun.returncode == 0, said[-3000:]
    check_exactly_once(out, reference)
