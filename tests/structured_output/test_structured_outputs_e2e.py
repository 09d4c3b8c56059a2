"""Structured outputs on the real model (SmolLM2, the session's float32 engine): generated JSON
schemas validate, greedy and at temperature 1; regex, choice, EBNF grammar and any-JSON-object
outputs match; invalid specs are clear errors; a request waiting for its grammar does not hold up
the others; n > 1, preemption and logprobs under a grammar."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vlite import LLM, SamplingParams  # noqa: E402
from vlite.engine.input_processor import EngineCoreRequest  # noqa: E402
from vlite.request import RequestStatus  # noqa: E402
from vlite.sampling_params import StructuredOutputsParams  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "Fill in this JSON record about a city:"
MAX_TOKENS = 160


def _params(temperature: float, max_tokens: int = MAX_TOKENS, seed: int | None = None, **so) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


# ---- generated schemas: bounded so that every output fits in MAX_TOKENS -------------------------

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


@st.composite
def _integer(draw):
    lo = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 500))}


@st.composite
def _number(draw):
    lo = draw(st.integers(-100, 100))
    return {"type": "number", "minimum": lo, "maximum": lo + draw(st.integers(1, 100))}


_leaf = st.one_of(
    _integer(),
    _number(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda v: {"enum": v}, st.lists(st.one_of(_names, st.integers(-9, 99), st.booleans()),
                                              min_size=1, max_size=4, unique=True)),
)


@st.composite
def _object(draw, children):
    names = draw(st.lists(_names, min_size=1, max_size=3, unique=True))
    props = {name: draw(children) for name in names}
    required = [n for n in names if draw(st.booleans())]
    schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return schema


def _array(children):
    return st.builds(lambda items, hi: {"type": "array", "items": items, "minItems": 0, "maxItems": hi},
                     children, st.integers(0, 3))


_schemas = st.recursive(_leaf, lambda children: st.one_of(_object(children), _array(children)), max_leaves=6)
_top = st.one_of(_object(_schemas), _array(_object(_leaf)))


@settings(max_examples=3, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(schemas=st.lists(_top, min_size=6, max_size=6))
def test_generated_schemas_validate(llm_fp32, schemas):
    """Every output parses and validates against its schema: greedy and temperature 1, one batch.

    Greedy runs allow JSON's free whitespace (capped per gap); the sampled ones are compact: a 135M
    model sampled at temperature 1 can spend any budget on whitespace."""
    params = [_params(0.0, json=s) for s in schemas] + \
        [_params(1.0, seed=i, json=s, disable_any_whitespace=True) for i, s in enumerate(schemas)]
    outs = llm_fp32.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        schema = p.structured_outputs.json
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_compact_json_and_json_object(llm_fp32):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    outs = llm_fp32.generate([PROMPT] * 2, [
        _params(0.0, json=json.dumps(schema), disable_any_whitespace=True),
        _params(0.0, json_object=True)], use_tqdm=False)
    compact = outs[0].outputs[0].text
    assert compact == json.dumps(json.loads(compact), ensure_ascii=False), compact  # json.dumps' separators only
    jsonschema.validate(json.loads(compact), schema)
    for out in outs[1:]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)


def test_regex_choice_grammar(llm_fp32):
    regex = r"[A-Z][a-z]{2,6}-\d{2,4}"
    choices = ["Paris", "London", "a \"quoted\" one", "naïve\\path"]
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    params = [_params(0.0, regex=regex), _params(1.0, seed=7, regex=regex),
              _params(0.0, choice=choices), *[_params(1.0, seed=s, choice=choices) for s in range(4)],
              _params(0.0, max_tokens=48, grammar=grammar), _params(1.0, seed=5, max_tokens=48, grammar=grammar)]
    outs = llm_fp32.generate(["The capital of France is"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1]), texts[:2]
    assert all(t in choices for t in texts[2:7]), texts[2:7]
    assert texts[2] == "Paris"  # greedy picks the obvious answer among the allowed ones
    for t in texts[7:]:
        assert re.fullmatch(r"\((?:[1-9][0-9]?)(?: \+ [1-9][0-9]?)*\)", t), t


def test_invalid_specs_are_clear_errors(llm_fp32):
    cases = [({"json": {"type": "objectx"}}, "structured_outputs.json"),
             ({"json": "{not json"}, "structured_outputs.json"),
             ({"regex": "(abc"}, "structured_outputs.regex"),
             ({"grammar": 'root ::= "a" |'}, "structured_outputs.grammar"),
             ({"choice": []}, "structured_outputs.choice")]
    for spec, field in cases:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm_fp32.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                              use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()


def test_compile_error_from_the_engine_core_fails_that_request_alone(llm_fp32):
    """A spec that parses but does not compile (checked by the engine core, as the server's is) fails
    its request as a client error while a normal request in the same steps completes."""
    engine = llm_fp32.llm_engine
    core = engine.engine_core
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(abc"))
    core.add_request(EngineCoreRequest("bad-1", [1, 2, 3], params, (2,), time.time()))
    core.add_request(EngineCoreRequest("good-1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), (2,),
                                       time.time()))
    outputs = {}
    deadline = time.time() + 60
    while core.has_unfinished_requests() and time.time() < deadline:
        for o in core.step():
            outputs.setdefault(o.request_id, []).append(o)
    bad = outputs["bad-1"][-1]
    assert bad.finish_reason == "error" and bad.bad_request and bad.new_token_ids == []
    assert bad.error.startswith("structured_outputs.regex: invalid regex"), bad.error
    assert sum(len(o.new_token_ids) for o in outputs["good-1"]) == 4


def test_waiting_for_grammar_does_not_stall_others(llm_fp32):
    """While one request's grammar compiles (held back here until the other has finished), the
    unconstrained request runs to completion; then the constrained one starts and completes."""
    engine = llm_fp32.llm_engine
    core = engine.engine_core
    manager = core.structured_output_manager
    release = threading.Event()
    real_compile = manager._compile

    def slow_compile(params):
        release.wait(60)
        return real_compile(params)

    manager._compile = slow_compile
    try:
        schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}
        engine.add_request("constrained", PROMPT, _params(0.0, max_tokens=24, json=schema))
        engine.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
        finished = {}
        waiting_seen = False
        deadline = time.time() + 120
        while engine.has_unfinished_requests() and time.time() < deadline:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            req = core.scheduler.requests.get("constrained")
            if req is not None and "free" not in finished:
                assert req.status == RequestStatus.WAITING_FOR_FSM
                waiting_seen = True
            if "free" in finished:
                release.set()
        assert waiting_seen
        assert len(finished["free"].outputs[0].token_ids) == 12
        assert json.loads(finished["constrained"].outputs[0].text)["slow"] in (True, False)
    finally:
        release.set()
        manager._compile = real_compile


def test_n_logprobs_and_preemption():
    """n > 1 children each follow their own matcher; logprobs report the masked distribution
    (forbidden tokens never appear among the top ones); preempted requests (tiny KV cache)
    resume with their matcher where their kept tokens left it."""
    llm = LLM(dtype="float32", max_num_batched_tokens=64, block_size=16, kv_cache_memory_bytes=12 * 737280,
              max_num_seqs=8)  # 12 blocks of 16 tokens (30 layers x 3 KV heads x 64 dims, float32)
    assert llm.llm_engine.num_kv_blocks <= 12
    schema = {"type": "object", "properties": {"word": {"enum": ["alpha", "beta", "gamma"]},
                                               "n": {"type": "array", "minItems": 8, "maxItems": 8,
                                                     "items": {"type": "integer", "minimum": 100, "maximum": 999}}},
              "required": ["word", "n"], "additionalProperties": False}
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=80, logprobs=5,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    many = [SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                           structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
            for i in range(8)]
    prompts = [f"Record number {i}: {PROMPT}" for i in range(8)]
    outs = llm.generate([PROMPT] + prompts, [params] + many, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    tok = llm.get_tokenizer()
    for c in outs[0].outputs:
        assert len(c.logprobs) == len(c.token_ids)
        first = c.logprobs[0]
        # Compact JSON must open with '{"word":"': every token with a finite logprob fits that.
        finite = [t for t, lp in first.items() if lp.logprob > float("-inf")]
        assert finite
        for token_id in finite:
            text = tok.decode([token_id])
            assert '{"word":"'.startswith(text) or text.startswith('{"word":"'), text
