"""``python -m sfi``: the command line."""

from sfi.cli import main

if __name__ == "__main__":
    main()
