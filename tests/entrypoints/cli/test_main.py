"""`vlite` itself: the subcommands' parsers, their help, and errors as exit statuses."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.cli.utils import parse
from vlite.entrypoints import cli

ENGINE_FLAGS = ["--model", "--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--block-size", "--kv-cache-memory", "--seed", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--scheduling-policy", "--long-prefill-token-threshold",
                "--max-num-partial-prefills", "--chat-template"]
SAMPLING_FLAGS = ["--max-tokens", "--temperature", "--top-p", "--top-k", "--ignore-eos"]
SUBCOMMAND_FLAGS = {
    "generate": ENGINE_FLAGS + SAMPLING_FLAGS + ["--verbose"],
    "chat": ENGINE_FLAGS + SAMPLING_FLAGS + ["--verbose", "--system"],
}


def test_console_script_is_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    module, _, name = pyproject["project"]["scripts"]["vlite"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


def test_verbose_before_or_after_the_subcommand():
    assert parse("generate", "x").verbose is False
    assert parse("-v", "generate", "x").verbose is True
    assert parse("generate", "x", "--verbose").verbose is True


@pytest.mark.parametrize("command", sorted(SUBCOMMAND_FLAGS))
def test_help_mentions_every_flag(command, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(command, "--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in SUBCOMMAND_FLAGS[command]:
        assert flag in text, flag


def test_every_option_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"generate", "chat"} <= set(subparsers.choices)
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"


def test_bad_temperature_subprocess_exit_code():
    proc = subprocess.run([sys.executable, "-m", "vlite", "generate", "hi", "--temperature", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
