"""The server's structured-output fields -> StructuredOutputsParams, as vLLM reads them.

    response_format   {"type": "text"} (none), {"type": "json_object"}, or {"type": "json_schema",
                      "json_schema": {"name", "schema", "strict"}} (OpenAI; chat and completions)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object", "disable_any_whitespace"}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names

At most one of them per request. Errors are ValueErrors that start with the field's name (a 400
naming it). A spec that parses here but does not compile fails in the engine core, also as a 400.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from vlite.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _response_format(value: dict[str, Any]) -> Optional[dict[str, Any]]:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format of type json_schema needs a json_schema object "
                             "({\"name\": ..., \"schema\": {...}})")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            raise ValueError("response_format needs json_schema.schema (the JSON schema)")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"response_format json_schema.schema must be a JSON schema object, got "
                             f"{type(schema).__name__}")
        return {"json": schema}
    raise ValueError(f"response_format type must be one of text, json_object, json_schema; got {kind!r}")


def structured_outputs_of(request: Any) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's constraint and the field that set it ((None, None) when unconstrained)."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ValueError("response_format must be an object")
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    so = getattr(request, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError("structured_outputs must be an object")
        found.append(("structured_outputs", dict(so)))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(request, name, None)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None, None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise ValueError(f"{names[0]} cannot be combined with {', '.join(names[1:])}: use one kind of structured "
                         "output per request")
    name, spec = found[0]
    if name == "guided_json" and isinstance(spec["json"], str):
        try:
            json.loads(spec["json"])
        except ValueError as e:
            raise ValueError(f"guided_json is not valid JSON: {e}") from None
    known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{name} has unsupported keys {unknown}; supported: {sorted(known)}")
    try:
        return StructuredOutputsParams(**spec), name
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is invalid: {e}") from None


def constraint_field(request: Any) -> Optional[str]:
    """The field whose constraint the request runs under: a structured-output field, else `tools` when
    tool_choice is "required" or a named function (their calls are generated under a JSON schema)."""
    try:
        field = structured_outputs_of(request)[1]
    except ValueError:
        field = None
    choice = getattr(request, "tool_choice", None)
    if getattr(request, "tools", None) and choice is not None and choice not in ("none", "auto"):
        return "tools"
    return field
