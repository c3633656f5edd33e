"""`redserve inspect`: its options and its entry point.

Only argparse is imported here, so that `redserve --help` and the other commands do not pay
for the inspector's imports; `run` loads them (see view.py).
"""

from __future__ import annotations

import argparse

from ops.options import positive, positive_float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds "
                   "until Ctrl-C (with --json: one document a line per refresh)")
    p.add_argument("--interval", type=positive_float, default=2.0, metavar="S",
                   help="seconds between refreshes under --watch (default 2)")
    p.add_argument("--count", type=positive, metavar="N",
                   help="under --watch, stop after this many refreshes (default: until Ctrl-C)")
    p.add_argument("--json", action="store_true", help="print one JSON document (the same "
                   "figures as the tables) instead of tables")
    p.add_argument("--model", dest="only_model", metavar="M", help="only this model's "
                   "requests, queue and workers")
    p.add_argument("--limit", type=positive, default=200, metavar="N",
                   help="most requests listed, oldest first; the rest are counted (default 200)")
    p.add_argument("--key-prefix", metavar="P", help="the deployment's key prefix (default rs) "
                   "[env REDSERVE_KEY_PREFIX]")


def run(args: argparse.Namespace) -> int:
    """The exit status: 0, or 2 for a bad setting or a Redis that cannot be reached."""
    from ops.inspector.view import show

    return show(args)

