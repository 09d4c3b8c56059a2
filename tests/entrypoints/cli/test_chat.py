"""`vlite chat`: history, /reset, /exit and fitting max_model_len against a fake engine; two turns on the real
model from a pipe."""

from __future__ import annotations

import io
import sys

import pytest

from tests.entrypoints.cli.utils import GREEDY_FLAGS, FakeEngine, run_vlite
from vlite.entrypoints import cli
from vlite.sampling_params import SamplingParams


def run_fake_chat(monkeypatch, capsys, stdin_text, engine, *argv):
    monkeypatch.setattr("vlite.entrypoints.cli.chat.load_engine", lambda ns: engine)
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
