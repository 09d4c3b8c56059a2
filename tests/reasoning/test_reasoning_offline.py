"""LLM.chat with a reasoning parser on the tiny thinking model: each output's reasoning and content, for
Qwen3's template (thinking on, off, cut at max_tokens), R1's (the block opened by the prompt), tags split
across tokens (the generic parser); and a JSON schema that constrains the answer, not the thinking."""

from __future__ import annotations

import json

import pytest

from tests.reasoning import thinking_model as tm
from vlite import LLM, SamplingParams
from vlite.sampling_params import StructuredOutputsParams

ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "required": ["name", "parameters"]}}


def make_llm(folder, **kwargs) -> LLM:
    return LLM(model=str(folder), dtype="float32", kv_cache_memory_bytes=8 * 2**20, max_model_len=256, **kwargs)


@pytest.fixture(scope="module")
def qwen3_llm(thinking_model_dir) -> LLM:
    return make_llm(thinking_model_dir, reasoning_parser="qwen3")


def split(llm: LLM, params: SamplingParams = GREEDY, **kwargs) -> tuple:
    c = llm.chat(ASK, params, use_tqdm=False, **kwargs)[0].outputs[0]
    return c.reasoning, c.content


def test_qwen3_template(qwen3_llm) -> None:
    assert split(qwen3_llm) == (tm.REASONING, tm.ANSWER)
    assert split(qwen3_llm, chat_template_kwargs={"enable_thinking": False}) == (None, "Paris it is.")
    cut = qwen3_llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and (cut.reasoning, cut.content) == ("\nPonder" + tm.DECOY, None)
    assert cut.text == "<think>" + cut.reasoning  # text stays the whole output


def test_r1_and_generic(thinking_model_dir) -> None:
    r1 = make_llm(thinking_model_dir, reasoning_parser="deepseek_r1")
    assert split(r1, chat_template=tm.R1_TEMPLATE) == ("Weigh it", tm.ANSWER)  # the prompt opened the block
    del r1
    generic = make_llm(thinking_model_dir, reasoning_parser="generic",
                       reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})
    assert split(generic, chat_template=tm.SPLIT_TEMPLATE) == ("Split here", " after answer")


def test_no_parser_leaves_outputs_whole(thinking_model_dir) -> None:
    plain = make_llm(thinking_model_dir)
    c = plain.chat(ASK, GREEDY, use_tqdm=False)[0].outputs[0]
    assert c.text == "<think>" + tm.REASONING + "</think>" + tm.ANSWER and c.reasoning is c.content is None


def test_bad_parser_names_the_field(thinking_model_dir) -> None:
    with pytest.raises(ValueError, match="reasoning_parser: unknown reasoning parser 'qwen9'"):
        make_llm(thinking_model_dir, reasoning_parser="qwen9")
    with pytest.raises(ValueError, match="reasoning_config needs reasoning_parser"):
        make_llm(thinking_model_dir, reasoning_config={"reasoning_end_str": "</r>"})


def test_json_schema_constrains_the_answer_only(qwen3_llm) -> None:
    pytest.importorskip("xgrammar")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    reasoning, content = split(qwen3_llm, params)
    assert reasoning == tm.REASONING  # the thinking ran free (a grammar from the first token forbids it)
    assert json.loads(content) == [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    # Thinking off: the answer is constrained from its first token.
    reasoning, content = split(qwen3_llm, params, chat_template_kwargs={"enable_thinking": False})
    assert reasoning is None and json.loads(content)[0]["name"] == "get_weather"
