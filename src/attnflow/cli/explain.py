"""`attnflow explain` (stub: filled in by its owner)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("explain", help="(not yet implemented)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
