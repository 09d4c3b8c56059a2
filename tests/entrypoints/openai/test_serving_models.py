"""`vlite serve --lora-modules` (both of vLLM's forms, and its errors) and the vllm:lora_requests_info metric,
without a model."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from tests.entrypoints.cli.utils import parse
from vlite.core.sched.stats import SchedulerStats
from vlite.entrypoints.cli.main import build_parser, main
from vlite.entrypoints.openai.serving_models import LoRAModulePath, check_lora_modules, parse_lora_modules
from vlite.metrics import PrometheusStatLogger


def _has_enable_lora() -> bool:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return any("--enable-lora" in a.option_strings for a in serve._actions)


needs_enable_lora = pytest.mark.skipif(not _has_enable_lora(), reason="--enable-lora (the engine flags) is not here")


def test_lora_modules_both_forms():
    ns = parse("serve", "m", "--lora-modules", "sql=/adapters/sql", " chat = /adapters/chat ",
               '{"name": "j", "path": "/adapters/j", "base_model_name": "m"}')
    assert ns.lora_modules == [LoRAModulePath("sql", "/adapters/sql"), LoRAModulePath("chat", "/adapters/chat"),
                               LoRAModulePath("j", "/adapters/j", "m")]
    assert parse("serve", "m").lora_modules is None
    assert parse_lora_modules(['{"name": "a", "path": "/p"}']) == [LoRAModulePath("a", "/p")]


@pytest.mark.parametrize("value, says", [
    ("sql", "expected name=path"),
    ("=/p", "expected name=path"),
    ("sql=", "expected name=path"),
    ("a=b=c", "expected name=path"),
    ('{"name": "a", "path": "/p"', "invalid JSON"),
    ('{"name": "a"}', "path must be"),
    ('{"name": "a", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
    ('{"name": "", "path": "/p"}', "name must be"),
    ('{"name": "a", "path": "/p", "base_model_name": 3}', "base_model_name must be a string"),
])
def test_bad_lora_modules_are_usage_errors(value, says, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("serve", "m", "--lora-modules", value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules:" in err and says in err


def test_lora_module_names_checked_against_served_names(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "m", "--lora-modules", "a=/p", "a=/q")
    assert "adapter name 'a' is given twice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="adapter name 'm' is also a served model name"):
        check_lora_modules([LoRAModulePath("m", "/p")], ["m"])
    with pytest.raises(ValueError, match="base_model_name 'x' is not a served model name"):
        check_lora_modules([LoRAModulePath("a", "/p", "x")], ["m"])
    check_lora_modules([LoRAModulePath("a", "/p", "m")], ["m"])


@needs_enable_lora
def test_lora_modules_need_enable_lora(capsys, monkeypatch):
    import vlite.entrypoints.openai.api_server as api_server

    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *args: calls.append(args) or 0)
    assert main(["serve", "m", "--lora-modules", "a=/p"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err and not calls
    assert main(["serve", "m", "--enable-lora", "--lora-modules", "a=/p"]) == 0
    assert [LoRAModulePath("a", "/p")] in calls[0]  # run_server's lora_modules argument


def _stats(max_lora: int, running: dict[str, int], waiting: dict[str, int]) -> SchedulerStats:
    stats = SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)
    stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters = max_lora, running, waiting
    return stats


def _lora_lines(logger: PrometheusStatLogger) -> list[str]:
    return [line for line in generate_latest(logger.registry).decode().splitlines()
            if line.startswith("vllm:lora_requests_info")]


def test_lora_requests_info_metric():
    logger = PrometheusStatLogger("m")
    logger(_stats(0, {}, {}), None)
    assert _lora_lines(logger) == []  # LoRA off: no such metric (as vLLM)

    before = time.time()
    logger(_stats(2, {"sql": 2, "chat": 1}, {"new": 1}), None)
    [line] = _lora_lines(logger)
    labels, value = line.rsplit(" ", 1)
    assert labels == 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",' \
                     'waiting_lora_adapters="new"}'
    assert before - 1 <= float(value) <= time.time() + 1  # the time of the update

    logger(_stats(2, {}, {}), None)
    lines = _lora_lines(logger)
    assert any('running_lora_adapters="",waiting_lora_adapters=""' in line for line in lines)
