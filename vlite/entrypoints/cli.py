"""The `vlite` command line: `vlite generate`, `vlite chat`, `vlite serve`, `vlite bench <name>`.

Layout, so a new subcommand is one small function:

* `add_engine_args(parser)` adds the engine flags (vLLM's names), mirroring `EngineArgs`;
  `engine_args_from_cli(ns)` turns the parsed namespace back into an `EngineArgs`.
* Each subcommand is a function decorated with `@subcommand`; it receives the subparsers
  object, adds its parser and sets `handler=` to the function that runs it. The handler
  gets the parsed namespace and returns the exit status.

Errors the engine reports as ValueError print `error: <message>` on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from dataclasses import fields
from typing import Any, Callable, Optional

from vlite.config import QUANTIZATION_CHOICES
from vlite.engine.arg_utils import EngineArgs
from vlite.sampling_params import RequestOutputKind, SamplingParams

EXIT_USAGE = 2  # argparse's status for bad arguments; used for every user error
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

_ENGINE_DEFAULTS = EngineArgs()

# --------------------------------------------------------------------------------------------------
# Engine flags
# --------------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """A byte count: `1073741824`, `512M`, `1G`, `1GiB`, `1.5G` (binary units), or `500MB` (decimal).

    A bare suffix (K, M, G, T, case-insensitive) and the IEC forms (KiB, MiB, ...) are powers of
    1024, as memory sizes usually are; only the SI forms with a `B` and no `i` (KB, MB, GB, TB)
    are powers of 1000.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a suffix like 512M, 1G, 1GiB")
    number, unit, iec, byte = match.groups()
    unit = unit.lower()
    if iec and not unit:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use bytes or a suffix like 512M, 1G, 1GiB")
    base = 1000 if (byte and not iec and unit) else 1024
    value = int(float(number) * base ** _SIZE_POWERS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


# CLI dest -> EngineArgs field, where the names differ.
_FIELD_FOR_DEST = {"kv_cache_memory": "kv_cache_memory_bytes"}


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (one per `EngineArgs` field, vLLM's names) to `parser`."""
    d = _ENGINE_DEFAULTS
    group = parser.add_argument_group("engine options")
    group.add_argument("--model", default=d.model, metavar="MODEL",
                       help="a .gguf file, a folder (Hugging Face safetensors or one .gguf) or a Hugging Face "
                            "repo id; default: the bundled SmolLM2-135M-Instruct")
    group.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                       help="weight and activation dtype; auto picks bfloat16 on a GPU, where the CPU has native "
                            "bf16, and for quantized weights (the integer kernels), else float32 "
                            "(default: %(default)s)")
    group.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATION_CHOICES,
                       help="weight-only quantization of the linear layers: int8 (per channel) or int4 (groups "
                            "of 32; LM head int8) for every step, or none (dense --dtype weights). Default: "
                            "automatic: a Q4_1 GGUF model in bfloat16 keeps its own 4-bit weights for steps of "
                            "at most 16 tokens (memory-bound decoding) and dense weights above; else dense")
    group.add_argument("--max-model-len", type=_positive_int, default=d.max_model_len, metavar="N",
                       help="most tokens (prompt + output) of one request; default: the model's limit, capped by "
                            "the KV cache")
    group.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs, metavar="N",
                       help="most requests running at once (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=d.max_num_batched_tokens,
                       metavar="N", help="token budget of one engine step (default: %(default)s)")
    group.add_argument("--block-size", type=_positive_int, default=d.block_size, metavar="N",
                       help="tokens per KV cache block (default: %(default)s)")
    group.add_argument("--kv-cache-memory", type=parse_size, default=d.kv_cache_memory_bytes, metavar="BYTES",
                       help="size of the KV cache pool in bytes; accepts suffixes: 512M, 1G, 1GiB (powers of "
                            "1024), 500MB (powers of 1000); default: room for 16,384 tokens, at most 512MiB (360MiB "
                            "for the default model in bfloat16)")
    group.add_argument("--seed", type=int, default=d.seed, metavar="SEED",
                       help="random seed of the engine, and so of sampling (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV cache of shared prompt prefixes (default: on)")
    group.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                       help="order of waiting requests: first come first served, or by priority "
                            "(default: %(default)s)")
    group.add_argument("--long-prefill-token-threshold", type=_non_negative_int,
                       default=d.long_prefill_token_threshold, metavar="N",
                       help="cap on the tokens of one prompt prefilled in one step; 0: no cap "
                            "(default: %(default)s)")
    group.add_argument("--max-num-partial-prefills", type=_positive_int, default=d.max_num_partial_prefills,
                       metavar="N", help="prompts that may be partway through prefill at once (default: %(default)s)")
    group.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=d.tensor_parallel_size,
                       metavar="N", help="ranks each layer's weights and KV cache are split over, one worker "
                                         "process each (default: %(default)s)")
    group.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=d.data_parallel_size, metavar="N",
                       help="engine cores (each a whole copy of the model, with its own tensor parallelism) behind "
                            "one API server; each request goes to the least loaded (default: %(default)s)")
    group.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend,
                       choices=["uni", "mp", "ray"],
                       help="where the model runs: uni (in the engine-core process), mp (worker processes on "
                            "this machine, torch.distributed/gloo between them); default: uni for one rank, "
                            "mp for more; ray: one Ray actor per rank, on the cluster RAY_ADDRESS names or a local "
                            "one (needs the ray extra)")
    group.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                       help='speculative decoding, as a JSON object with vLLM\'s keys, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                            "(n-gram prompt lookup; default: off)")
    group.add_argument("--chat-template", default=d.chat_template, metavar="TEMPLATE",
                       help="a Jinja chat template, as a file path or a literal template string; "
                            "default: the model's own")
    group.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                       help="where the model runs; auto: CUDA when torch sees a GPU, else the CPU "
                            "(default: %(default)s)")
    group.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                       help="CUDA: run every step eagerly, without the CUDA graphs captured for decode steps")
    group.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization, metavar="F",
                       help="CUDA: share of the GPU's memory for the engine (weights, activations, KV cache); "
                            "the KV cache gets the rest unless --kv-cache-memory is given (default: %(default)s)")
    group.add_argument("--threads", dest="num_threads", type=_positive_int, default=d.num_threads, metavar="N",
                       help="CPU threads running the model (each rank's under tensor parallelism; default: "
                            "VLITE_NUM_THREADS, else every core)")
    return parser


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """`--chat-template`: the contents of the file if `value` names one, else `value` itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read chat template {value!r}: {e.strerror}") from None
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".txt"))):
        # Looks like a path, not a template: say so rather than using it as a literal template.
        raise ValueError(f"chat template file {value!r} does not exist")
    return value


def engine_args_from_cli(ns: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` named by the engine flags in `ns` (see `add_engine_args`)."""
    kwargs: dict[str, Any] = {}
    names = {f.name for f in fields(EngineArgs)}
    for dest, value in vars(ns).items():
        name = _FIELD_FOR_DEST.get(dest, dest)
        if name in names:
            kwargs[name] = value
    kwargs["chat_template"] = load_chat_template(kwargs.get("chat_template"))
    return EngineArgs.from_kwargs(**kwargs)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------

def _add_common_args(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: don't overwrite a -v given before the subcommand name.
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show the engine's log and the libraries' warnings while loading")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=_positive_int, default=max_tokens, metavar="N",
                       help="most tokens to generate per reply (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=temperature, metavar="T",
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="nucleus sampling: keep the most likely tokens up to this total probability "
                            "(default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="keep only the K most likely tokens; 0 or -1 disables (default: %(default)s)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token, up to --max-tokens")


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          ignore_eos=ns.ignore_eos, output_kind=RequestOutputKind.DELTA)


def _configure_quiet(verbose: bool) -> None:
    """Library chatter off (unless verbose); call before the model loads."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("vlite").setLevel(logging.INFO)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("vlite").setLevel(logging.WARNING)
    import warnings

    warnings.filterwarnings("ignore")
    # In case transformers / huggingface_hub were imported before the environment was set.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _load_engine(ns: argparse.Namespace) -> Any:
    from vlite.engine.llm_engine import LLMEngine

    engine_args = engine_args_from_cli(ns)
    _configure_quiet(getattr(ns, "verbose", False))
    if sys.stderr.isatty():
        print("loading model...", file=sys.stderr, flush=True)
    return LLMEngine.from_engine_args(engine_args)


@contextlib.contextmanager
def _deferred_sigint() -> Iterator[Callable[[], bool]]:
    """Turn Ctrl-C into a flag checked between engine steps, so a step is never cut in half.

    Yields a function that says whether Ctrl-C was pressed. A second Ctrl-C raises at once.
    """
    pressed = [False]

    def handler(signum: int, frame: Any) -> None:
        if pressed[0]:
            raise KeyboardInterrupt
        pressed[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        yield lambda: False
        return
    try:
        yield lambda: pressed[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_request(engine: Any, request_id: str, prompt: Any, params: SamplingParams,
                   out: Any = None) -> tuple[str, Optional[str]]:
    """Run one request, writing each text delta to `out` as it arrives (flushing each time).

    Returns the whole generated text and the finish reason ("abort" after Ctrl-C).
    """
    out = out if out is not None else sys.stdout
    pieces: list[str] = []
    finish_reason: Optional[str] = None
    with _deferred_sigint() as interrupted:
        engine.add_request(request_id, prompt, params)
        aborted = False
        while engine.has_unfinished_requests():
            if interrupted() and not aborted:
                engine.abort_request(request_id)
                aborted = True
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if completion.text and not aborted:
                    pieces.append(completion.text)
                    out.write(completion.text)
                    out.flush()
                if output.finished:
                    finish_reason = completion.finish_reason
    if aborted:
        finish_reason = "abort"
    return "".join(pieces), finish_reason


# --------------------------------------------------------------------------------------------------
# Subcommands
# --------------------------------------------------------------------------------------------------

SubcommandAdder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
_SUBCOMMANDS: list[SubcommandAdder] = []


def subcommand(adder: SubcommandAdder) -> SubcommandAdder:
    """Register a function that adds one subcommand's parser (with `handler=` set)."""
    _SUBCOMMANDS.append(adder)
    return adder


@subcommand
def _add_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete one prompt, streaming the text",
        description="Complete a prompt (raw text, no chat template) and stream the generated text to stdout.")
    parser.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    _add_sampling_args(parser, max_tokens=256, temperature=1.0)
    _add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    prompt = sys.stdin.read().rstrip("\n") if ns.prompt == "-" else ns.prompt
    if not prompt:
        raise ValueError("prompt must not be empty")
    params = _sampling_params(ns)  # validate before the slow load
    engine = _load_engine(ns)
    _, finish_reason = stream_request(engine, "generate-0", prompt, params)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return EXIT_INTERRUPTED if finish_reason == "abort" else 0


@subcommand
def _add_chat(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat with the model in the terminal",
        description="An interactive multi-turn chat using the model's chat template. Type /reset to clear the "
                    "history, /exit or /quit (or Ctrl-D) to leave. Reads one user message per line; works with "
                    "piped input too.")
    parser.add_argument("--system", default=None, metavar="TEXT", help="a system message starting the conversation")
    _add_sampling_args(parser, max_tokens=512, temperature=0.7)
    _add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_chat)


class ChatSession:
    """The conversation so far and how to turn it into a prompt that fits max_model_len."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_tokens: int, system: Optional[str]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _encode(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_for(self, user_text: str) -> tuple[dict[str, Any], int]:
        """Add the user message; the prompt for the reply, and how many old turns were dropped to fit.

        Keeps room for `max_tokens` of reply where it can by dropping the oldest turns (never the
        system message); raises ValueError, with the message not added, when even the system message
        plus this one leave no room for a reply.
        """
        first = 1 if self.system else 0
        messages = self.messages + [{"role": "user", "content": user_text}]
        dropped = 0
        text, ids = self._encode(messages)
        while len(ids) + self.max_tokens > self.max_model_len and len(messages) - first > 1:
            # Drop the oldest turn: a user message and the reply that followed it.
            cut = 2 if len(messages) - first > 2 and messages[first + 1]["role"] == "assistant" else 1
            del messages[first:first + cut]
            dropped += 1
            text, ids = self._encode(messages)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"this message is too long: the prompt is {len(ids)} tokens, max_model_len is "
                             f"{self.max_model_len}")
        self.messages = messages
        return {"prompt": text, "prompt_token_ids": ids}, dropped

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def drop_last_user(self) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


def _read_lines(interactive: bool) -> Iterator[str]:
    """User lines; ends on EOF. Interactive: with a `>>> ` prompt and line editing."""
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                yield input(">>> ")
            except EOFError:
                print(file=sys.stdout, flush=True)
                return
    else:
        for line in sys.stdin:
            yield line.rstrip("\r\n")


def run_chat(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)  # validate before the slow load
    engine = _load_engine(ns)
    tokenizer = engine.get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; give one with --chat-template")
    session = ChatSession(tokenizer, engine.max_model_len, ns.max_tokens, ns.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message; /reset clears the history, /exit or Ctrl-D leaves.", file=sys.stderr)
    turn = 0
    try:
        for line in _read_lines(interactive):
            command = line.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                session.reset()
                print("(history cleared)", file=sys.stderr, flush=True)
                continue
            try:
                prompt, dropped = session.prompt_for(line)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                continue
            if dropped:
                print(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit max_model_len "
                      f"{session.max_model_len})", file=sys.stderr, flush=True)
            reply, finish_reason = stream_request(engine, f"chat-{turn}", prompt, params)
            turn += 1
            sys.stdout.write("\n")
            sys.stdout.flush()
            if finish_reason == "abort":
                session.drop_last_user()
                print("(interrupted)", file=sys.stderr, flush=True)
            else:
                session.add_reply(reply)
    except KeyboardInterrupt:  # Ctrl-C at the prompt
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


@subcommand
def _add_bench(subparsers: Any) -> None:
    # `vlite bench throughput|latency|prefix-cache|scheduler|serve`: see vlite/benchmarks/.
    from vlite.benchmarks import add_bench_parser

    add_bench_parser(subparsers)


@subcommand
def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /version, /metrics, /tokenize, /detokenize). The engine core runs in "
                    "its own process.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model); default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_positive_int, default=8000, help="port to bind (default: %(default)s)")
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
    parser.add_argument("--max-waiting-requests", type=_non_negative_int, default=1024, metavar="N",
                        help="requests that may wait beyond the running batch; more get 503 with Retry-After "
                             "(default: %(default)s)")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how the model writes tool calls, to read them into `tool_calls`: hermes "
                             "(<tool_call> JSON blocks: Qwen 2.5/3, Hermes and many fine-tunes) or llama3_json "
                             "(Llama 3.x JSON calls)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                        help='allow tool_choice "auto" (the default when a request has tools): the model decides '
                             "whether to call, its output read with --tool-call-parser")
    _add_common_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(ns: argparse.Namespace) -> int:
    from vlite.entrypoints.openai.api_server import run_server

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"model given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    _configure_quiet(ns.verbose)
    logging.getLogger("vlite").setLevel(logging.INFO if ns.verbose else logging.WARNING)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(message)s")
    return run_server(engine_args_from_cli(ns), ns.host, ns.port, ns.served_model_name, ns.api_key,
                      ns.uvicorn_log_level, ns.max_request_body_bytes, ns.max_waiting_requests, ns.log_prompts,
                      ns.trust_request_chat_template, ns.tool_call_parser, ns.enable_auto_tool_choice)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from vlite import __version__

    parser = argparse.ArgumentParser(prog="vlite", description="vlite: a small LLM inference engine on vLLM's "
                                                               "V1 design.")
    parser.add_argument("--version", action="version", version=f"vlite {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", default=False,
                        help="show the engine's log and the libraries' warnings while loading")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for adder in _SUBCOMMANDS:
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


if __name__ == "__main__":
    sys.exit(main())
