"""Function tools as harmony's developer message lists them: a TypeScript-like `namespace functions { ... }`
with one `type NAME = (_: {...}) => any;` per function, its JSON-schema parameters written as a type.

The rules (harmony docs/format.md "Defining available tools", and its renderer's behaviour): a function
without parameters is `() => any`; descriptions are `//` comments on the line above what they describe;
optional properties get `?`; integer is number; a string enum is its quoted values joined by ` | `;
arrays are `T[]`; `nullable` adds ` | null`; a default is a trailing comment (an enum's value bare, another
string quoted, anything else as JSON); nested objects are indented by four spaces per level. Schema
titles, examples and object-level descriptions, which the reference renderer also writes as comments,
are left out.
"""

from __future__ import annotations

import json
from typing import Any

_SCALARS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}


def schema_type(schema: Any, indent: str = "") -> str:
    """One JSON schema as a TypeScript-like type."""
    if not isinstance(schema, dict):
        return "any"
    for key in ("oneOf", "anyOf"):
        variants = schema.get(key)
        if isinstance(variants, list) and variants:
            return " | ".join(_nullable(v, schema_type(v, indent)) for v in variants)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = [_SCALARS.get(k, k) for k in kind if isinstance(k, str)]
        return " | ".join(names) if names else "any"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and (kind in (None, "string")) and all(isinstance(e, str) for e in enum):
        return " | ".join(json.dumps(e, ensure_ascii=False) for e in enum)
    if kind == "object":
        return _object(schema, indent) if isinstance(schema.get("properties"), dict) else "object"
    if kind == "array":
        items = schema.get("items")
        return f"{schema_type(items, indent)}[]" if isinstance(items, dict) else "Array<any>"
    return _SCALARS.get(kind, "any") if isinstance(kind, str) else "any"


def _nullable(schema: Any, text: str) -> str:
    if isinstance(schema, dict) and schema.get("nullable") is True and "null" not in text:
        return f"{text} | null"
    return text


def _default(schema: dict[str, Any]) -> str:
    value = schema["default"]
    if isinstance(value, str):
        return value if isinstance(schema.get("enum"), list) else json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _object(schema: dict[str, Any], indent: str) -> str:
    required = set(schema.get("required") or [])
    lines = ["{\n"]
    for name, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        for line in str(prop.get("description", "")).splitlines() if "description" in prop else []:
            lines.append(f"{indent}// {line}\n")
        optional = "" if name in required else "?"
        text = f"{indent}{name}{optional}: {_nullable(prop, schema_type(prop, indent + '    '))},"
        if "default" in prop:
            text += f" // default: {_default(prop)}"
        lines.append(text + "\n")
    lines.append(f"{indent}}}")
    return "".join(lines)


def function_signature(function: dict[str, Any]) -> str:
    """`type NAME = ...;` for one function of OpenAI's tools (its description as comment lines above)."""
    lines = [f"// {line}" for line in str(function.get("description") or "").splitlines()]
    params = function.get("parameters")
    if isinstance(params, dict) and params.get("properties"):
        lines.append(f"type {function['name']} = (_: {schema_type(params)}) => any;")
    else:
        lines.append(f"type {function['name']} = () => any;")
    return "\n".join(lines)


def tools_section(functions: list[dict[str, Any]]) -> str:
    """The developer message's `# Tools` section for OpenAI function tools."""
    body = "".join(f"{function_signature(f)}\n\n" for f in functions)
    return f"# Tools\n\n## functions\n\nnamespace functions {{\n\n{body}}} // namespace functions"
