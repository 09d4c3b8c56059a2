"""`vlite serve`: the OpenAI-compatible HTTP server (vlite/entrypoints/openai/), its engine core in its own process."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any, Optional, Sequence

from vlite.entrypoints.cli.args import (add_common_args, add_engine_args, engine_args_from_cli, non_negative_int,
                                        parse_size, positive_int)
from vlite.entrypoints.cli.engine import configure_quiet


class LoRAModulesAction(argparse.Action):
    """--lora-modules: each value `name=path` or vLLM's JSON object; a malformed one is argparse's usage error
    naming the flag (checked without loading anything)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Optional[Sequence[str] | str], option_string: Optional[str] = None) -> None:
        from vlite.entrypoints.openai.serving_models import parse_lora_modules

        items = [values] if isinstance(values, str) else list(values or [])
        try:
            modules = parse_lora_modules(items)
        except ValueError as e:
            parser.error(f"argument {option_string or '--lora-modules'}: {e}")
        setattr(namespace, self.dest, modules)


def _json_kwargs(value: str) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object (argparse reports the ValueError as a usage error)."""
    from vlite.entrypoints.openai.serving_chat import check_template_kwargs

    try:
        return check_template_kwargs(json.loads(value), "--default-chat-template-kwargs")
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /version, /metrics, /tokenize, /detokenize). The engine core runs in "
                    "its own process.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model); default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=positive_int, default=8000, help="port to bind (default: %(default)s)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients use in the `model` field; default: the model argument")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every route but /health, /metrics and "
                             "/version (also read from VLITE_API_KEY)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default: %(default)s)")
    parser.add_argument("--max-request-body-bytes", type=parse_size, default=4 * 2**20, metavar="BYTES",
                        help="reject larger request bodies with 413 (default: 4MiB)")
    parser.add_argument("--trust-request-chat-template", action="store_true", default=False,
                        help="let requests bring their own chat_template (client-written Jinja, rendered in a "
                             "sandbox but able to burn CPU/memory); off by default")
    parser.add_argument("--log-prompts", action="store_true", default=False,
                        help="log each request's prompt (off by default: prompts are never logged otherwise)")
    parser.add_argument("--max-waiting-requests", type=non_negative_int, default=1024, metavar="N",
                        help="requests that may wait beyond the running batch; more get 503 with Retry-After "
                             "(default: %(default)s)")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model writes tool calls, to read them into `tool_calls`: hermes "
                             "(<tool_call> JSON blocks: Qwen 2.5/3, Hermes and many fine-tunes), llama3_json "
                             "(Llama 3.x JSON calls) or openai (gpt-oss's harmony calls to functions.NAME)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                        help='allow tool_choice "auto" (the default when a request has tools): the model decides '
                             "whether to call, its output read with --tool-call-parser")
    parser.add_argument("--default-chat-template-kwargs", type=_json_kwargs, default=None, metavar="JSON",
                        help='keyword arguments every chat request passes to the chat template, e.g. '
                             '\'{"enable_thinking": false}\'; a request\'s chat_template_kwargs override them')
    parser.add_argument("--lora-modules", nargs="+", action=LoRAModulesAction, default=None, metavar="LORA",
                        help="LoRA adapters (PEFT folders) to serve as models of their own, loaded at start-up; "
                             "needs --enable-lora. Each `name=path` or a JSON object "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'. Requests pick one with "
                             "`model: name`; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, /v1/load_lora_adapter and "
                             "/v1/unload_lora_adapter add and remove them at runtime")
    add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(ns: argparse.Namespace) -> int:
    from vlite.entrypoints.openai.api_server import run_server

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"model given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    if ns.lora_modules and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine runs LoRA adapters only with it on)")
    configure_quiet(ns.verbose)
    logging.getLogger("vlite").setLevel(logging.INFO if ns.verbose else logging.WARNING)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(message)s")
    return run_server(engine_args_from_cli(ns), ns.host, ns.port, ns.served_model_name, ns.api_key,
                      ns.uvicorn_log_level, ns.max_request_body_bytes, ns.max_waiting_requests, ns.log_prompts,
                      ns.trust_request_chat_template, ns.tool_call_parser, ns.enable_auto_tool_choice,
                      ns.lora_modules, ns.default_chat_template_kwargs)
