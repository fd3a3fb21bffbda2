"""The edge's OpenAPI document: FastAPI's generated one, adjusted in one place (``build_openapi``).

The request body is a named component (the route reads the body itself, to count bytes while
reading), bearer authentication is a security scheme, ``Idempotency-Key`` is a required header, and
FastAPI's default 422 answers are removed (the edge answers every validation failure as a typed 400;
its own 422 is ``output_refused``). The request body's bounds are the app's settings
(``request_model_for``).

Served at ``/openapi.json`` (``edge.app`` calls ``build_openapi`` once, on the first request for it)
and written to ``docs/openapi.json`` by ``python -m edge.openapi``; this module imports neither.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from edge.routes.conversations import CreateConversationRequest
from edge.routes.generations import GenerationDocument, request_model_for
from edge.routes.ui import client_metrics_model_for
from edge.state import edge_of

_REF = "#/components/schemas/{model}"


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, with this edge's bounds (its ``Edge``'s settings)."""
    settings = edge_of(app).settings
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    # The routes read their bodies themselves (edge/body.py), so FastAPI sees none: each one's model is
    # declared here, with this edge's bounds.
    bodies = {
        ("/v1/generations", "post"): request_model_for(settings),
        ("/v1/conversations", "post"): CreateConversationRequest,
        ("/v1/client-metrics", "post"): client_metrics_model_for(settings.policy),
    }
    for model in (*bodies.values(), GenerationDocument):
        doc = model.model_json_schema(ref_template=_REF)
        schemas.update(doc.pop("$defs", {}))
        schemas[model.__name__] = doc
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}
    for path, ops in spec["paths"].items():
        for op in ops.values():
            if op.get("responses", {}).get("422", {}).get("description") == "Validation Error":
                op["responses"].pop("422")  # FastAPI's default; the edge's own 422 (output_refused) stays
            if path.startswith("/v1/"):
                op["security"] = [{"bearer": []}]
                op["responses"].setdefault("401", {"description": "unauthorized", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorDocument"}}}})
            for param in op.get("parameters", []):
                if param["name"] == "Idempotency-Key":
                    param["required"] = True
                    param["schema"] = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"}
                    param["description"] = "Client-chosen key of one logical request (printable ASCII)."
    for (path, method), model in bodies.items():
        spec["paths"][path][method]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    post = spec["paths"]["/v1/generations"]["post"]
    post["responses"]["200"]["content"]["application/json"] = {"schema": {"$ref": "#/components/schemas/GenerationDocument"}}
    return spec
