"""LLM.chat on the tiny harmony model: the conversation rendered in harmony (reasoning_effort from
chat_template_kwargs), the output stopped at <|call|> / <|return|> and split by its channels, a tool call
read back with OpenAIToolParser from `text` (which keeps the special tokens), and the engine's thinking
budget (--reasoning-parser openai_gptoss) forcing the answer's header."""

from __future__ import annotations

from tests.harmony import harmony_model as hm
from vlite import LLM, SamplingParams
from vlite.entrypoints.openai.tool_parsers import OpenAIToolParser

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def params(*banned: str, **kwargs) -> SamplingParams:
    tok = hm.tokenizer()
    return SamplingParams(temperature=0.0, max_tokens=30, logit_bias={hm.token_id(tok, t): -100 for t in banned},
                          **kwargs)


def test_llm_chat_harmony(harmony_model_dir) -> None:
    llm = LLM(model=str(harmony_model_dir), dtype="float32", kv_cache_memory_bytes=16 * 2**20, max_model_len=1024,
              reasoning_parser="openai_gptoss")
    out = llm.chat(ASK, params("analysis", "Weigh it."), use_tqdm=False, tools=[WEATHER],
                   chat_template_kwargs={"reasoning_effort": "high"})[0]
    assert "Reasoning: high" in out.prompt and "type get_weather = (_: {\ncity?: string,\n}) => any;" in out.prompt
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text.endswith(hm.ARGS) and (c.reasoning, c.content) == (None, None)
    parsed = OpenAIToolParser().extract_tool_calls(c.text)
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in parsed.tool_calls] == [("get_weather", hm.ARGS)]
    c = llm.chat(ASK, params("analysis", "Weigh it.", hm.RECIPIENT, hm.ARGS), use_tqdm=False)[0].outputs[0]
    assert (c.reasoning, c.content, c.finish_reason) == (None, "Sunny in Paris.", "stop")
    # no bias: the model thinks on and on; a budget of 3 thinking tokens forces <|channel|>final<|message|>
    c = llm.chat(ASK, params(thinking_token_budget=3), use_tqdm=False)[0].outputs[0]
    assert c.text.startswith("<|channel|>analysis<|message|><|channel|>final<|message|>Weigh it.<|end|>")
    assert (c.content, c.finish_reason) == ("Weigh it.", "length")  # the chain's next analysis messages follow
    assert c.reasoning.startswith("Weigh it.\nWeigh it.")
