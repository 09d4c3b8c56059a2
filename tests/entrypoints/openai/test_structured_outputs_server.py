"""Structured outputs through `vlite serve` (the session's server): the openai client's
`chat.completions.parse` with a pydantic model, response_format json_object / json_schema, vLLM's
structured_outputs and guided_* fields on both endpoints, streaming, and invalid specs as 400s
naming the field (from the API process, or from the engine core's compilation)."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Italy", "Spain", "Germany"]
    population_millions: int = Field(ge=0, le=40)
    capital: bool


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def _chat(server, **body):
    body.setdefault("messages", [{"role": "user", "content": "Describe Paris as JSON."}])
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)


def test_parse_with_pydantic_model(server, client):
    model = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]
    completion = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, max_tokens=96, temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City), choice.message.content
    City.model_validate_json(choice.message.content)


def test_response_format_json_object_and_schema(server):
    r = _chat(server, response_format={"type": "json_object"}, max_tokens=96, temperature=0.0)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["old", "big"]},
                                                        "maxItems": 2}},
              "required": ["city", "tags"], "additionalProperties": False}
    r = _chat(server, response_format={"type": "json_schema",
                                       "json_schema": {"name": "c", "schema": schema, "strict": True}},
              max_tokens=64, temperature=1.0, seed=3, n=3)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_guided_fields_on_both_endpoints_and_streaming(server):
    r = _chat(server, guided_choice=["red", "green", "blue"], max_tokens=8, temperature=1.0, seed=1)
    assert r.json()["choices"][0]["message"]["content"] in ("red", "green", "blue"), r.text
    r = _chat(server, structured_outputs={"regex": r"[0-9]{3}-[A-Z]{2}"}, max_tokens=16)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", r.json()["choices"][0]["message"]["content"]), r.text
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": "The answer is", "guided_regex": r"(yes|no)\.", "max_tokens": 8})
    assert r.json()["choices"][0]["text"] in ("yes.", "no."), r.text
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": "Sum:", "guided_grammar": 'root ::= [1-9] " + " [1-9]', "max_tokens": 8})
    assert re.fullmatch(r"[1-9] \+ [1-9]", r.json()["choices"][0]["text"]), r.text
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": "JSON:", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"]}}}, "max_tokens": 32, "temperature": 0})
    assert json.loads(r.json()["choices"][0]["text"])["ok"] in (True, False), r.text
    # Streamed: the deltas assemble to an output of the grammar.
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120, json={
            "messages": [{"role": "user", "content": "Pick one."}], "stream": True, "max_tokens": 32,
            "temperature": 0,  # a sample may spend its 32 tokens on the whitespace JSON allows
            "guided_json": {"type": "object", "properties": {"pick": {"enum": ["a", "b"]}},
                            "required": ["pick"]}}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert json.loads(text)["pick"] in ("a", "b"), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(abc"}, "guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    # a keyword the grammar backend would silently ignore
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    # streamed: the engine core's compile error still comes before the stream, as a 400
    ({"stream": True, "guided_grammar": 'root ::= "a" ( '}, "guided_grammar"),
    ({"stream": True, "n": 2, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
])
def test_invalid_specs_are_400_naming_the_field(server, body, param):
    r = _chat(server, max_tokens=8, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"], err


def test_streamed_completion_compile_error_is_a_400(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "guided_regex": "[a-"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    # the server goes on serving constrained streams
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=120, json={
        "prompt": "x", "stream": True, "max_tokens": 4, "guided_regex": "[a-c]{2}"})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert re.fullmatch("[a-c]{2}", "".join(c["choices"][0]["text"] for c in chunks)), r.text
