"""The output lease: one driver at a time per output directory.

A driver holds `output.path/_batchgen/lease.json` from before it touches the directory
until it ends:

    {"holder": "host:pid", "host": ..., "pid": ..., "pid_start": ..., "token": ...,
     "fingerprint": ..., "acquired": ..., "heartbeat": <unix time>, "timeout_s": ...}

and rewrites `heartbeat` every timeout_s / 4 (at most every 30 s) from a thread. Another
driver on the same output stops with exit code 2 naming the holder, unless the lease is
stale: no heartbeat for `output.lease_timeout_s` seconds (by the reader's clock), or the
holder ran on this host and its process is gone (a killed driver's rerun need not wait).
It then takes the lease over and says so. A driver that finds its lease taken over (its
heartbeats had stopped, e.g. a suspended laptop) stops its job (JobFailed, exit 1).

Creating a lease is exclusive on local filesystems: committed as a unit file is
(jobs/outputs/commit.py: a hard link that fails if the file exists); on an object store,
which has no such operation through pyarrow, the lease is written and read back, so two
drivers starting within the same second can both proceed until the first heartbeat, where
the loser stops.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from jobs import uri
from jobs.errors import JobFailed, OutputError
from jobs.outputs.commit import commit_file
from jobs.outputs.layout import LEASE
from jobs.outputs.output_dir import OutputDir

log = logging.getLogger("batchgen")


def _pid_start(pid: int) -> str | None:
    """The start time of process `pid` (Linux /proc), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(lease: dict[str, Any]) -> bool:
    pid = lease.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    started = lease.get("pid_start")
    return started is None or _pid_start(pid) in (None, started)


def _describe(lease: dict[str, Any], now: float) -> str:
    beat = lease.get("heartbeat")
    ago = f", last heartbeat {now - beat:.0f}s ago" if isinstance(beat, (int, float)) else ""
    fp = str(lease.get("fingerprint") or "?")[:12]
    return f"pid {lease.get('pid')} on host {lease.get('host')} (job {fp}, since {lease.get('acquired')}{ago})"


class OutputLease:
    """The lease of one driver on one output directory (see the module docstring).

    acquire() raises OutputError (exit code 2) while another live driver holds it;
    start() begins the heartbeats; check() raises JobFailed once the lease was lost;
    release() stops the heartbeats and removes the lease if it is still ours.
    `took_over`: the stale holder's description when acquire() took the lease over.
    """

    def __init__(self, out: OutputDir, fingerprint: str, timeout_s: float) -> None:
        self.out = out
        self.timeout_s = float(timeout_s)
        self.interval_s = min(30.0, self.timeout_s / 4)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.token = uuid.uuid4().hex
        self.record = {"holder": f"{self.host}:{self.pid}", "host": self.host, "pid": self.pid,
                       "pid_start": _pid_start(self.pid), "token": self.token, "fingerprint": fingerprint,
                       "acquired": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "heartbeat": time.time(),
                       "timeout_s": self.timeout_s}
        self.took_over: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading
    def read(self) -> dict[str, Any] | None:
        """The current lease, None if there is none; an unreadable one counts as a foreign
        lease with no heartbeat (it goes stale)."""
        text = self.out.read_text(LEASE)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return {"holder": "?", "token": None}
        return data if isinstance(data, dict) else {"holder": "?", "token": None}

    def stale(self, lease: dict[str, Any], now: float) -> str | None:
        """Why `lease` no longer holds (None while it does)."""
        beat = lease.get("heartbeat")
        if not isinstance(beat, (int, float)):
            return "it has no heartbeat"
        if lease.get("host") == self.host and not _alive_here(lease):
            return f"its process {lease.get('pid')} on this host is gone"
        if now - beat > self.timeout_s:
            return f"no heartbeat for {now - beat:.0f}s (output.lease_timeout_s: {self.timeout_s:g})"
        return None

    # ------------------------------------------------------------------ lifecycle
    def acquire(self) -> None:
        now = time.time()
        current = self.read()
        if current is not None and current.get("token") != self.token:
            why = self.stale(current, now)
            if why is None:
                raise OutputError(
                    f"output.path {uri.redact(self.out.path)} is in use by another batchgen driver: "
                    f"{_describe(current, now)}. Wait for it to finish; a lease without heartbeats expires "
                    f"after output.lease_timeout_s ({self.timeout_s:g}s), and one whose driver on this host is gone "
                    f"is taken over at once")
            self.took_over = f"{_describe(current, now)}: {why}"
            log.warning("taking over the output lease of %s", self.took_over)
        self.record["heartbeat"] = time.time()
        text = json.dumps(self.record, indent=1, sort_keys=True)
        if current is None and uri.is_local(self.out.fs):
            self._create_exclusive(text)
        else:
            self.out.write_text(LEASE, text)
        mine = self.read()
        if mine is None or mine.get("token") != self.token:
            raise OutputError(f"output.path {uri.redact(self.out.path)}: another batchgen driver took the lease at "
                              f"the same time: {_describe(mine or {}, time.time())}")

    def _create_exclusive(self, text: str) -> None:
        final = self.out.fs_path(LEASE)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if not commit_file(self.out.fs, final, text.encode(), ".tmp-lease"):
            now = time.time()
            raise OutputError(f"output.path {uri.redact(self.out.path)} is in use by another batchgen driver: "
                              f"{_describe(self.read() or {}, now)}")

    def start(self) -> None:
        """Heartbeats every interval_s from a daemon thread until release()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="batchgen-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.beat():
                return

    def beat(self) -> bool:
        """One heartbeat: rewrite the lease if it is still ours (returns True), else record
        that it was lost (returns False). A failed write is logged and retried next time."""
        try:
            current = self.read()
            if current is None or current.get("token") != self.token:
                self.lost = (f"the output lease was taken over by {_describe(current, time.time())}"
                             if current else "the output lease file was removed")
                log.error("%s; this driver stops", self.lost)
                return False
            self.record["heartbeat"] = time.time()
            self.out.write_text(LEASE, json.dumps(self.record, indent=1, sort_keys=True))
        except Exception as e:  # noqa: BLE001 - a failed heartbeat is retried; staleness is the reader's call
            log.warning("output lease heartbeat failed (will retry): %s", e)
        return True

    def check(self) -> None:
        """Raise JobFailed if another driver took the lease (called from the dispatch loop)."""
        if self.lost is not None:
            raise JobFailed(f"{self.lost}. Committed units are kept; only one driver may run a job's output")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            current = self.read()
            if current is not None and current.get("token") == self.token:
                self.out.delete(LEASE)
        except Exception as e:  # noqa: BLE001 - best effort: a stale lease is taken over later
            log.warning("could not remove the output lease: %s", e)
