"""Unit commits on S3 (jobs/outputs/commit.py): the first copy to commit wins, against a real
S3 API server (moto, in its own process on 127.0.0.1, tests/test_s3.py's fixture).

Between the server and batchgen sits a small HTTP proxy that forwards every request. It
stages the race a check-then-write commit loses: when copy B's PUT of part-000000.parquet
reaches it, it first lets copy A commit the same part (through the proxy, as any client),
then forwards B's PUT. With `strip`, it drops the If-None-Match header on the way, as a store
that does not implement conditional writes ignores it; `fail_puts` answers PUTs 503 SlowDown,
as a store overloaded or briefly unavailable does.
"""
from __future__ import annotations

import http.client
import http.server
import logging
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("moto")
pytest.importorskip("botocore")

from conftest import free_port  # noqa: E402
from jobs import uri  # noqa: E402
from jobs.outputs.commit import write_part  # noqa: E402
from test_s3 import s3  # noqa: E402,F401 - the moto server fixture

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
       "content-length"}


class Proxy:
    """A forwarding HTTP proxy on 127.0.0.1 in front of `upstream` (host:port).

    strip: drop If-None-Match from every request. before_put: {key suffix: callable}, each
    called once, before the first PUT whose path ends with that suffix is forwarded.
    fail_puts: {substring: n}: the next n PUTs whose path holds it are answered 503 SlowDown,
    not forwarded. `puts`: (path, the If-None-Match header as sent upstream) of every forwarded PUT."""

    def __init__(self, upstream: str, strip: bool = False):
        self.upstream, self.strip = upstream, strip
        self.before_put: dict[str, object] = {}
        self.fail_puts: dict[str, int] = {}
        self.puts: list[tuple[str, str | None]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self):
                body = self._body()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if proxy.strip:
                    headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
                if self.command == "PUT":
                    path = self.path.split("?", 1)[0]
                    failing = [s for s, n in proxy.fail_puts.items() if s in path and n > 0]
                    if failing:
                        proxy.fail_puts[failing[0]] -= 1
                        error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                        self.send_response(503, "Slow Down")
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(error)))
                        self.end_headers()
                        self.wfile.write(error)
                        return
                    for suffix in [s for s in proxy.before_put if path.endswith(s)]:
                        proxy.before_put.pop(suffix)()
                    proxy.puts.append((path, next((v for k, v in headers.items() if k.lower() == "if-none-match"),
                                                  None)))
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in HOP:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy_for(s3):
    """proxy_for(strip) -> (Proxy, output URI through it); a fresh proxy (so a fresh endpoint,
    whose conditional-write support is learnt anew) per call."""
    options, _ = s3
    upstream = dict(kv.split("=", 1) for kv in options.split("&"))["endpoint_override"]
    made = []

    def make(strip: bool, name: str):
        p = Proxy(upstream, strip=strip)
        made.append(p)
        return p, f"s3://bkt/commits/{name}?endpoint_override=127.0.0.1:{p.port}&scheme=http"

    yield make
    for p in made:
        p.close()


def _table(copy: str) -> pa.Table:
    return pa.table({"copy": [copy] * 3})


def _read_part(out: str) -> list[str]:
    fs, base = uri.filesystem_for(out)
    with fs.open_input_file(f"{base}/part-000000.parquet") as f:
        return pq.read_table(f).column("copy").to_pylist()


def test_a_second_copy_cannot_replace_a_committed_part(proxy_for, caplog):
    """Two copies of unit 0 (a retry or a deadline's second copy) finish together: copy B
    looks, finds no part, and before its PUT lands copy A commits. On a store that honours
    If-None-Match (moto, as AWS S3 and MinIO) B's write is refused by the store and A's part
    stays, whole; no warning."""
    proxy, out = proxy_for(strip=False, name="honoured")
    proxy.before_put["/part-000000.parquet"] = lambda: write_part(out, 0, _table("A"))
    with caplog.at_level(logging.WARNING):
        write_part(out, 0, _table("B"))
    assert _read_part(out) == ["A"] * 3, "copy B replaced the part copy A had committed"
    part_puts = [h for p, h in proxy.puts if p.endswith("/part-000000.parquet")]
    assert part_puts == ["*", "*"]  # both copies wrote conditionally
    assert not [r for r in caplog.records if "If-None-Match" in r.getMessage()]


def test_a_store_that_ignores_if_none_match_gets_check_then_write_with_a_warning(proxy_for, caplog):
    """A store that ignores If-None-Match (the proxy drops it) is found out once per store
    and process (the driver when it checks the output is writable), by a probe object
    written twice and removed: commits fall back to
    checking then writing, with a warning that says what that leaves open (a copy finishing
    in the same moment may replace the part, whole, with the same rows). A part that exists
    is still never written again."""
    from jobs.outputs.output_dir import OutputDir

    proxy, out = proxy_for(strip=True, name="ignored")
    with caplog.at_level(logging.WARNING):
        OutputDir(out).ensure_writable()  # the driver, before any work: it says so once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not honour If-None-Match" in w and "127.0.0.1" in w and "bkt" in w for w in warnings), \
        warnings
    proxy.before_put["/part-000000.parquet"] = lambda: write_part(out, 0, _table("A"))
    write_part(out, 0, _table("B"))
    assert _read_part(out) == ["B"] * 3  # the race a check-then-write cannot close: the later PUT won
    n = len(proxy.puts)
    write_part(out, 0, _table("C"))  # committed already: looked at, not written
    assert _read_part(out) == ["B"] * 3 and len(proxy.puts) == n
    fs, base = uri.filesystem_for(out)
    from pyarrow import fs as pafs

    left = [i.path for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))]
    assert left == [f"{base}/part-000000.parquet"], left  # the probe objects are gone


def test_two_drivers_creating_the_lease_on_s3_at_once(proxy_for):
    """Creating the output lease is a conditional write too: driver B finds no lease, and
    before its PUT lands driver A creates one; B is refused (exit 2, naming A), A's lease stays."""
    from jobs.errors import OutputError
    from jobs.outputs.lease import OutputLease
    from jobs.outputs.output_dir import OutputDir

    proxy, out = proxy_for(strip=False, name="lease")
    od = OutputDir(out)
    od.ensure_writable()
    a, b = OutputLease(od, "a" * 64, 120), OutputLease(od, "b" * 64, 120)
    proxy.before_put["/_batchgen/lease.json"] = a.acquire
    with pytest.raises(OutputError, match=r"in use by another batchgen driver: .*\(job aaaaaaaaaaaa.*took the lease "
                                          r"at the same time") as e:
        b.acquire()
    assert e.value.exit_code == 2
    assert a.read()["token"] == a.token
    a.release()


def test_a_probe_removed_between_its_puts_by_a_cleaning_driver_is_retried(proxy_for, s3, monkeypatch, caplog):
    """The conditional-write probe of a driver (or of a worker of a taken-over one) may be
    removed between its two PUTs by the driver holding the lease, which cleans up probes a
    crash left: the second PUT then succeeds on a store that honours If-None-Match. The probe
    is tried once more under a new name, so the store is not wrongly taken for one without
    conditional writes (no warning, commits stay conditional); no probe object is left."""
    import types

    from pyarrow import fs as pafs

    from jobs.outputs import commit
    from jobs.outputs.output_dir import OutputDir

    options, _ = s3
    proxy, out = proxy_for(strip=False, name="probe-removed")
    names = iter(["a" * 32, "b" * 32, "c" * 32])
    monkeypatch.setattr(commit, "uuid", types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=next(names))))
    first = f"{commit.PROBE_PREFIX}if-none-match-{'a' * 32}"
    fs, base = uri.filesystem_for(f"s3://bkt/commits/probe-removed?{options}")  # the store itself, not the proxy

    def remove_before_the_second_put():
        proxy.before_put["/" + first] = lambda: fs.delete_file(f"{base}/{first}")

    proxy.before_put["/" + first] = remove_before_the_second_put
    with caplog.at_level(logging.WARNING):
        OutputDir(out).ensure_writable()
    assert not [r for r in caplog.records if "If-None-Match" in r.getMessage()], caplog.records
    probe_puts = [p.rsplit("/", 1)[1] for p, _ in proxy.puts if commit.PROBE_PREFIX + "if" in p]
    assert probe_puts == [first, first] + [f"{commit.PROBE_PREFIX}if-none-match-{'b' * 32}"] * 2
    left = [i.path for i in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))]
    assert left == [], left


def test_a_probe_the_store_fails_to_answer_learns_nothing(proxy_for, monkeypatch, caplog):
    """The store answers the conditional-write probe's PUTs 503 SlowDown (throttling, a brief
    outage) past botocore's retries: a failed request says nothing about If-None-Match. The
    driver's check stops it with exit 2 naming the store and the error, with no warning that
    the store ignores the header, and nothing is cached: once the store answers, the next
    check learns that it honours the header, and commits stay conditional (before the fix:
    the 503 was taken for a refusal, cached for the process, and every commit checked, then
    wrote, so a racing second copy replaced a committed part)."""
    from jobs.errors import OutputError
    from jobs.outputs.output_dir import OutputDir

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries, which the 503s outlast here
    proxy, out = proxy_for(strip=False, name="probe-503")
    proxy.fail_puts["if-none-match"] = 2
    with caplog.at_level(logging.WARNING):
        with pytest.raises(OutputError, match=r"could not learn whether it honours If-None-Match .*first PUT of the "
                                              r"probe object .*SlowDown") as e:
            OutputDir(out).ensure_writable()
        assert e.value.exit_code == 2 and "127.0.0.1" in str(e.value) and "bkt" in str(e.value)
        proxy.fail_puts.clear()  # the store answers again
        OutputDir(out).ensure_writable()
    assert not [r for r in caplog.records if "does not honour" in r.getMessage()], caplog.records
    proxy.before_put["/part-000000.parquet"] = lambda: write_part(out, 0, _table("A"))
    write_part(out, 0, _table("B"))
    assert _read_part(out) == ["A"] * 3, "copy B replaced the part copy A had committed"
    assert [h for p, h in proxy.puts if p.endswith("/part-000000.parquet")] == ["*", "*"]


def _stale_holder_and_watchers(out: str, *names: str):
    """Driver A holding the lease of `out` as seen from another machine (its record is
    watched), and drivers watching it on injected clocks that take it over once the record
    has stayed unchanged for the lease time, without sleeping (tests/test_lease.py)."""
    from test_lease import Clock

    from jobs.outputs.lease import OutputLease
    from jobs.outputs.output_dir import OutputDir

    od = OutputDir(out)
    od.ensure_writable()
    a = OutputLease(od, "a" * 64, 5)
    a.record["boot_id"] = "another-machine"
    a.acquire()
    others = []
    for name in names:
        lease, clock = OutputLease(od, name * 64, 5), Clock()
        lease.clock, lease.wait = clock.now, clock.wait
        others.append(lease)
    return od, a, others


def test_a_heartbeat_delayed_past_a_takeover_on_s3_cannot_undo_it(proxy_for):
    """Driver A's heartbeat reads its lease, then stalls (a hung connection) for longer than
    the lease time; driver B, watching the unchanged record, takes the lease over. A's write
    then lands: on a store with conditional writes it is refused (If-Match on A's last
    record), so A stops and B keeps the lease (before the fix: A's write replaced B's record,
    A went on and B, the new holder, stopped at its next heartbeat). Likewise A's release,
    reading its record just before B took over, leaves B's lease alone."""
    proxy, out = proxy_for(strip=False, name="lease-beat")
    od, a, (b,) = _stale_holder_and_watchers(out, "b")
    real_read = a.read

    def read_then_b_takes_over():
        seen = real_read()
        b.acquire()
        return seen

    a.read = read_then_b_takes_over
    assert not a.beat(), "A's late heartbeat replaced the lease B took over"
    assert b.took_over and b.read()["token"] == b.token
    assert b.beat() and b.lost is None
    with pytest.raises(Exception, match="taken over by pid"):
        a.check()
    b.release()

    od, a, (b,) = _stale_holder_and_watchers(out, "b")
    a.read = lambda: (real_read.__func__(a), b.acquire())[0]
    a.release()
    assert b.took_over and b.read() is not None and b.read()["token"] == b.token, "A's release removed B's lease"
    assert b.beat()
    b.release()
    assert od.read_text("_batchgen/lease.json") is None


def test_two_drivers_taking_a_stale_lease_over_on_s3_at_once(proxy_for):
    """Drivers B and C both watch a stale lease and take it over at the same moment: C's
    PUT lands just before B's. On a store with conditional writes only the first replaces the
    stale record (If-Match on its ETag): B is refused (exit 2, naming C) and C holds the lease
    (before the fix: B's PUT replaced C's record and both drivers went on running the job)."""
    from jobs.errors import OutputError

    proxy, out = proxy_for(strip=False, name="lease-takeover")
    od, a, (b, c) = _stale_holder_and_watchers(out, "b", "c")
    proxy.before_put["/_batchgen/lease.json"] = c.acquire
    with pytest.raises(OutputError, match=r"in use by another batchgen driver: .*\(job cccccccccccc.*at the same "
                                          r"time") as e:
        b.acquire()
    assert e.value.exit_code == 2
    assert c.took_over and od.read_text("_batchgen/lease.json") and c.read()["token"] == c.token
    assert c.beat()
    c.release()
