"""A supervised engine under healthy steady load for a while; what the supervisor did, as JSON.

    python -m tests.opsctl.soak --seconds 600 --root DIR --out DIR/soak.json

Runs in its own process (tests/opsctl/test_soak.py starts it, in README's soak command, a CI step of its
own), with the policy's default thresholds at a 1 s poll.  Besides the supervisor's decisions it scrapes /metrics
every second and counts the samples in which the seed's instant rule (`waiting > 2 x running`) held.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.opsctl.harness import deployment
from tests.opsctl.load import Load

SOAK_SUPERVISOR = {
    "poll_interval": 1.0,
    "probe_timeout": 5.0,
    "cooldown_seconds": 5.0,
    "hang_seconds": 60.0,
    "event_window": 300.0,
    "events_to_act": 3,
    "max_restarts": 5,
    "restart_window": 900.0,
    "drain_timeout": 60.0,
}


WATCHED = ("vllm_num_requests_waiting", "vllm_num_requests_running")


def _gauges(text: str) -> dict[str, float]:
    """The gauges the instant rule reads, from their lines of the text exposition.  prometheus_client's parser
    took 34 ms of CPU for the engine's whole 76 KB page, once a second for the ten minutes beside the suite."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(WATCHED):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
            if name in WATCHED:
                out[name] = float(value)
    return out


def soak(root: Path, seconds: float, pause: float) -> dict:
    d = deployment(root, supervisor=SOAK_SUPERVISOR)
    (root / "deployment.json").write_text(
        json.dumps({"config": str(d.config), "runtime": str(d.runtime), "port": d.port})
    )
    start = d.opsctl("start")
    if start.returncode != 0:
        return {"error": f"opsctl start: {start.returncode} {start.stderr[-500:]}"}
    load = Load(d.url, clients_per_kind=2, pause_s=pause).start()
    samples = instant_rule = 0
    began = time.monotonic()
    try:
        with httpx.Client(timeout=5) as scraper:
            while time.monotonic() - began < seconds:
                time.sleep(1.0)
                try:
                    g = _gauges(scraper.get(d.url + "/metrics").text)
                except (httpx.HTTPError, ValueError):
                    continue
                samples += 1
                waiting, running = g.get("vllm_num_requests_waiting", 0), g.get("vllm_num_requests_running", 0)
                instant_rule += int(waiting > 0 and waiting > 2 * running)
    finally:
        records = load.stop()
    metrics = d.supervisor_metrics()
    status = d.status()
    d.opsctl("stop")
    d.teardown()
    return {
        "seconds": round(time.monotonic() - began, 1),
        "clients": len(Load.KINDS) * 2,
        "pause_s": pause,
        "requests": len(records),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "polls": metrics.get("pagekeeper_supervisor_polls_total", 0),
        "decisions": {k: v for k, v in metrics.items() if k.startswith("pagekeeper_supervisor_decisions_total") and v},
        "restarts": status["restarts"]["total"],
        "scrapes": samples,
        "scrapes_where_waiting_exceeded_2x_running": instant_rule,
        "last_decision": status["last_decision"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pause", type=float, default=0.25, help="Each client's pause between requests.")
    args = parser.parse_args()
    result = soak(args.root, args.seconds, args.pause)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
