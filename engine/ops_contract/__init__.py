"""What the engine and the ops kit (opsctl) agree on, in one place both import.

- control.py: the client of an engine's private control socket (the server's end: engine/server/control.py);
- inflight.py: the in-flight file an engine publishes while it drains;
- sockets.py: binding the listening socket, inheriting it (systemd's LISTEN_FDS, a predecessor's handover), and
  finding who holds a port;
- secrets.py: the API and admin keys, their key files and the one rule for which value wins.

It sits just above the engine's foundation: the HTTP server and opsctl import it, and it imports neither.
"""
