"""The `opsctl` command line (click).

The supervisor commands (start, stop, restart, status, drain, logs, doctor) arrive with the
supervisor; until then the group only reports its version, so that the console script declared in
pyproject.toml resolves on every install.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import click


def _version() -> str:
    try:
        return version("pagekeeper")
    except PackageNotFoundError:
        return "0+unknown"


@click.group()
@click.version_option(_version(), prog_name="opsctl")
def main() -> None:
    """Operate the pagekeeper inference engine."""
