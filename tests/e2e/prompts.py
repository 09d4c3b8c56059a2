"""Real text prompts of chosen token lengths, cut from Python's own standard library sources."""

from __future__ import annotations

import inspect


def corpus() -> str:
    import argparse
    import json.decoder
    import textwrap

    return "\n".join(inspect.getsource(m) for m in (textwrap, json.decoder, argparse))


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer.encode(corpus())


def prompts_of_lengths(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per length, each from a different part of the corpus."""
    ids = corpus_ids(tokenizer)
    stride = (len(ids) - max(lengths)) // max(len(lengths), 1)
    assert stride > 0, "corpus too short"
    return [ids[i * stride:i * stride + n] for i, n in enumerate(lengths)]
