"""/api/docs/: the OpenAPI schema rendered on the server, so the page works without any CDN or script
(Swagger UI and Redoc load their JavaScript from the internet; lorafleet hosts are often offline)."""
from __future__ import annotations

import json

from django.shortcuts import render
from drf_spectacular.generators import SchemaGenerator

from protocol.errors import ErrorCode


def _resolve(schema: dict, components: dict) -> dict:
    ref = schema.get("$ref")
    return components.get(ref.rsplit("/", 1)[-1], {}) if ref else schema


def _type(prop: dict, components: dict) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if prop.get("type") == "array":
        return f"array of {_type(prop.get('items', {}), components)}"
    if "allOf" in prop:
        return " / ".join(_type(p, components) for p in prop["allOf"])
    return prop.get("type", "any")


def _fields(schema: dict, components: dict) -> list[dict]:
    schema = _resolve(schema, components)
    required = set(schema.get("required", []))
    return [{"name": name, "type": _type(prop, components), "required": name in required,
             "description": prop.get("description", ""),
             "default": json.dumps(prop["default"]) if "default" in prop else ""}
            for name, prop in schema.get("properties", {}).items()]


def api_docs(request):
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema.get("components", {}).get("schemas", {})
    operations = []
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
            ok = (op.get("responses", {}).get("200") or {}).get("content", {}).get("application/json", {}).get("schema")
            operations.append({
                "method": method.upper(), "path": path, "id": op.get("operationId", ""),
                "description": op.get("description", ""),
                "request": _fields(body, components) if body else [],
                "response": _fields(ok, components) if ok else [],
                "errors": sorted(code for code in op.get("responses", {}) if code != "200"),
            })
    return render(request, "gateway/api_docs.html", {
        "info": schema["info"], "operations": operations,
        "lorafleet": _fields({"$ref": "#/components/schemas/Lorafleet"}, components),
        "worker_errors": sorted(((code.value, code.http_status) for code in ErrorCode), key=lambda kv: (kv[1], kv[0])),
    })
