"""The `vlite` command line: `vlite generate`, `vlite chat`, `vlite serve`, `vlite bench <name>`.

Layout, so a new subcommand is one small module:

    args.py      the flags and their validators: `add_engine_args(parser)` adds the engine flags
                 (vLLM's names, mirroring `EngineArgs`) and `engine_args_from_cli(ns)` turns them back
                 into an `EngineArgs`; the sampling flags; `positive_int`, `parse_size`, ...
                 (the benchmarks' flags use them too)
    engine.py    loading the engine from the flags, streaming one request, the exit statuses
    generate.py, chat.py, serve.py, bench.py
                 one subcommand each: `add_parser(subparsers)` adds its parser and sets `handler=`
                 to the function that runs it (the parsed namespace in, the exit status out)
    main.py      `build_parser()` over `SUBCOMMANDS`, and `main(argv)`: the console script and
                 `python -m vlite`
"""

from vlite.entrypoints.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
