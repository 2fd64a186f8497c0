"""opsctl: start, supervise, drain and restart the pagekeeper engine."""
