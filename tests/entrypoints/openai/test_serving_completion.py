"""The legacy completions logprobs object under echo, built from engine outputs (no server, no model:
the default model's real tokenizer and hand-written RequestOutputs)."""

from __future__ import annotations

import pytest

from vlite.entrypoints.openai.protocol import CompletionRequest
from vlite.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vlite.entrypoints.openai.serving_engine import OpenAIError, Prepared
from vlite.outputs import CompletionOutput, Logprob, RequestOutput


@pytest.fixture(scope="module")
def serving(hf_tokenizer):
    s = OpenAIServingCompletion.__new__(OpenAIServingCompletion)  # only the tokenizer is used to format logprobs
    s.tokenizer = hf_tokenizer
    return s


def position(chosen: int, lp: float, rank: int, *top: tuple[int, float]) -> dict[int, Logprob]:
    """As the output processor builds it: the chosen token first, then the top ones by rank."""
    out = {chosen: Logprob(lp, rank)}
    for r, (t, v) in enumerate(top, 1):
        out.setdefault(t, Logprob(v, r))
    return out


def test_echo_logprobs_prompt_then_generated(serving, hf_tokenizer):
    text = "Hello world, this is"
    prompt = hf_tokenizer.encode(text)
    generated = hf_tokenizer.encode(" a test")
    assert len(prompt) >= 3 and len(generated) == 2
    plp = [None] + [position(t, -1.5 - j, 3, (11, -0.1), (12, -0.2), (13, -0.3)) for j, t in enumerate(prompt[1:])]
    glp = [position(generated[0], -0.25, 1, (generated[0], -0.25), (12, -2.0)),
           position(generated[1], float("-inf"), 40, (11, -0.5), (12, -0.7))]
    c = CompletionOutput(0, " a test", generated, logprobs=glp, finish_reason="length")
    out = RequestOutput("r", text, prompt, [c], True, prompt_logprobs=plp)
    p = Prepared(text, prompt, "r")
    request = CompletionRequest(prompt=text, echo=True, logprobs=2)

    lp = serving._choice_logprobs(request, p, out, c, text, 0)
    n = len(prompt) + len(generated)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == text + " a test"
    assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(n)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(prompt)] == [-1.5 - j for j in range(len(prompt) - 1)]
    # logprobs=2: the token itself and the top 2 (three entries where it is not among them).
    assert all(len(top) == 3 for top in lp["top_logprobs"][1:len(prompt)])
    assert len(lp["top_logprobs"][len(prompt)]) == 2  # the chosen token is the top one
    assert lp["token_logprobs"][-1] == -9999.0  # -inf is not JSON: OpenAI's floor

    # A stream's later chunk: offsets continue from where the text is; no prompt part.
    later = serving._choice_logprobs(request, p, out, c, None, 100)
    assert later["text_offset"][0] == 100 and len(later["tokens"]) == len(generated)
    # No logprobs asked: none; prompt logprobs missing a position: an error, not a misaligned object.
    assert serving._choice_logprobs(CompletionRequest(prompt=text, echo=True), p, out, c, text, 0) is None
    out.prompt_logprobs = plp[:-1]
    with pytest.raises(OpenAIError):
        serving._choice_logprobs(request, p, out, c, text, 0)
