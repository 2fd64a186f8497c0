"""The engine core in its own process, behind a front that keeps the clients' requests when it dies.

The front (the server process: HTTP, tokenization, detokenization, streams) talks to the core (scheduler and
model) over a socket pair with plain-data messages (messages.py).  When the core dies (killed, a fatal device
error, a hang the front detects), the front starts a new one and hands it every request in flight again, as its
prompt plus the tokens already produced (remote.py, inflight.py): clients see a pause, not an error.
"""
