"""--reasoning-parser openai_gptoss: harmony's analysis channel is the reasoning, streamed as non-streamed;
the engine's token view (ReasoningTracker) leaves the thinking at the answer's header and a thinking budget
forces that header."""

from __future__ import annotations

from tests.harmony import harmony_model
from tests.harmony.test_parser import ARITHMETIC, TOOL_CALL
from vlite.harmony import render_chat
from vlite.reasoning import CONTENT, REASONING, GptOssReasoningParser, ReasoningParserManager
from vlite.reasoning.tracker import ReasoningTracker


def test_registered_and_split():
    cls = ReasoningParserManager.get_reasoning_parser("openai_gptoss")
    assert cls is GptOssReasoningParser
    assert cls().extract_reasoning(ARITHMETIC) == ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
                                                   "2 + 2 = 4.")
    assert cls().extract_reasoning(TOOL_CALL) == ("Need to use function get_weather.", None)  # calls: the tool parser's
    for text in (ARITHMETIC, TOOL_CALL):
        p, reasoning, content = cls(), "", ""
        for i in range(0, len(text), 3):
            d = p.extract_reasoning_streaming(text[i:i + 3])
            reasoning, content = reasoning + d.reasoning, content + d.content
        d = p.finish_streaming()
        assert ((reasoning + d.reasoning) or None, (content + d.content) or None) == cls().extract_reasoning(text)


def test_prompt_phase():
    prompt = render_chat([{"role": "user", "content": "Hi"}])
    assert GptOssReasoningParser.prompt_phase(prompt) == REASONING
    cont = render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                       add_generation_prompt=False, continue_final_message=True)
    assert GptOssReasoningParser.prompt_phase(cont) == CONTENT
    assert GptOssReasoningParser(phase=CONTENT).extract_reasoning("lo.<|return|>") == (None, "lo.")


def test_tracker_on_tokens():
    tok = harmony_model.tokenizer()
    prompt = tok.encode(render_chat([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    ids = tok.encode(ARITHMETIC, add_special_tokens=False)
    tracker = ReasoningTracker.for_prompt(GptOssReasoningParser, tok, prompt)
    answer = [i for i in ids if tracker.accept(i)]
    assert tok.decode(answer, skip_special_tokens=False) == "2 + 2 = 4.<|return|>"
    # a budget of 2 thinking tokens: the answer's header is forced, token by token, from the third
    tracker = ReasoningTracker.for_prompt(GptOssReasoningParser, tok, prompt, ids[:2])
    forced = []
    while (t := tracker.forced_token(2)) is not None:
        forced.append(t)
        tracker.accept(t)
    assert tok.decode(forced, skip_special_tokens=False) == "<|channel|>final<|message|>"
    assert tracker.phase == CONTENT
