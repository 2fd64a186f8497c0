"""How long the supervisor believes an engine that says it is stopping on its own (an operator's SIGTERM).

The engine's real control socket answers here; the engine process around it is left out, so that the deadline can be
moved in milliseconds.  tests/opsctl/test_supervisor_faults.py covers the same with real engines and a supervisor.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from engine.lifecycle import Lifecycle, Phase
from engine.server.control import ControlSocket
from opsctl import launcher
from opsctl.launcher import EngineProcess


@pytest.fixture
def channel(tmp_path):
    listen = socket.socket()
    cs = ControlSocket(tmp_path / "eng.sock", listen, Lifecycle())
    yield cs, EngineProcess(os.getpid(), tmp_path / "eng.sock", tmp_path / "eng.inflight", popen=None)
    cs.close()
    listen.close()


def test_serving_or_loading_is_not_stopping(channel):
    cs, engine = channel
    assert cs.state == "loading"
    assert engine.stopping_within_deadline() is None
    cs.lifecycle.move(Phase.SERVING)
    assert engine.stopping_within_deadline() is None


def test_stopping_is_believed_until_its_deadline_and_margin_even_after_the_socket_is_gone(channel, monkeypatch):
    # The margin is most of the time between the checks: the two calls before the sleep (a control-socket round
    # trip, the socket's close) must end within it, however slowly a loaded host runs them (with 0.3 s, 0.15 s left).
    monkeypatch.setattr(launcher, "STOPPING_MARGIN_S", 1.0)
    cs, engine = channel
    cs.lifecycle.move(Phase.HANDING_OVER)
    cs.stop_deadline = time.monotonic() + 0.3
    assert engine.stopping_within_deadline() == "handing_over"
    cs.close()  # an exiting engine closes it before the interpreter's silent teardown
    assert engine.stopping_within_deadline() == "handing_over"  # remembered
    time.sleep(0.45)
    assert engine.stopping_within_deadline() == "handing_over"  # past the deadline, within the margin
    time.sleep(1.0)
    assert engine.stopping_within_deadline() is None  # past both: a silent engine may be hung again


def test_a_later_answer_moves_the_deadline(channel, monkeypatch):
    monkeypatch.setattr(launcher, "STOPPING_MARGIN_S", 0.0)
    cs, engine = channel
    cs.lifecycle.move(Phase.SERVING)
    cs.lifecycle.move(Phase.DRAINING)
    cs.stop_deadline = time.monotonic() - 1.0
    assert engine.stopping_within_deadline() is None  # it overran its own drain deadline
    cs.lifecycle.move(Phase.STOPPING)
    cs.stop_deadline = time.monotonic() + 5.0  # then a stop-now: a new deadline
    assert engine.stopping_within_deadline() == "stopping"
