"""`python3 -m kvsim.conformance [--stream NAME ...]`: the same as `kvsim conformance`, without the CLI."""

import argparse
import sys

from kvsim.conformance.suite import run_suite
from kvsim.errors import KvsimError

parser = argparse.ArgumentParser(prog="python3 -m kvsim.conformance", description=__doc__)
parser.add_argument("--stream", "-s", action="append", help="Run only this stream (repeat for several; default: all).")
args = parser.parse_args()
try:
    sys.exit(run_suite(args.stream, echo=print))
except KvsimError as exc:
    print(f"kvsim: error: {exc}", file=sys.stderr)
    sys.exit(2)
