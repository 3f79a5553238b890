"""`python -m kvsim` runs the CLI."""

from kvsim.cli import main

main()
