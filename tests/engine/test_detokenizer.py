"""IncrementalDetokenizer: deltas join to the full decode; UTF-8 hold-back; stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlite.engine.detokenizer import IncrementalDetokenizer

VOCAB = 49152
IM_END = 2
EOS = 0
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return hf_tokenizer  # the session's (loading it from the GGUF takes ~5 s)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chunked(ids: list[int], sizes: list[int] | None = None, rng: random.Random | None = None) -> list[list[int]]:
    """Split ids into chunks of the given sizes (cycled), random sizes, or one at a time."""
    out, i, k = [], 0, 0
    while i < len(ids):
        if sizes:
            n = sizes[k % len(sizes)]
        elif rng is not None:
            n = rng.randint(1, 5)
        else:
            n = 1
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


def stream(tok, ids, chunks=None, *, prompt=(), stop_terminated=False, delta=True, **kw):
    """Feed ids like the engine does; return (outputs per step, detokenizer, stop string hit)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    chunks = chunks if chunks is not None else chunked(ids)
    outs, stop = [], None
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        stop = d.update(chunk, stop_terminated and last)
        finished = last or stop is not None
        outs.append(d.get_next_output_text(finished, delta))
        if stop is not None:
            break
    return outs, d, stop


# ------------------------------------------------------------------ plain decoding
ENGLISH = "The quick brown fox jumps over the lazy dog. It's 3.14 o'clock,  isn't it?\n\tYes!"
UNICODE = "héllo 世界 🤖🎉 naïve — façade, Ελληνικά, 😀👍🏽 日本語テキスト"


@pytest.mark.parametrize("text", [ENGLISH, UNICODE])
def test_one_token_at_a_time(tok, text):
    ids = enc(tok, text)
    outs, d, stop = stream(tok, ids)
    assert stop is None
    assert "".join(outs) == d.output_text == tok.decode(ids, skip_special_tokens=True) == text
    assert d.output_token_ids == ids and d.num_output_tokens == len(ids)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", [ENGLISH, UNICODE])
def test_random_chunks(tok, text, seed):
    ids = enc(tok, text)
    outs, d, _ = stream(tok, ids, chunked(ids, rng=random.Random(seed)))
    assert "".join(outs) == d.output_text == text


def test_split_multibyte_chars_never_emit_garbage(tok):
    text = "héllo 世界 🤖🎉 naïve"
    ids = enc(tok, text)
    # The emoji really are split over several byte tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    outs, d, _ = stream(tok, ids)
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) == text
    # Text is released as soon as a character completes, not only at the end.
    d2 = IncrementalDetokenizer(tok, [])
    d2.update(ids, False)
    assert d2.get_next_output_text(False, True) == text


def test_incomplete_char_held_until_finish(tok):
    """Bytes that never complete stay held while streaming; at finish they come out as U+FFFD like decode()."""
    emoji = enc(tok, "🤖")
    assert len(emoji) > 1
    ids = enc(tok, "abc") + emoji[:1]
    d = IncrementalDetokenizer(tok, [])
    d.update(ids, False)
    assert d.get_next_output_text(False, True) == "abc"
    assert d.output_text == "abc"
    final = d.get_next_output_text(True, True)
    assert "abc" + final == d.output_text == tok.decode(ids)
    assert d.output_text.endswith("\ufffd")


def test_invalid_bytes_released_when_proven_invalid(tok):
    """A truncated character followed by ASCII is invalid for good: emitted as U+FFFD without waiting."""
    emoji = enc(tok, "🤖")
    ids = enc(tok, "a") + emoji[:1] + enc(tok, "b")
    d = IncrementalDetokenizer(tok, [])
    d.update(ids, False)
    assert d.get_next_output_text(False, True) == tok.decode(ids) == "a\ufffdb"


@pytest.fixture(scope="module")
def partial_ids(tok) -> list[int]:
    """Ids whose text alone is not valid UTF-8 (byte pieces of multi-byte chars)."""
    return [i for i in range(VOCAB) if "\ufffd" in tok.decode([i])]


@SETTINGS
@given(
    data=st.data(),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    skip=st.booleans(),
)
def test_arbitrary_ids_match_full_decode(tok, partial_ids, data, sizes, skip):
    """Any id sequence, any prompt, any chunking: deltas join to decode(ids), invalid bytes as U+FFFD.

    Ids are biased towards byte pieces so that split, completed and never-completed characters all occur.
    """
    any_id = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(partial_ids))
    ids = data.draw(st.lists(any_id, max_size=40), label="ids")
    prompt = data.draw(st.lists(any_id, max_size=8), label="prompt")
    outs, d, _ = stream(tok, ids, chunked(ids, sizes), prompt=prompt, skip_special_tokens=skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    if not ids:
        assert d.get_next_output_text(True, True) == "" and d.output_text == ""
        return
    assert "".join(outs) == d.output_text == expected


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = enc(tok, "Hello") + [1] + enc(tok, " wörld") + [IM_END] + enc(tok, "!")
    outs, d, _ = stream(tok, ids, skip_special_tokens=skip)
    expected = "Hello wörld!" if skip else "Hello<|im_start|> wörld<|im_end|>!"
    assert "".join(outs) == d.output_text == tok.decode(ids, skip_special_tokens=skip) == expected


# ------------------------------------------------------------------ stop_terminated
def test_stop_terminated_excludes_last_token(tok):
    ids = enc(tok, "Hello world") + [IM_END]
    outs, d, stop = stream(tok, ids, stop_terminated=True, skip_special_tokens=False)
    assert stop is None
    assert "".join(outs) == d.output_text == "Hello world"
    assert d.output_token_ids == ids and d.num_output_tokens == len(ids)
    # A normal token used as stop token is excluded too.
    ids = enc(tok, "Hello world")
    assert len(ids) == 2
    outs, d, _ = stream(tok, ids, [ids], stop_terminated=True)
    assert "".join(outs) == d.output_text == "Hello"


def test_stop_terminated_releases_pending_bytes(tok):
    ids = enc(tok, "ok ") + enc(tok, "🤖")[:2] + [EOS]
    d = IncrementalDetokenizer(tok, [])
    d.update(ids, True)
    assert d.output_text == tok.decode(ids[:-1])
    assert d.get_next_output_text(True, True) == d.output_text


# ------------------------------------------------------------------ stop strings
SENTENCE = "The quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    ids = enc(tok, SENTENCE)
    assert not any("brown fox" in tok.decode([i]) for i in ids)
    outs, d, stop = stream(tok, ids, stop=["brown fox"], include_stop_str_in_output=include)
    assert stop == d.stop_str_hit == "brown fox"
    expected = "The quick brown fox" if include else "The quick "
    assert "".join(outs) == d.output_text == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_start(tok, include):
    outs, d, stop = stream(tok, enc(tok, SENTENCE), stop=["The"], include_stop_str_in_output=include)
    assert stop == "The"
    assert "".join(outs) == d.output_text == ("The" if include else "")


@pytest.mark.parametrize("chunks_at_once", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_overlapping_stop_strings_earliest_wins(tok, include, chunks_at_once):
    ids = enc(tok, SENTENCE)
    chunks = [ids] if chunks_at_once else None
    # List order does not matter: "quick" completes before "ick brown".
    for stops in (["ick brown", "quick"], ["quick", "ick brown"]):
        outs, d, stop = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
        assert stop == "quick"
        assert "".join(outs) == d.output_text == ("The quick" if include else "The ")
    # A short stop inside a long one completes first, even when all text arrives in one update.
    outs, d, stop = stream(tok, ids, chunks, stop=["quick brown fox", "brown"], include_stop_str_in_output=include)
    assert stop == "brown"
    assert d.output_text == ("The quick brown" if include else "The quick ")


def test_stop_string_inside_one_token(tok):
    ids = enc(tok, SENTENCE)
    outs, d, stop = stream(tok, ids, stop=["ump"])
    assert stop == "ump" and "".join(outs) == d.output_text == "The quick brown fox j"


def test_streamed_deltas_never_cut(tok):
    """With stop strings, deltas hold back len(longest)-1 chars, so nothing emitted is ever retracted."""
    ids = enc(tok, SENTENCE)
    outs, d, stop = stream(tok, ids, stop=["fox jumps", "xyz"])
    assert stop == "fox jumps"
    assert "".join(outs) == d.output_text == "The quick brown "
    # Cumulative mode: every intermediate output is a prefix of the final one.
    outs, d, _ = stream(tok, ids, delta=False, stop=["fox jumps"])
    assert outs[-1] == d.output_text == "The quick brown "
    assert all(d.output_text.startswith(o) for o in outs)


def test_no_stop_hit_releases_held_back_text(tok):
    ids = enc(tok, SENTENCE)
    d = IncrementalDetokenizer(tok, [], stop=["zebra crossing"])
    sent = ""
    for i in ids:
        assert d.update([i], False) is None
        sent += d.get_next_output_text(False, True)
        assert sent == d.output_text[: max(0, len(d.output_text) - len("zebra crossing") + 1)]
    sent += d.get_next_output_text(True, True)
    assert sent == d.output_text == SENTENCE


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Char-by-char semantics: the first stop string to complete; ties go to the earlier start."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) if include else i], s


@SETTINGS
@given(
    words=st.lists(st.sampled_from(["ab", "ba", " a", " b", "aab", "b", "\n", "é", "🤖"]), min_size=1, max_size=20),
    stops=st.lists(st.text(alphabet="ab \né🤖", min_size=1, max_size=5), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_stop_strings_property(tok, words, stops, sizes, include):
    text = "".join(words)
    ids = enc(tok, text)
    assert tok.decode(ids) == text
    outs, d, stop = stream(tok, ids, chunked(ids, sizes), stop=stops, include_stop_str_in_output=include)
    expected_text, expected_stop = _reference_stop(text, stops, include)
    assert stop == expected_stop
    assert "".join(outs) == d.output_text == expected_text
    # the ids kept: up to the one that completed the stop string, as one id per update keeps
    _, one, _ = stream(tok, ids, stop=stops, include_stop_str_in_output=include)
    assert d.output_token_ids == one.output_token_ids


def test_ids_after_a_stop_string_in_one_update_are_dropped(tok):
    """Several ids in one update (accepted speculative drafts): the output ends with the id that
    completed the stop string, as it would have with one id per step."""
    ids = enc(tok, SENTENCE)
    end = next(i for i in range(1, len(ids) + 1) if "brown" in tok.decode(ids[:i]))
    _, d, stop = stream(tok, ids, [ids], stop=["brown"])
    assert stop == "brown" and d.output_text == "The quick "
    assert d.output_token_ids == ids[:end] and end < len(ids)


# ------------------------------------------------------------------ context and cost
class _PieceTokenizer:
    """SentencePiece-like: '▁' marks a space, and decode drops the leading space of the first piece."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.max_window = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.max_window = max(self.max_window, len(ids))
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_prompt_context_keeps_leading_space():
    t = _PieceTokenizer(["▁Hello", "▁world", "▁again", ","])
    outs, d, _ = stream(t, [1, 3, 2], prompt=[0])
    assert "".join(outs) == d.output_text == " world, again"
    # Without a prompt there is nothing before the first token: its space is dropped, like decode().
    outs, d, _ = stream(t, [1, 3, 2])
    assert d.output_text == "world, again"


def test_prompt_ending_mid_character_is_not_used_as_context(tok):
    emoji = enc(tok, "🤖")
    prompt, ids = enc(tok, "hi ") + emoji[:2], emoji[2:] + enc(tok, " ok")
    outs, d, _ = stream(tok, ids, prompt=prompt)
    assert "".join(outs) == d.output_text == tok.decode(ids)


def test_decode_window_stays_small():
    t = _PieceTokenizer(["▁a", "b", "▁c"])
    ids = [i % 3 for i in range(2000)]
    outs, d, _ = stream(t, ids, prompt=list(range(3)) * 10)
    assert "".join(outs) == d.output_text
    assert t.max_window <= 8


def test_stop_string_in_text_released_at_finish(tok, partial_ids):
    """Text held behind an incomplete char is stop-checked when a length-finish releases it."""
    space_partial = next(i for i in partial_ids if tok.decode([i]).startswith(" "))
    d = IncrementalDetokenizer(tok, [], stop=["x "])
    assert d.update(enc(tok, "ax") + [space_partial], False) is None
    assert d.get_next_output_text(False, True) == "a"
    assert d.get_next_output_text(True, True) == ""
    assert d.output_text == "a" and d.stop_str_hit == "x "
