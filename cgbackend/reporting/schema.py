"""The report's JSON Schema (``cgbackend/reporting/report.schema.json``) and a small checker for the part of
JSON Schema it uses: ``type`` (one or a list), ``const``, ``enum``, ``properties``, ``required``,
``additionalProperties`` (false or a schema), ``items``, ``oneOf``, ``minimum`` / ``maximum`` and
local ``$ref`` (``#/$defs/...``). Any other keyword in the schema is an error, so the schema cannot
silently use something this checker ignores."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["check", "load_schema", "validate_report"]

_KNOWN = {"$schema", "$id", "$defs", "$ref", "title", "description", "type", "const", "enum",
          "properties", "required", "additionalProperties", "items", "oneOf", "minimum", "maximum"}
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def load_schema() -> dict[str, Any]:
    return json.loads(resources.files("cgbackend.reporting").joinpath("report.schema.json").read_text(encoding="utf-8"))


def check(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "$") -> list[str]:
    """Every place ``value`` breaks ``schema``, as "path: problem" strings (empty: valid)."""
    unknown = set(schema) - _KNOWN
    if unknown:
        return [f"{path}: schema uses keywords this checker does not know: {', '.join(sorted(unknown))}"]
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            return [f"{path}: only local #/$defs/ references are supported, got {ref}"]
        return check(value, root["$defs"][ref[len("#/$defs/"):]], root, path)
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {type(value).__name__}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    if "maximum" in schema and _TYPES["number"](value) and value > schema["maximum"]:
        errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if "oneOf" in schema:
        matches = [check(value, option, root, path) for option in schema["oneOf"]]
        if sum(not m for m in matches) != 1:
            errors.append(f"{path}: matches {sum(not m for m in matches)} of oneOf's schemas, not 1"
                          + (f" ({matches[0][0]})" if all(matches) and matches[0] else ""))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: missing required key {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors.extend(check(item, props[key], root, f"{path}.{key}"))
            elif extra is False:
                errors.append(f"{path}: key {key!r} is not in the schema")
            elif isinstance(extra, dict):
                errors.extend(check(item, extra, root, f"{path}.{key}"))
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors.extend(check(item, schema["items"], root, f"{path}[{i}]"))
    return errors


def validate_report(report: Any) -> list[str]:
    """Problems of a Report (or its to_dict() / parsed JSON) against the committed schema."""
    data = json.loads(report.to_json()) if hasattr(report, "to_json") else report
    schema = load_schema()
    return check(data, schema, schema)
