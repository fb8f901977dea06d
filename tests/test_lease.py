"""jobs.outputs.lease: one driver per output directory (no Ray: the lease is plain files)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pyarrow.fs as pafs
import pytest

from jobs.errors import JobFailed, OutputError
from jobs.outputs.layout import LEASE
from jobs.outputs.lease import OutputLease
from jobs.outputs.output_dir import OutputDir


def _out(tmp_path) -> OutputDir:
    od = OutputDir(str(tmp_path / "out"))
    od.ensure_writable()
    return od


def _write(od: OutputDir, **fields) -> None:
    record = {"holder": "x", "host": "elsewhere", "pid": 4242, "token": "theirs", "fingerprint": "f" * 64,
              "acquired": "2026-01-01T00:00:00Z", "heartbeat": time.time(), "timeout_s": 120, **fields}
    od.write_text(LEASE, json.dumps(record))


def test_acquire_refuse_release(tmp_path):
    od = _out(tmp_path)
    first = OutputLease(od, "a" * 64, 120)
    first.acquire()
    held = json.loads(od.read_text(LEASE))
    assert (held["pid"], held["host"], held["token"]) == (os.getpid(), socket.gethostname(), first.token)
    # the same process is alive, so even a second driver on this host is refused
    second = OutputLease(od, "b" * 64, 120)
    with pytest.raises(OutputError, match=rf"in use by another batchgen driver: pid {os.getpid()} on host "
                                          rf"{socket.gethostname()} \(job aaaaaaaaaaaa") as e:
        second.acquire()
    assert e.value.exit_code == 2
    first.release()
    assert od.read_text(LEASE) is None
    second.acquire()
    second.release()


def _this_machine() -> dict:
    """The identity fields of a lease written on this machine, in our namespaces."""
    from jobs.outputs.lease import _boot_id, _namespaces

    return {"host": socket.gethostname(), "boot_id": _boot_id(), "namespaces": _namespaces()}


def test_lease_of_a_live_process_on_this_machine_is_judged_by_this_machines_clock(tmp_path):
    """A holder on this machine (same host, boot id and namespaces) whose process runs: its
    heartbeat time is on this machine's monotonic clock, so a recent one is refused at once
    and one older than the lease time is taken over at once, without watching."""
    od = _out(tmp_path)
    _write(od, **_this_machine(), pid=os.getpid(), monotonic=time.monotonic() - 5)
    with pytest.raises(OutputError, match=rf"pid {os.getpid()} on host .*its process is running, last heartbeat "
                                          rf"5s ago"):
        OutputLease(od, "a" * 64, 120).acquire()
    _write(od, **_this_machine(), pid=os.getpid(), monotonic=time.monotonic() - 500)
    lease = OutputLease(od, "a" * 64, 120)
    lease.acquire()
    assert f"pid {os.getpid()} on host" in lease.took_over and "no heartbeat for 500s" in lease.took_over
    assert json.loads(od.read_text(LEASE))["token"] == lease.token
    lease.release()


def test_lease_of_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path):
    od = _out(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(od, **_this_machine(), pid=int(gone.stdout), monotonic=time.monotonic())
    lease = OutputLease(od, "a" * 64, 120)
    lease.acquire()
    assert f"its process {int(gone.stdout)} on this machine is gone" in lease.took_over
    lease.release()


def test_a_lease_taken_over_stops_its_driver(tmp_path):
    od = _out(tmp_path)
    lease = OutputLease(od, "a" * 64, 120)
    lease.acquire()
    assert lease.beat() and json.loads(od.read_text(LEASE))["token"] == lease.token
    lease.check()
    _write(od)  # another driver took it (ours had gone stale)
    assert not lease.beat()
    with pytest.raises(JobFailed, match="taken over by pid 4242 on host elsewhere"):
        lease.check()
    lease.release()
    assert json.loads(od.read_text(LEASE))["token"] == "theirs"  # not ours to remove


# ------------------------------------------------------------------ staleness by observation (issue 20)

class Clock:
    """The reader's monotonic clock, injected: wait(s) advances it by s and lets the holder
    act (`on_wait`, given the new time), so no test sleeps."""

    def __init__(self):
        self.t = 1000.0
        self.on_wait = None

    def now(self) -> float:
        return self.t

    def wait(self, seconds: float) -> bool:
        self.t += seconds
        if self.on_wait is not None:
            self.on_wait(self.t)
        return False


def _reader(od: OutputDir, clock: Clock, timeout_s: float = 5.0) -> OutputLease:
    lease = OutputLease(od, "a" * 64, timeout_s)
    lease.clock, lease.wait = clock.now, clock.wait
    return lease


def _holder(od: OutputDir, **fields) -> None:
    """The lease record of a holder on another machine with lease_timeout_s 5."""
    _write(od, **{"timeout_s": 5, **fields})


SKEWS = {"past": -1e6, "future": 1e6}  # the holder's clock against ours, in seconds


@pytest.mark.parametrize("skew", SKEWS)
def test_a_live_holder_with_a_skewed_clock_is_not_taken_over(tmp_path, skew):
    """A holder on another host whose clock is ~12 days behind or ahead of ours keeps
    rewriting its lease: the reader watches the record change and refuses (exit 2), however
    old or new the holder's own timestamps look, and leaves the lease alone."""
    od, clock = _out(tmp_path), Clock()
    beats = iter(range(1, 10**6))
    clock.on_wait = lambda t: _holder(od, heartbeat=time.time() + SKEWS[skew], beat=next(beats))
    _holder(od, heartbeat=time.time() + SKEWS[skew], beat=0)
    start = clock.t
    with pytest.raises(OutputError, match="in use by another batchgen driver: pid 4242 on host elsewhere") as e:
        _reader(od, clock).acquire()
    assert e.value.exit_code == 2
    assert clock.t - start < 5.0  # refused as soon as the record changed, not after the lease time
    assert json.loads(od.read_text(LEASE))["token"] == "theirs"


@pytest.mark.parametrize("skew", SKEWS)
def test_a_lease_that_stops_changing_is_taken_after_the_lease_time_as_the_reader_observes_it(tmp_path, skew):
    """The holder (clock skewed either way) beats three times while the reader watches, then
    stops: the reader takes the lease over once the record has stayed unchanged for
    lease_timeout_s on the reader's own clock (never earlier), and says so."""
    od, clock = _out(tmp_path), Clock()
    _holder(od, heartbeat=time.time() + SKEWS[skew], beat=0)
    changes = []

    def holder(t):
        if len(changes) < 3:
            changes.append(t)
            _holder(od, heartbeat=time.time() + SKEWS[skew], beat=len(changes))

    reader = _reader(od, clock)
    # a record that changes means a live holder: each change refuses the reader at once
    for _ in range(3):
        clock.on_wait = holder
        with pytest.raises(OutputError, match="in use by another batchgen driver"):
            reader.acquire()
    assert len(changes) == 3, f"the reader refused without watching the record ({len(changes)} changes seen)"
    last_change = changes[-1]
    reader.acquire()  # the holder stopped: taken once unchanged for 5 s as this reader saw it
    assert reader.took_over and "pid 4242 on host elsewhere" in reader.took_over
    assert "did not change for 5s" in reader.took_over, reader.took_over
    assert 5.0 <= clock.t - last_change <= 5.0 + 1.0
    assert json.loads(od.read_text(LEASE))["token"] == reader.token
    reader.release()


def test_the_holders_longer_lease_time_governs(tmp_path):
    """A holder that declared lease_timeout_s 60 beats every 15 s: a reader configured with 5
    watches its record for 60 s, not 5, before taking it over."""
    od, clock = _out(tmp_path), Clock()
    _holder(od, timeout_s=60)
    start = clock.t
    lease = _reader(od, clock)
    lease.acquire()
    assert clock.t - start >= 60 and "did not change for 60s" in lease.took_over
    lease.release()


def test_same_hostname_on_another_boot_is_not_local(tmp_path):
    """A lease from a machine with our hostname but another boot id (another machine of the
    same name, or this one before a reboot) names a pid that means nothing here: it is not
    taken over because that pid is not running on this machine; while its record changes the
    reader refuses, and once it stops changing it is taken after the lease time."""
    od, clock = _out(tmp_path), Clock()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = dict(host=socket.gethostname(), boot_id="00000000-0000-0000-0000-000000000000", pid=int(gone.stdout))
    beats = iter(range(1, 10**6))
    clock.on_wait = lambda t: _holder(od, **other, beat=next(beats))
    _holder(od, **other, beat=0)
    with pytest.raises(OutputError, match=f"in use by another batchgen driver: pid {int(gone.stdout)} on host"):
        _reader(od, clock).acquire()
    clock.on_wait = None  # it stops changing
    start = clock.t
    lease = _reader(od, clock)
    lease.acquire()
    assert clock.t - start >= 5.0 and "did not change for 5s" in lease.took_over
    lease.release()


class BrokenFS(pafs.LocalFileSystem):
    """The local filesystem, until `broken` is set: then every read and write fails as a lost
    mount or revoked credentials would."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.broken = threading.Event()

    def _check(self, path):
        if self.broken.is_set():
            raise OSError(f"[Errno 5] Input/output error: '{path}' (injected)")

    def open_output_stream(self, path, *a, **k):
        self._check(path)
        return super().open_output_stream(path, *a, **k)

    def open_input_stream(self, path, *a, **k):
        self._check(path)
        return super().open_input_stream(path, *a, **k)

    def open_input_file(self, path, *a, **k):
        self._check(path)
        return super().open_input_file(path, *a, **k)

    def delete_file(self, path):
        self._check(path)
        return super().delete_file(path)


def test_heartbeats_that_keep_failing_lose_the_lease_before_anyone_may_take_it(tmp_path):
    """The holder's storage fails after it took the lease: each failed heartbeat is retried,
    and once no heartbeat has succeeded for lease_timeout_s minus two intervals (by its own
    clock: before any reader can have watched the record unchanged for the lease time)
    check() raises JobFailed (exit 1) naming the failure. A heartbeat that succeeds again
    before then resets the count."""
    od, clock = _out(tmp_path), Clock()
    fs = BrokenFS()
    od.fs = fs
    lease = _reader(od, clock, timeout_s=8.0)  # heartbeat every 2 s; gives up after 8 - 2*2 = 4 s
    lease.acquire()
    fs.broken.set()
    clock.t += 2.0
    assert lease.beat()  # failed, logged, retried
    lease.check()
    clock.t += 1.9
    lease.check()  # 3.9 s without a heartbeat: still ours
    fs.broken.clear()
    assert lease.beat()  # storage is back: the count starts again
    clock.t += 3.9
    lease.check()
    fs.broken.set()
    assert lease.beat()
    clock.t += 0.2  # 4.1 s since the last heartbeat that succeeded
    with pytest.raises(JobFailed, match=r"output lease heartbeats have failed for 4s.*Input/output error.*"
                                        r"\(injected\).*stops committing") as e:
        lease.check()
    assert e.value.exit_code == 1
    assert not lease.beat()  # a lost lease is not rewritten
    fs.broken.clear()
    lease.release()
