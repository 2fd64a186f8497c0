"""Names and numbers that more than one part of opsctl must agree on, defined once.

The supervisor, the launchers, the CLI and the tests' harness all find each other through files in an
instance's runtime dir (where that dir is: `opsctl/instances.py` `runtime_dir_for`), and a name spelled
twice is a name that drifts.  Likewise the exit codes other programs act on and the default timeouts of
the control channels.
"""

from __future__ import annotations

# -- files in the runtime dir ----------------------------------------------------------------------
SOCKET_NAME = "supervisor.sock"  # the supervisor's control socket (opsctl -> daemon), mode 0600
PID_NAME = "supervisor.pid"
LOCK_NAME = "supervisor.lock"  # flock: one supervisor per runtime dir
LAST_FAILURE_NAME = "last_failure.json"  # why a supervisor exited before the engine served
ENGINE_LOG_NAME = "engine.log"  # process launcher only (journald under systemd)
SUPERVISOR_LOG_NAME = "supervisor.log"
ENGINE_CONFIG_NAME = "engine.toml"  # the [engine] section the supervisor checked, as its engines read it (--config)
ENGINE_STATE_NAME = "engine.json"  # the engine that serves (pid, control socket): a successor adopts it
INSTANCE_FILE_NAME = "instance.json"  # the ports an instance claims (opsctl/instances.py)
RESTARTS_NAME = "restarts.json"  # the restarts so far: a supervisor that adopts the engine goes on counting

# -- exit codes ------------------------------------------------------------------------------------
EXIT_CONFIG_ERROR = 2  # the engine's "a person must fix this": never retried
EXIT_PERMANENT = 2  # the supervisor's: the engine cannot start until a person fixes something
EXIT_ALREADY_RUNNING = 75  # another supervisor holds this runtime dir (EX_TEMPFAIL)

# -- default timeouts (seconds) --------------------------------------------------------------------
COMMAND_TIMEOUT_S = 900.0  # one control-socket command (restart, stop) unless the caller says otherwise
STATUS_TIMEOUT_S = 10.0  # `status` over the control socket
ENGINE_CONTROL_TIMEOUT_S = 3.0  # one request on an engine's private control socket
STOP_NOW_GRACE_S = 5.0  # a stop-now engine gets this long before SIGKILL
ADOPT_TIMEOUT_S = 5.0  # receiving the listening socket from an engine a dead supervisor left

# How long an observation waits for the launcher to reap an engine the process probe already saw gone
# (a zombie main thread whose other threads are still exiting), so that it knows the exit code.
EXIT_SETTLE_S = 3.0
