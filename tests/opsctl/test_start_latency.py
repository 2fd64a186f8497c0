"""`opsctl start` returns when the engine serves, not at the supervisor's next poll: with the default 10 s poll a
start waited up to 10 s more than the engine took.  Here the poll is a minute: a start must not wait for it."""

from __future__ import annotations

import time


def test_start_returns_as_the_engine_serves_not_at_the_next_poll(deploy):
    d = deploy(supervisor={"poll_interval": 60.0, "hang_seconds": 180.0})
    started = time.monotonic()
    r = d.opsctl("start", timeout=120)
    took = time.monotonic() - started
    print(f"opsctl start with a 60 s poll: {took:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 45, f"opsctl start took {took:.1f} s: it waited for the next poll"
    assert d.status()["engine"]["state"] == "serving"
