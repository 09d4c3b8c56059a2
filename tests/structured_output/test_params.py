"""StructuredOutputsParams and the server's field mapping: validation, cache keys, the missing-extra hint."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import msgspec
import pytest

from vlite.entrypoints.openai.structured_outputs import constraint_field, structured_outputs_of
from vlite.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind_and_field_named_errors():
    for bad, field in [({}, "exactly one"), ({"regex": "a", "json_object": True}, "exactly one"),
                       ({"json": "[1, 2]"}, "structured_outputs.json"), ({"json": "{x"}, "structured_outputs.json"),
                       ({"regex": ""}, "structured_outputs.regex"), ({"grammar": 3}, "structured_outputs.grammar"),
                       ({"choice": ["a", ""]}, "structured_outputs.choice"),
                       ({"choice": "ab"}, "structured_outputs.choice")]:
        with pytest.raises(ValueError, match=field):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]


def test_cache_key_ignores_key_order_and_survives_the_wire():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a.key() == b.key()
    assert a.key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key()
    params = SamplingParams(max_tokens=4, structured_outputs=a)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)  # API -> engine core
    assert back.structured_outputs == a and back.structured_outputs.key() == a.key()


def _req(**fields):
    base = dict(response_format=None, structured_outputs=None, guided_json=None, guided_regex=None,
                guided_choice=None, guided_grammar=None)
    return SimpleNamespace(**{**base, **fields})


def test_server_fields():
    schema = {"type": "object"}
    assert structured_outputs_of(_req()) == (None, None)
    assert structured_outputs_of(_req(response_format={"type": "text"})) == (None, None)
    so, field = structured_outputs_of(_req(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema}}))
    assert (so.json, field) == (schema, "response_format")
    assert structured_outputs_of(_req(response_format={"type": "json_object"}))[0].json_object
    assert structured_outputs_of(_req(guided_choice=["a", "b"]))[0].choice == ["a", "b"]
    assert structured_outputs_of(_req(guided_json='{"type": "object"}'))[0].json == '{"type": "object"}'
    assert structured_outputs_of(_req(structured_outputs={"regex": "a+", "disable_any_whitespace": True}))[0].regex
    for req, field in [(_req(response_format={"type": "json_schema"}), "response_format"),
                       (_req(guided_regex="a", guided_choice=["a"]), "guided_regex"),
                       (_req(structured_outputs={"regexp": "a"}), "structured_outputs"),
                       (_req(guided_json="{nope"), "guided_json"),
                       (_req(guided_choice=[]), "guided_choice")]:
        with pytest.raises(ValueError) as e:
            structured_outputs_of(req)
        assert str(e.value).split(" ", 1)[0] == field, str(e.value)  # the server's 400 names the field
    assert constraint_field(_req(guided_regex="a")) == "guided_regex"
    assert constraint_field(SimpleNamespace(**vars(_req()), tools=[{}], tool_choice="required")) == "tools"


def test_missing_xgrammar_names_the_extra(monkeypatch):
    from vlite.structured_output.backend_xgrammar import import_xgrammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    with pytest.raises(ImportError, match=r"vlite\[structured\]"):
        import_xgrammar()


# keyword -> (a schema using it, an instance breaking it)
_P = {"a": {"type": "integer"}, "b": {"type": "integer"}}
UNENFORCED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "if": ({"type": "object", "properties": _P, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]}}, '{"a": 1}'),
    "dependentRequired": ({"type": "object", "properties": _P, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "properties": _P, "dependentSchemas": {"a": {"required": ["b"]}}},
                         '{"a": 1}'),
    "dependencies": ({"type": "object", "properties": _P, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_keywords_the_backend_cannot_enforce_are_refused_by_name(keyword: str) -> None:
    """Each refused keyword is one xgrammar compiles but ignores (an instance breaking it completes the
    grammar: if an xgrammar upgrade enforces one, this fails and the keyword leaves the list); the error
    names the keyword and where it is; property names and enum data that look like keywords are not refused."""
    import json

    xgr = pytest.importorskip("xgrammar")
    schema, breaking = UNENFORCED[keyword]
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)]))
                                 .compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert matcher.accept_string(breaking) and matcher.is_completed()
    nested = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(ValueError, match=f"structured_outputs.json .*{keyword} at properties.x"):
        StructuredOutputsParams(json=nested)
    lookalike = {"type": "object", "properties": {keyword: {"type": "integer"}}, "enum": [{keyword: 1}]}
    assert StructuredOutputsParams(json=lookalike).kind == "json"
