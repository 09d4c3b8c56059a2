"""`vlite bench <name>`: one sub-subcommand per benchmark of `vlite.benchmarks.BENCHMARKS`."""

from __future__ import annotations

import importlib
from typing import Any

from vlite.benchmarks import BENCHMARKS


def add_parser(subparsers: Any) -> None:
    """Add `bench` with one sub-subcommand per benchmark to the `vlite` subparsers.

    The benchmark modules are imported here, not at the top: they import this package's flags.
    """
    parser = subparsers.add_parser(
        "bench", help="benchmark vlite: " + ", ".join(BENCHMARKS),
        description="Benchmarks (the convention of `vllm bench`). Each prints a report; --output-json saves it.")
    bench_subparsers = parser.add_subparsers(dest="bench_name", metavar="BENCHMARK", required=True,
                                             help="the benchmark to run")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = bench_subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_cli_args(sub)
        sub.set_defaults(handler=module.main)
