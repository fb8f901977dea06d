"""jobs.outputs.lease: one driver per output directory (no Ray: the lease is plain files)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

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


def test_fresh_lease_of_another_host_is_refused_stale_one_taken_over(tmp_path):
    od = _out(tmp_path)
    _write(od, heartbeat=time.time() - 5)
    with pytest.raises(OutputError, match="pid 4242 on host elsewhere .*last heartbeat \\d+s ago"):
        OutputLease(od, "a" * 64, 120).acquire()
    _write(od, heartbeat=time.time() - 500)
    lease = OutputLease(od, "a" * 64, 120)
    lease.acquire()
    assert "pid 4242 on host elsewhere" in lease.took_over and "no heartbeat for 500s" in lease.took_over
    assert json.loads(od.read_text(LEASE))["token"] == lease.token
    lease.release()


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    od = _out(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(od, host=socket.gethostname(), pid=int(gone.stdout), heartbeat=time.time())
    lease = OutputLease(od, "a" * 64, 120)
    lease.acquire()
    assert f"its process {int(gone.stdout)} on this host is gone" in lease.took_over
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
