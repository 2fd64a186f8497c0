"""`python -m opsctl` is the same as the `opsctl` command."""

from opsctl.cli import main

main()
