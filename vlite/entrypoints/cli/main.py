"""The `vlite` entry point: the parser of every subcommand, and `main`, which runs the one named.

Errors the engine reports as ValueError print `error: <message>` on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Optional

from vlite.entrypoints.cli.bench import add_parser as add_bench
from vlite.entrypoints.cli.chat import add_parser as add_chat
from vlite.entrypoints.cli.engine import EXIT_INTERRUPTED, EXIT_USAGE
from vlite.entrypoints.cli.generate import add_parser as add_generate
from vlite.entrypoints.cli.serve import add_parser as add_serve

# Each adds its subcommand's parser to the subparsers, with `handler=` set; in the order `vlite --help` lists them.
SUBCOMMANDS = (add_generate, add_chat, add_bench, add_serve)


def build_parser() -> argparse.ArgumentParser:
    from vlite import __version__

    parser = argparse.ArgumentParser(prog="vlite", description="vlite: a small LLM inference engine on vLLM's "
                                                               "V1 design.")
    parser.add_argument("--version", action="version", version=f"vlite {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", default=False,
                        help="show the engine's log and the libraries' warnings while loading")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for adder in SUBCOMMANDS:
        adder(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.handler(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Output piped into something that stopped reading (`| head`): not an error worth a traceback.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 0
