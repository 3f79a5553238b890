"""`python3 -m kvsim.conformance [--stream NAME ...]`: the same as `kvsim conformance`."""

import sys

from kvsim.cli import app

app(["conformance", *sys.argv[1:]], prog_name="python3 -m kvsim.conformance")
