"""The output lease: one driver at a time per output directory.

A driver holds `output.path/_batchgen/lease.json` from before it touches the directory
until it ends:

    {"holder": "host:pid", "host": ..., "boot_id": ..., "namespaces": ..., "pid": ...,
     "pid_start": ..., "token": ..., "fingerprint": ..., "acquired": ..., "timeout_s": ...,
     "beat": <count>, "heartbeat": <unix time>, "monotonic": <its machine's monotonic clock>}

and rewrites it every interval_s (timeout_s / 4, at most 30 s) from a thread, each time with
`beat` one higher, so the record changes with every heartbeat whatever the holder's clocks say.

Whether a lease still holds is judged by the reader, from what it sees itself, never from the
holder's timestamps (clocks differ between machines; a lease written by a clock hours behind
is not dead, nor is one written by a clock ahead alive):
- a holder on this machine (the same host name, boot id (/proc/sys/kernel/random/boot_id) and
  pid and time namespaces) is judged at once: its process gone (pid and process start time)
  means the lease is free; otherwise its `monotonic` field is this machine's own monotonic
  clock, so the time since its last heartbeat is exact;
- any other holder (another machine, one of the same host name on another boot, a container
  of another pid namespace) is watched, as etcd and ZooKeeper clients watch a lease: the
  reader rereads the record (every second at most) on its own monotonic clock, and the holder
  is alive as soon as the record changes, dead once it has not changed for the lease time: the
  larger of the holder's `timeout_s` and the reader's `output.lease_timeout_s`. A second
  driver on a live lease thus stops within about one heartbeat interval; a dead driver's lease
  from another machine is taken over after the lease time.
A driver that finds the lease alive stops with exit code 2 naming the holder; one that finds
it dead takes it over and says so.

The holder gives its lease up itself when its heartbeats stop reaching the store: once none
has succeeded for timeout_s minus two heartbeat intervals (half the lease time up to
timeout_s 120) by its own monotonic clock, earlier than any reader can have watched the record
unchanged for the lease time, check() raises JobFailed (exit 1) naming the failure; the job
runner then stops its workers and commits nothing more. A driver that finds its lease taken
over (its heartbeats had stopped reaching the store, e.g. a suspended laptop) stops likewise.

Creating a lease is exclusive where commits are (jobs/outputs/commit.py: a hard link that
fails if the file exists locally, a conditional PUT on S3 stores that honour it). On those S3
stores every later write of the record is conditional too, on the ETag of the version it
replaces (If-Match): taking a stale lease over replaces only the record judged stale (of two
drivers taking over at once, one is refused), a heartbeat only the holder's own last record
(one delayed past a takeover is refused, and its driver stops), and release() deletes only
that record. Elsewhere (local filesystems, stores without conditional writes) taking over
replaces the record, heartbeats read then rewrite it and release() reads then removes it,
each read back, so two drivers taking over at once both proceed until the first heartbeat,
where the loser stops, and a holder's write stalled for the lease time (a hung mount) can
still land after a takeover and stop the new holder.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable
import uuid

from jobs import uri
from jobs.errors import JobFailed, OutputError
from jobs.outputs.commit import s3_error_code, store_refuses, commit_file, conditional_writes
from jobs.outputs.layout import LEASE
from jobs.outputs.output_dir import OutputDir

log = logging.getLogger("batchgen")

POLL_S = 1.0  # how often a reader rereads a lease it watches, at most


def _read_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _boot_id() -> str | None:
    """This machine's boot id (Linux): another value means another machine or another boot."""
    return _read_line("/proc/sys/kernel/random/boot_id")


def _namespaces() -> str | None:
    """This process's pid and time namespaces (Linux): pids and the monotonic clock mean the
    same thing only inside the same ones (containers on one machine share its boot id)."""
    names = []
    for ns in ("pid", "time"):
        try:
            names.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            pass
    return " ".join(names) or None


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


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _describe(lease: dict[str, Any]) -> str:
    fp = str(lease.get("fingerprint") or "?")[:12]
    return f"pid {lease.get('pid')} on host {lease.get('host')} (job {fp}, since {lease.get('acquired')})"


def _parse(text: str | None) -> dict[str, Any] | None:
    """The lease record of `text`; an unreadable one counts as a foreign lease (watched: it
    goes stale unless it changes)."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {"holder": "?", "token": None}
    return data if isinstance(data, dict) else {"holder": "?", "token": None}


class OutputLease:
    """The lease of one driver on one output directory (see the module docstring).

    acquire() raises OutputError (exit code 2) while another live driver holds it;
    start() begins the heartbeats; check() raises JobFailed once the lease was lost (taken
    over, or its heartbeats failing for too long); release() stops the heartbeats and removes
    the lease if it is still ours. `took_over`: the stale holder's description when acquire()
    took the lease over.

    `clock` (monotonic seconds) and `wait(seconds)` are the lease's own clock and its pause
    while it watches another holder's record: time.monotonic and a plain sleep unless a test
    injects them (attributes, as the constructor arguments).
    """

    def __init__(self, out: OutputDir, fingerprint: str, timeout_s: float, *,
                 clock: Callable[[], float] = time.monotonic, wait: Callable[[float], Any] | None = None) -> None:
        self.out = out
        self.timeout_s = float(timeout_s)
        self.interval_s = min(30.0, self.timeout_s / 4)
        # no heartbeat for this long: give up before a reader may take over (it watches timeout_s)
        self.give_up_s = max(self.interval_s, self.timeout_s - 2 * self.interval_s)
        self.clock = clock
        self.wait = wait or threading.Event().wait  # an Event never set: wait(s) sleeps s
        self.host = socket.gethostname()
        self.boot_id = _boot_id()
        self.namespaces = _namespaces()
        self.pid = os.getpid()
        self.token = uuid.uuid4().hex
        self.record = {"holder": f"{self.host}:{self.pid}", "host": self.host, "boot_id": self.boot_id,
                       "namespaces": self.namespaces, "pid": self.pid, "pid_start": _pid_start(self.pid),
                       "token": self.token, "fingerprint": fingerprint,
                       "acquired": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timeout_s": self.timeout_s,
                       "beat": 0, "heartbeat": time.time(), "monotonic": None}
        self.took_over: str | None = None
        self.lost: str | None = None
        self._last_ok: float | None = None  # clock() when the last heartbeat that reached the store began
        self._failure: str | None = None  # the last heartbeat's error, while they fail
        self._etag: str | None = None  # S3 with conditional writes: the ETag of our record as last written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ reading
    def read(self) -> dict[str, Any] | None:
        """The current lease, None if there is none; an unreadable one counts as a foreign
        lease (watched: it goes stale unless it changes)."""
        return _parse(self.out.read_text(LEASE))

    def _client(self) -> Any:
        """The botocore client writing the lease conditionally (If-Match), or None: a local
        filesystem, or a store without conditional writes (see the module docstring)."""
        if uri.is_local(self.out.fs):
            return None
        return conditional_writes(self.out.fs, self.out.fs_path(LEASE))

    def _get(self, client: Any) -> tuple[str | None, str | None]:
        """(the lease's text, its ETag) through `client`; (None, None) if there is none."""
        bucket, key = self.out.fs_path(LEASE).split("/", 1)
        try:
            got = client.get_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - botocore's errors
            if s3_error_code(e)[1] == 404:
                return None, None
            raise OSError(f"cannot read s3://{bucket}/{key}: {e}") from e
        return got["Body"].read().decode("utf-8").strip() or None, got.get("ETag")

    def _put_if_match(self, client: Any, text: str | None, etag: str) -> str | None:
        """Replace (text) or delete (None) the lease only if its ETag is still `etag`: the
        new ETag ("" for a delete), or None if the lease changed (412, or gone: 404). A store
        that refuses the header (a client error other than those) gets the plain request."""
        bucket, key = self.out.fs_path(LEASE).split("/", 1)
        try:
            if text is None:
                client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
                return ""
            return client.put_object(Bucket=bucket, Key=key, Body=text.encode(), IfMatch=etag).get("ETag") or ""
        except Exception as e:  # noqa: BLE001 - botocore's errors, mapped below
            code, status = s3_error_code(e)
            if code in ("PreconditionFailed", "NoSuchKey") or status in (404, 412):
                return None
            if not store_refuses(status):
                raise OSError(f"conditional write of s3://{bucket}/{key} failed: {e}") from e
        log.warning("the store refuses If-Match on s3://%s/%s: writing the output lease without it", bucket, key)
        if text is None:
            client.delete_object(Bucket=bucket, Key=key)
            return ""
        return client.put_object(Bucket=bucket, Key=key, Body=text.encode()).get("ETag") or ""

    def lease_time(self, lease: dict[str, Any]) -> float:
        """How long `lease`'s record must stay unchanged before it is stale: the larger of
        its holder's timeout_s and ours."""
        theirs = _number(lease.get("timeout_s"))
        return max(self.timeout_s, theirs) if theirs is not None and theirs > 0 else self.timeout_s

    def on_this_machine(self, lease: dict[str, Any]) -> bool:
        """Whether `lease`'s holder ran on this machine, in our pid and time namespaces: then
        its pid and monotonic clock are ours to read. A lease with our host name from another
        boot (another machine of the same name, or this one before a reboot) is not."""
        return (self.boot_id is not None and lease.get("host") == self.host and lease.get("boot_id") == self.boot_id
                and lease.get("namespaces") == self.namespaces)

    def judge(self, lease: dict[str, Any]) -> tuple[str, str]:
        """("stale" | "live" | "watch", why) for `lease` as read now: a holder on this machine is
        judged at once; any other only by watching its record (see the module docstring)."""
        if not self.on_this_machine(lease):
            return "watch", (f"on another machine: stale only if its record stays unchanged for "
                             f"{self.lease_time(lease):g}s while watched")
        if not _alive_here(lease):
            return "stale", f"its process {lease.get('pid')} on this machine is gone"
        beat = _number(lease.get("monotonic"))
        if beat is None:
            return "watch", "no heartbeat time on this machine's clock"
        ago = time.monotonic() - beat  # the holder's clock is this machine's: exact
        if ago > self.lease_time(lease):
            return "stale", (f"no heartbeat for {ago:.0f}s by this machine's clock (output.lease_timeout_s: "
                             f"{self.lease_time(lease):g})")
        return "live", f"its process is running, last heartbeat {ago:.0f}s ago"

    def _watch(self, text: str, lease: dict[str, Any]) -> tuple[str | None, str | None]:
        """Reread the lease until it changes (returns (the new text, None); None text if it
        was removed) or has stayed `text` for its lease time on our clock (returns (text, why
        it is stale))."""
        limit = self.lease_time(lease)
        log.info("the output lease is held by %s on another machine: watching it for up to %gs to tell whether "
                 "that driver is alive", _describe(lease), limit)
        since = self.clock()
        while True:
            seen = self.clock() - since
            if seen >= limit:
                return text, (f"its record did not change for {seen:.0f}s as this driver watched it "
                              f"(output.lease_timeout_s: {limit:g})")
            self.wait(min(POLL_S, self.interval_s, limit - seen))
            now = self.out.read_text(LEASE)
            if now != text:
                return now, None

    # ------------------------------------------------------------------ lifecycle
    def _refuse(self, lease: dict[str, Any], why: str) -> OutputError:
        return OutputError(
            f"output.path {uri.redact(self.out.path)} is in use by another batchgen driver: {_describe(lease)}: "
            f"{why}. Wait for it to finish; a lease whose heartbeats stop is taken over once its record has not "
            f"changed for output.lease_timeout_s ({self.lease_time(lease):g}s), and one whose driver on this "
            f"machine is gone is taken over at once")

    def acquire(self) -> None:
        client = self._client()
        text, etag = self._get(client) if client is not None else (self.out.read_text(LEASE), None)
        while True:
            current = _parse(text)
            if current is None:
                self._write_record(create=True, client=client)
                return
            if current.get("token") == self.token:
                return
            verdict, why = self.judge(current)
            if verdict == "live":
                raise self._refuse(current, why)
            if verdict == "watch":
                now, why = self._watch(text, current)
                if why is None:  # the record changed: its holder is alive (or it was released)
                    if now is None:
                        text, etag = None, None
                        continue
                    raise self._refuse(_parse(now) or {}, "its heartbeat record changed while this driver "
                                                          "watched it")
            self.took_over = f"{_describe(current)}: {why}"
            log.warning("taking over the output lease of %s", self.took_over)
            self._write_record(create=False, client=client, replaces=etag)
            return

    def _text(self) -> str:
        self.record["heartbeat"] = time.time()  # for people reading the file; no reader relies on it
        self.record["monotonic"] = time.monotonic()  # for readers on this machine (see judge)
        return json.dumps(self.record, indent=1, sort_keys=True)

    def _write_record(self, create: bool, client: Any = None, replaces: str | None = None) -> None:
        """Create the lease, or (create False) replace the stale record, through `client`
        only if it is still the version `replaces` (its ETag); then read it back."""
        started = self.clock()
        text = self._text()
        if create:
            final = self.out.fs_path(LEASE)
            self.out.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
            if not commit_file(self.out.fs, final, text.encode(), ".tmp-lease"):
                raise self._refuse(self.read() or {}, "it took the lease at the same time")
        elif client is not None and replaces is not None:
            if self._put_if_match(client, text, replaces) is None:
                raise self._refuse(self.read() or {}, "it took the lease over at the same time")
        else:
            self.out.write_text(LEASE, text)
        now, etag = self._get(client) if client is not None else (self.out.read_text(LEASE), None)
        mine = _parse(now)
        if mine is None or mine.get("token") != self.token:
            raise self._refuse(mine or {}, "it took the lease at the same time")
        self._etag, self._last_ok = etag, started

    def start(self) -> None:
        """Heartbeats every interval_s from a daemon thread until release() (a failed one is
        retried after a quarter interval)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="batchgen-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        pause = self.interval_s
        while not self._stop.wait(pause):
            if not self.beat():
                return
            pause = self.interval_s if self._failure is None else self.interval_s / 4

    def beat(self) -> bool:
        """One heartbeat: rewrite the lease if it is still ours (returns True), else record
        that it was lost (returns False). A failed read or write is logged and retried; check()
        gives the lease up once they have failed for give_up_s."""
        if self.lost is not None:
            return False
        started = self.clock()
        try:
            current = self.read()
            if current is None or current.get("token") != self.token:
                with self._lock:
                    self.lost = (f"the output lease was taken over by {_describe(current)}"
                                 if current else "the output lease file was removed")
                log.error("%s; this driver stops", self.lost)
                return False
            self.record["beat"] = int(self.record.get("beat") or 0) + 1
            if self._etag is not None:  # only over our own last record (a takeover since is kept)
                etag = self._put_if_match(self._client(), self._text(), self._etag)
                if etag is None:
                    with self._lock:
                        self.lost = f"the output lease was taken over by {_describe(self.read() or {})}"
                    log.error("%s; this driver stops", self.lost)
                    return False
                self._etag = etag
            else:
                self.out.write_text(LEASE, self._text())
        except Exception as e:  # noqa: BLE001 - retried; check() gives the lease up in time
            self._failure = f"{type(e).__name__}: {e}"
            log.warning("output lease heartbeat failed (retried; the job stops if none succeeds for %gs): %s",
                        self.give_up_s, e)
            return True
        with self._lock:
            if self.lost is None:
                self._last_ok, self._failure = started, None
        return True

    def check(self) -> None:
        """Raise JobFailed if the lease was lost: another driver took it, or no heartbeat has
        reached the store for give_up_s (called from the dispatch loop, and before the runner
        commits anything of its own)."""
        with self._lock:
            if self.lost is None and self._last_ok is not None:
                silent = self.clock() - self._last_ok
                if silent > self.give_up_s:
                    self.lost = (f"the output lease heartbeats have failed for {silent:.0f}s "
                                 f"({self._failure or 'the write has not returned'}): another driver may take the "
                                 f"lease over once it has not changed for output.lease_timeout_s "
                                 f"({self.timeout_s:g}s), so this driver stops committing")
                    log.error("%s", self.lost)
            lost = self.lost
        if lost is not None:
            raise JobFailed(f"{lost}. Committed units are kept; only one driver may run a job's output")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            current = self.read()
            if current is not None and current.get("token") == self.token:
                if self._etag is not None:  # only our own record: not one that took it over since
                    self._put_if_match(self._client(), None, self._etag)
                else:
                    self.out.delete(LEASE)
        except Exception as e:  # noqa: BLE001 - best effort: a stale lease is taken over later
            log.warning("could not remove the output lease: %s", e)
