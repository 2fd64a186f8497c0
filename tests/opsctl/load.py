"""Steady client load for the supervisor's fault tests: every request recorded with its outcome.

Clients are real HTTP clients in threads, each looping over one kind of request for a bounded time:
streaming or not, on a kept-alive connection or a new connection per request.  An outcome is "ok"
only when the response is complete (all `max_tokens` tokens; a stream ends with [DONE]), so a stream
cut off halfway or an error event counts as what it is.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL = "pagekeeper-default"
MAX_TOKENS = 12


@dataclass
class Record:
    client: str
    start: float
    end: float
    outcome: str  # ok | http_<code> | refused | reset | timeout | truncated | error_event | <exception name>
    detail: str = ""

    def in_flight_at(self, t: float) -> bool:
        return self.start <= t <= self.end


def _classify(e: Exception) -> str:
    if isinstance(e, httpx.ConnectError):
        return "refused"
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "reset"
    return type(e).__name__


@dataclass
class Load:
    url: str
    clients_per_kind: int = 2
    pause_s: float = 0.02
    timeout_s: float = 90.0
    headers: dict[str, str] = field(default_factory=dict)  # e.g. the API key's Authorization header
    records: list[Record] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    KINDS = ("plain-keepalive", "plain-new", "stream-keepalive", "stream-new")

    def start(self) -> Load:
        for kind in self.KINDS:
            for i in range(self.clients_per_kind):
                t = threading.Thread(target=self._client, args=(f"{kind}-{i}", kind), daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def burst(self, n: int, max_tokens: int) -> list[threading.Thread]:
        """`n` one-off requests at once on new connections (a queue the engine cannot serve at once)."""

        def one(i: int) -> None:
            body = _body("Errors should never", max_tokens, stream=False)
            start = time.monotonic()
            try:
                with httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=self.headers) as c:
                    r = c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    outcome, detail = f"http_{r.status_code}", r.text[:200]
                else:
                    tokens = r.json()["usage"]["completion_tokens"]
                    outcome, detail = ("ok", "") if tokens == max_tokens else ("truncated", f"{tokens} tokens")
            except Exception as e:  # noqa: BLE001
                outcome, detail = _classify(e), repr(e)[:200]
            with self._lock:
                self.records.append(Record(f"burst-{i}", start, time.monotonic(), outcome, detail))

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        self._threads.extend(threads)
        return threads

    def hold_stream(self, max_tokens: int = 240) -> threading.Event:
        """One long stream on a new connection, recorded as "held-stream" like the others; the event is set once
        its first token arrived: a request certainly in the engine's hands (a fault test's kill -9 then has one in
        flight, however short the steady load's requests are)."""
        started = threading.Event()

        def hold() -> None:
            body = _body("Errors should never", max_tokens, stream=True)
            start = time.monotonic()
            outcome, detail, chunks, done = "ok", "", 0, False
            try:
                with (
                    httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=self.headers) as c,
                    c.stream("POST", "/v1/completions", json=body) as r,
                ):
                    if r.status_code != 200:
                        r.read()
                        outcome, detail = f"http_{r.status_code}", r.text[:200]
                    else:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith("data: {"):
                                chunks += 1
                                started.set()
                        if not done:
                            outcome, detail = "truncated", f"{chunks} chunks, no [DONE]"
            except Exception as e:  # noqa: BLE001
                outcome, detail = _classify(e), repr(e)[:200]
            with self._lock:
                self.records.append(Record("held-stream", start, time.monotonic(), outcome, detail))

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        self._threads.append(t)
        return started

    def stop(self) -> list[Record]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        return list(self.records)

    def _client(self, name: str, kind: str) -> None:
        stream = kind.startswith("stream")
        keepalive = kind.endswith("keepalive")
        client = httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=self.headers) if keepalive else None
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                body = _body(f"Beautiful is {n % 7}", MAX_TOKENS, stream)
                c = client or httpx.Client(base_url=self.url, timeout=self.timeout_s, headers=self.headers)
                start = time.monotonic()
                try:
                    outcome, detail = (self._stream if stream else self._plain)(c, body)
                except Exception as e:  # noqa: BLE001 - every failure is an outcome to count
                    outcome, detail = _classify(e), repr(e)[:200]
                finally:
                    if client is None:
                        c.close()
                with self._lock:
                    self.records.append(Record(name, start, time.monotonic(), outcome, detail))
                time.sleep(self.pause_s)
        finally:
            if client is not None:
                client.close()

    @staticmethod
    def _plain(c: httpx.Client, body: dict) -> tuple[str, str]:
        r = c.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"http_{r.status_code}", r.text[:200]
        tokens = r.json()["usage"]["completion_tokens"]
        return ("ok", "") if tokens == MAX_TOKENS else ("truncated", f"{tokens} tokens")

    @staticmethod
    def _stream(c: httpx.Client, body: dict) -> tuple[str, str]:
        chunks = 0
        done = False
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return f"http_{r.status_code}", r.text[:200]
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "error_event", str(event["error"])[:200]
                    chunks += 1
        if not done:
            return "truncated", f"{chunks} chunks, no [DONE]"
        return "ok", ""


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    """A greedy completion request of exactly `max_tokens` tokens."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def tally(records: list[Record]) -> Counter:
    return Counter(r.outcome for r in records)
