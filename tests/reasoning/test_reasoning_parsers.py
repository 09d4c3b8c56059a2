"""The reasoning parsers on held-out outputs: streamed pieces, split anywhere, add up byte for byte to the
whole-output split, for every parser and every phase an output can start in; plus the token-level views
(tag ids, is_reasoning_end, extract_content_ids, the engine's tracker) and the config's errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.reasoning import (CONTENT, PENDING, REASONING, DeepSeekR1ReasoningParser, GenericReasoningParser,
                             Qwen3ReasoningParser, ReasoningParserManager, resolve_reasoning_parser)
from vlite.reasoning.tracker import ReasoningTracker

GENERIC = resolve_reasoning_parser("generic", {"reasoning_start_str": "[[T]]", "reasoning_end_str": "]]]>"})
PARSERS = [Qwen3ReasoningParser, DeepSeekR1ReasoningParser, GENERIC]


def held_out(cls) -> list[str]:
    s, e = cls.start_str, cls.end_str
    return [f"{s}\nplan A, then B\n{e}\n\nThe answer is 4.", f"plan{e}answer", f"{s}still thinking at max_toke",
            f"  \n{s}x{e}", f"a{e}b{e}c", "Just an answer", s[:3], "   ", "", f"{s}{e}", f"{e}",
            f"think{e[:-1]}", f"ü日本{e[:2]}]{e}]]>\n", f"{s}{s}nested{e}after", f"x{s}late start{e}y",
            f"{e[:-1]}x{e}", f"\n\n{s}"]


def streamed(cls, phase: str, pieces: list[str]) -> tuple[str, str]:
    parser = cls(phase=phase)
    reasoning = content = ""
    for piece in pieces:
        d = parser.extract_reasoning_streaming(piece)
        reasoning, content = reasoning + d.reasoning, content + d.content
    d = parser.finish_streaming()
    return reasoning + d.reasoning, content + d.content


def whole(cls, phase: str, text: str) -> tuple[str, str]:
    reasoning, content = cls(phase=phase).extract_reasoning(text)
    return reasoning or "", content or ""


@pytest.mark.parametrize("cls", PARSERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("phase", [PENDING, REASONING, CONTENT])
def test_streamed_agrees_at_every_split(cls, phase) -> None:
    for text in held_out(cls):
        expected = whole(cls, phase, text)
        assert "".join(expected) in (text, text.lstrip()) or cls.end_str in text or cls.start_str in text
        assert streamed(cls, phase, [text]) == expected
        assert streamed(cls, phase, list(text)) == expected, text  # one character per piece
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                assert streamed(cls, phase, [text[:i], text[i:j], text[j:]]) == expected, (text, i, j)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PARSERS), st.sampled_from([PENDING, REASONING, CONTENT]),
       st.lists(st.sampled_from(["<think>", "</think>", "[[T]]", "]]]>", "]", "]]", "<", "/", "think>", "a", " ",
                                 "\n", "é"]), max_size=12), st.data())
def test_streamed_agrees_on_generated_outputs(cls, phase, parts, data) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert streamed(cls, phase, pieces) == whole(cls, phase, text)


def test_splits() -> None:
    q, r1 = Qwen3ReasoningParser, DeepSeekR1ReasoningParser
    assert q().extract_reasoning("<think>\nhm\n</think>\n\nParis") == ("\nhm\n", "\n\nParis")
    assert q().extract_reasoning("Paris") == (None, "Paris")  # no block opened: all answer
    assert r1().extract_reasoning("hm</think>Paris") == ("hm", "Paris")  # R1 always reasons
    assert r1().extract_reasoning("<think>hm</think>Paris") == ("hm", "Paris")
    assert q(phase=REASONING).extract_reasoning("unclosed at max_tokens") == ("unclosed at max_tokens", None)
    assert q(phase=CONTENT).extract_reasoning("<think>x</think>y") == (None, "<think>x</think>y")
    assert q().extract_reasoning("<think>a</think>b</think>c") == ("a", "b</think>c")  # text after the answer


def test_prompt_phase() -> None:
    q, r1 = Qwen3ReasoningParser, DeepSeekR1ReasoningParser
    assert q.prompt_phase("<|im_start|>assistant\n<think>\n") == REASONING  # Qwen3-Thinking-2507
    assert q.prompt_phase("<|im_start|>assistant\n<think>\n\n</think>\n\n") == CONTENT  # enable_thinking false
    assert q.prompt_phase("<|im_start|>assistant\n") == PENDING
    assert q.prompt_phase("<think>a</think> more history<|im_start|>assistant\n") == PENDING
    assert r1.prompt_phase("<｜Assistant｜><think>\n") == REASONING


class CharTokenizer:
    """Each character one token, but the tags of TAGS one token each (as Qwen3's vocabulary has them)."""

    TAGS = {"<think>": 1000, "</think>": 1001}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            tag = next((t for t in self.TAGS if text.startswith(t, i)), None)
            out.append(self.TAGS[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        names = {v: k for k, v in self.TAGS.items()}
        return "".join(names.get(i) or chr(i) for i in ids)


def test_token_ids_and_tracker() -> None:
    tok = CharTokenizer()
    p = Qwen3ReasoningParser(tok)
    assert (p.start_token_ids, p.end_token_ids) == ([1000], [1001])
    out = tok.encode("<think>ab</think>{}")
    assert not p.is_reasoning_end(out[:3]) and p.is_reasoning_end(out) and not p.is_reasoning_end(out + [1000])
    assert p.extract_content_ids(out) == tok.encode("{}") and p.extract_content_ids(out[:3]) == []
    # The generic tags are several tokens here: followed as sequences.
    g = GENERIC(tok)
    assert g.end_token_ids == [93, 93, 93, 62] and g.extract_content_ids(tok.encode("x]]]>y")) == [ord("y")]

    t = ReasoningTracker.for_prompt(Qwen3ReasoningParser, tok, tok.encode("assistant\n"))
    assert t.phase == PENDING and t.pending_token() == 1000
    assert [t.accept(i) for i in out] == [False] * 4 + [True] * 2 and t.num_reasoning_tokens == 4
    t = ReasoningTracker.for_prompt(Qwen3ReasoningParser, tok, tok.encode("assistant\n"), tok.encode("{}"))
    assert t.phase == CONTENT  # an output that opens no block: the answer from its first token
    t = ReasoningTracker.for_prompt(DeepSeekR1ReasoningParser, tok, tok.encode("assistant\n"))
    assert not t.accept(ord("a")) and t.in_reasoning  # R1: reasoning without a start tag
    t = ReasoningTracker.for_prompt(GENERIC, tok, tok.encode("[[T]]\n"))
    assert t.in_reasoning and t.drafts_in_reasoning(tok.encode("ab]]]>c")) == tok.encode("ab]]]")
    assert [t.accept(i) for i in tok.encode("a]]]>c")] == [False] * 5 + [True]
    t = ReasoningTracker.for_prompt(Qwen3ReasoningParser, tok, tok.encode("<think>\n\n</think>\n\n"))
    assert t.phase == CONTENT and t.accept(ord("{")) and t.drafts_in_reasoning([1, 2]) == [1, 2]


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="reasoning_parser: unknown reasoning parser 'nope'"):
        ReasoningParserManager.get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="generic.*reasoning_start_str"):
        resolve_reasoning_parser("generic")
    with pytest.raises(ValueError, match="reasoning_config: unknown keys \\['think_start'\\]"):
        resolve_reasoning_parser("qwen3", {"think_start": "<t>"})
    with pytest.raises(ValueError, match="reasoning_end_str must be a non-empty string"):
        resolve_reasoning_parser("generic", {"reasoning_start_str": "<t>", "reasoning_end_str": ""})
    assert resolve_reasoning_parser("qwen3") is Qwen3ReasoningParser
    custom = resolve_reasoning_parser("deepseek_r1", {"reasoning_end_str": "</reason>"})
    assert issubclass(custom, GenericReasoningParser) and custom.implicit_start and custom.end_str == "</reason>"


def test_allow_token_sets_one_bit() -> None:
    """While the output may still open a block, the grammar's row also allows the start tag (any bit, 31 too)."""
    import torch

    from vlite.structured_output.manager import allow_token

    mask = torch.zeros(2, 3, dtype=torch.int32)
    for token_id in (0, 31, 33, 95):
        allow_token(mask, 1, token_id)
    bits = [(int(mask[1, w]) >> b) & 1 for w in range(3) for b in range(32)]
    assert [i for i, bit in enumerate(bits) if bit] == [0, 31, 33, 95] and not mask[0].any()
