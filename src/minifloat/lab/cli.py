"""`python -m minifloat COMMAND`: the project's command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minifloat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="quantize a tensor in every format and compare")
    demo.add_argument("--rows", type=int, default=1024)
    demo.add_argument("--cols", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .showcase import print_showcase

        print_showcase(args.rows, args.cols)
    return 0
