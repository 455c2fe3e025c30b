"""``python -m sfi.cli``."""

from sfi.cli import main

main()
