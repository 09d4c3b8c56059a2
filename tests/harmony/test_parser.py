"""The harmony parser on the format's published completions (openai/harmony docs/format.md): reasoning,
content and tool calls; fed in any pieces (every split point) it gives what the whole text gives; and on
token ids decoded by a tokenizer with harmony's special tokens, one token at a time."""

from __future__ import annotations

import random

import pytest

from tests.harmony import harmony_model
from tests.reasoning import thinking_model
from vlite.harmony import HarmonyHeader, HarmonyParser, collect, is_harmony_tokenizer, parse_completion, stop_token_ids
from vlite.harmony.parser import FINAL

# format.md's published completions (the stop token included, as the model writes it).
ARITHMETIC = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
              "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
             'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>')
PREAMBLE = ("<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for the Node.js server\n"
            "3. Start the server\n---\nWill start executing the plan step by step<|end|><|start|>assistant<|channel|>"
            'commentary to=functions.generate_file<|constrain|>json<|message|>{"template": "basic_html", '
            '"path": "index.html"}<|call|>')
CASES = {
    ARITHMETIC: ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    TOOL_CALL: ("Need to use function get_weather.", None, [("get_weather", '{"location":"San Francisco"}')]),
    PREAMBLE: ("{long chain of thought}", "**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for "
               "the Node.js server\n3. Start the server\n---\nWill start executing the plan step by step",
               [("generate_file", '{"template": "basic_html", "path": "index.html"}')]),
    # cut short (max_tokens), as vLLM's parse_chat_output tests cut them
    "<|channel|>final<|message|>I'm in the middle of answering": (None, "I'm in the middle of answering", []),
    "<|channel|>analysis<|message|>I'm in the middle of thinking": ("I'm in the middle of thinking", None, []),
    "<|channel|>analysis<|message|>I'm thinking.<|end|><|start|>assistant<|channel|>fin": ("I'm thinking.", None, []),
    # the recipient in the role's part, a content type without <|constrain|>, two calls, a built-in tool
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
    "<|call|>": ("a", None, [("f", "{}")]),
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant"
    "<|channel|>analysis to=python<|message|>print(1)<|end|>": ("a\nb\nprint(1)", None, []),
    # a thinking budget forces <|channel|>final<|message|> in the middle of a thought
    "<|channel|>analysis<|message|>long thou<|channel|>final<|message|>Done.": ("long thou", "Done.", []),
    # a marker's first characters that are not one, and no message at all
    "<|channel|>final<|message|>a <| b <|end": (None, "a <| b <|end", []),
    "": (None, None, []),
}


def triple(parsed):
    return parsed.reasoning, parsed.content, parsed.calls


@pytest.mark.parametrize("text", list(CASES))
def test_published_and_edge_completions(text):
    assert triple(parse_completion(text)) == CASES[text]


@pytest.mark.parametrize("text", [ARITHMETIC, TOOL_CALL, PREAMBLE])
def test_streamed_equals_whole(text):
    whole = triple(parse_completion(text))
    for cut in range(len(text) + 1):  # every two-piece split, a marker cut anywhere included
        p = HarmonyParser()
        assert triple(collect([p.feed(text[:cut]), p.feed(text[cut:]), p.finish()])) == whole
    rng = random.Random(0)
    for _ in range(20):
        p, deltas, i = HarmonyParser(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            deltas.append(p.feed(text[i:i + n]))
            i += n
        deltas.append(p.finish())
        assert triple(collect(deltas)) == whole
        calls = [c for d in deltas for c in d.calls]
        assert all(name is None for _, name, _ in calls[1:])  # a call is named once, by its first piece


def test_messages_and_headers():
    p = HarmonyParser()
    p.feed(PREAMBLE)
    p.finish()
    headers = [m.header for m in p.messages]
    assert [(h.role, h.channel, h.recipient, h.content_type) for h in headers] == [
        ("assistant", "analysis", None, None), ("assistant", "commentary", None, None),
        ("assistant", "commentary", "functions.generate_file", "json")]
    tool = HarmonyHeader.parse("functions.get_weather to=assistant<|channel|>commentary")
    assert (tool.role, tool.recipient, tool.channel) == ("functions.get_weather", "assistant", "commentary")
    # a continued answer: the output starts inside the final message
    assert triple(parse_completion("lo there.<|return|>", inside=FINAL)) == (None, "lo there.", [])


def test_token_by_token_with_harmony_tokenizer():
    """Token ids decoded with skip_special_tokens false (as the server asks the engine), one at a time."""
    tok = harmony_model.tokenizer()
    assert is_harmony_tokenizer(tok) and not is_harmony_tokenizer(thinking_model.tokenizer())
    assert tok.convert_ids_to_tokens(stop_token_ids(tok)) == ["<|return|>", "<|call|>"]
    for text in (ARITHMETIC, TOOL_CALL, PREAMBLE):
        ids = tok.encode(text, add_special_tokens=False)
        assert "<|channel|>" in tok.convert_ids_to_tokens(ids)  # special tokens, not their characters
        assert tok.decode(ids, skip_special_tokens=False) == text
        p = HarmonyParser()
        deltas = [p.feed(tok.decode([i], skip_special_tokens=False)) for i in ids] + [p.finish()]
        assert triple(collect(deltas)) == CASES[text]
