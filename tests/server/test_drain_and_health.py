"""Must-show 3 and 4: drain under load on SIGTERM, and /health that sees a frozen step loop."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.harness import start_server

MODEL = "pagekeeper-default"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    """One server with the default flags for the tests that need nothing else; each leaves it as it found it, but
    the last, which stops it (file order)."""
    server = start_server(tmp_path_factory.mktemp("default"))
    yield server
    server.kill()


def _stream_tokens(url: str, max_tokens: int, out: list, idx: int) -> None:
    body = {
        "model": MODEL,
        "prompt": "Errors should",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            usage = None
            done = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    usage = json.loads(line[6:]).get("usage") or usage
            out[idx] = (r.status_code, done, usage and usage["completion_tokens"])
    except httpx.HTTPError as e:
        out[idx] = ("error", repr(e))


def test_sigterm_drains_in_flight_streams_refuses_new_work_and_exits_0(launch):
    server = launch("--max-num-seqs", "4", "--drain-timeout", "120")
    results: list = [None] * 8
    threads = [threading.Thread(target=_stream_tokens, args=(server.url, 240, results, i)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # all 8 admitted (4 running, 4 waiting)
        m = httpx.get(server.url + "/metrics").text
        if (
            'vllm_num_requests_running{model_name="pagekeeper-default"} 4.0' in m
            and 'vllm_num_requests_waiting{model_name="pagekeeper-default"} 4.0' in m
        ):
            break
        time.sleep(0.01)
    server.proc.send_signal(15)
    time.sleep(0.3)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    late = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert late.status_code == 503 and late.headers["retry-after"]
    assert late.json()["error"]["code"] == "draining"
    assert 'vllm_engine_draining{model_name="pagekeeper-default"} 1.0' in httpx.get(server.url + "/metrics").text
    for t in threads:
        t.join(120)
    assert results == [(200, True, 240)] * 8
    stopped_at = None
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        if stopped_at is None and '"event": "stopped"' in server.log():
            stopped_at = time.monotonic()
        time.sleep(0.01)
    exit_s = time.monotonic() - (stopped_at or time.monotonic())
    print(f'\nexited {exit_s:.2f} s after its last log line ("stopped")')
    assert server.proc.wait(30) == 0
    assert '"reason": "drained"' in server.log()
    # The interpreter's teardown with torch loaded took about 2 s on a 2-core host; the engine skips it (0.1 s on an
    # idle machine; a CI run under the suite's load measured 0.66 s).  Which exit is cheaper is checked in CPU
    # seconds by tests/benchmarks/test_startup_phases.py; here, the bound a restart waits for.
    assert exit_s < 2.0


def test_drain_endpoint_reports_counts_and_can_be_undone(default_server):
    server = default_server
    r = httpx.post(server.url + "/drain", params={"timeout": 5})
    assert r.status_code == 200 and r.json()["drained"] is True and r.json()["in_flight"] == 0
    assert httpx.get(server.url + "/health").status_code == 503
    assert httpx.delete(server.url + "/drain").status_code == 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_health_turns_stalled_when_the_step_loop_freezes(launch):
    server = launch("--enable-debug-hooks", "--health-stall-seconds", "1")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    results: list = [None]
    worker = threading.Thread(target=_stream_tokens, args=(server.url, 200, results, 0))
    worker.start()
    time.sleep(0.2)
    assert httpx.post(server.url + "/debug/freeze", params={"seconds": 4}).status_code == 200
    frozen_at = time.monotonic()
    status = None
    while time.monotonic() - frozen_at < 3.5:
        r = httpx.get(server.url + "/health")
        if r.status_code == 503:
            status = r.json()["status"]
            break
        time.sleep(0.05)
    detected_after = time.monotonic() - frozen_at
    assert status == "stalled"
    assert detected_after < 1 + 1.0, detected_after  # within the window plus one poll
    # requests piling up behind the frozen loop show in the waiting gauge (read live at scrape time)
    late: list = [None]
    queued = threading.Thread(target=_stream_tokens, args=(server.url, 4, late, 0))
    queued.start()
    time.sleep(0.3)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'vllm_num_requests_waiting{model_name="pagekeeper-default"} 1.0' in metrics
    queued.join(60)
    assert late[0] == (200, True, 4)
    worker.join(60)
    assert results[0] == (200, True, 200)  # the request survives the freeze
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_debug_hooks_are_off_by_default(default_server):
    server = default_server
    assert httpx.post(server.url + "/debug/freeze", params={"seconds": 1}).status_code == 404
    assert httpx.post(server.url + "/debug/block-http-loop", params={"seconds": 1}).status_code == 404
    assert httpx.post(server.url + "/debug/metrics", params={"mode": "garbage"}).status_code == 404


def _complete_raw(port: int, out: list, idx: int) -> None:
    """One completion over a fresh connection, the way a load balancer's client sends it; the outcome."""
    body = json.dumps({"model": MODEL, "prompt": "Beautiful is", "max_tokens": 8, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        resp.read()
        out[idx] = f"http {resp.status}"
    except Exception as e:  # a reset: the connection was accepted and then dropped
        out[idx] = f"error {e!r}"
    finally:
        conn.close()


def test_sigterm_with_an_inherited_socket_answers_every_connection_already_accepted(launch):
    """Connections and SIGTERM arriving while the HTTP loop is busy are handled in one loop iteration:
    asyncio accepts the connections, and the drain must not close the server before their transports
    attach, or they are reset with their requests unread (seen as 3 resets in the systemd restart test
    on a loaded 2-core host).  Every such request is admitted and answered; the socket stays open for
    the next engine."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    server = launch(
        "--listen-fd",
        str(listener.fileno()),
        "--enable-debug-hooks",
        "--drain-timeout",
        "60",
        port=port,
        pass_fds=(listener.fileno(),),
    )
    try:
        blocker = threading.Thread(
            target=lambda: httpx.post(server.url + "/debug/block-http-loop", params={"seconds": 1.5}, timeout=30)
        )
        blocker.start()
        time.sleep(0.3)  # the loop is now held
        results: list = [None] * 6
        clients = [threading.Thread(target=_complete_raw, args=(port, results, i)) for i in range(6)]
        for c in clients:
            c.start()
        time.sleep(0.3)  # their requests sit in the kernel's queues
        server.proc.send_signal(signal.SIGTERM)  # handled while the loop is still held
        for c in clients:
            c.join(60)
        blocker.join(30)
        assert server.proc.wait(60) == 0, server.log()[-3000:]
        assert results == ["http 200"] * 6, results
    finally:
        listener.close()


def test_a_stream_under_way_at_a_handover_leaves_its_connection_open_for_the_clients_next_request(launch):
    """A stream that started before SIGTERM sent its headers without `Connection: close`, so its client pools the
    connection and reuses it at once.  Closed the moment the stream ended, a request sent into it then was reset
    (CI: two ReadErrors, counted nowhere).  The connection stays open until it is idle; the next request on it is
    answered, with `Connection: close`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    server = launch(
        "--listen-fd", str(listener.fileno()), "--drain-timeout", "60", port=port, pass_fds=(listener.fileno(),)
    )
    headers = {"Content-Type": "application/json"}
    stream = {"model": MODEL, "prompt": "Errors should", "max_tokens": 200, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(stream), headers)
        first = conn.getresponse()
        assert first.status == 200 and first.getheader("connection") is None
        assert first.read(6) == b"data: "  # under way
        server.proc.send_signal(signal.SIGTERM)
        rest = first.read().decode()
        assert rest.rstrip().endswith("data: [DONE]"), rest[-200:]
        time.sleep(0.3)  # the client sends its next request a little later than at once
        second = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 4, "temperature": 0}
        try:
            conn.request("POST", "/v1/completions", json.dumps(second), headers)
            reply = conn.getresponse()
            outcome = (
                reply.status,
                reply.getheader("connection"),
                json.loads(reply.read())["usage"]["completion_tokens"],
            )
        except (OSError, http.client.HTTPException) as e:
            outcome = ("error", repr(e))
        print(f"\nthe next request on the streamed connection, sent 0.3 s after the stream ended: {outcome}")
        assert outcome == (200, "close", 4)
        assert server.proc.wait(60) == 0, server.log()[-3000:]
        assert '"in_flight": 1, "event": "handover_started"' in server.log()  # the stream was under way then
    finally:
        conn.close()
        listener.close()


def test_a_request_whose_connection_closed_before_its_body_arrived_is_not_logged_as_one(default_server):
    """A connection closed mid-body (a client killed while sending; connections cut at shutdown) was logged as an
    `http_request` with status 400: FastAPI's answer to a body it could not read, which nobody received.  Stops the
    shared server: the file's last test on it."""
    server = default_server
    at = len(server.log())  # what the earlier tests on this server logged is theirs
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    cut = socket.create_connection(("127.0.0.1", server.port))
    cut.sendall(head + b'{"model":')
    time.sleep(0.3)
    cut.close()  # the client goes away mid-body
    body = {"model": "pagekeeper-default", "prompt": "Now is", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    pending = socket.create_connection(("127.0.0.1", server.port))
    pending.sendall(head + b'{"model":')  # still sending when the server stops
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 0
    pending.close()
    logged = [json.loads(ln) for ln in server.log()[at:].splitlines() if '"http_request"' in ln]
    print([(e["path"], e["status"]) for e in logged])
    assert [(e["path"], e["status"]) for e in logged] == [("/v1/completions", 200)]
