"""The edge's OpenAPI document, served at ``/openapi.json`` and kept in ``docs/openapi.json``.

``python -m edge.openapi`` rewrites ``docs/openapi.json``; a unit test fails when the committed file
differs from what the app serves. FastAPI's generated document is adjusted in one place here: the
request body is a named component (the route reads the body itself, to count bytes while reading),
bearer authentication is a security scheme, ``Idempotency-Key`` is a required header, and FastAPI's
default 422 answers are removed (the edge answers every validation failure as a typed 400; its own
422 is ``output_refused``). The
request body's bounds are the app's settings (``request_model_for``): the committed file shows the
defaults.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
_REF = "#/components/schemas/{model}"


def build(app: FastAPI) -> dict[str, Any]:
    from edge.routes.conversations import CreateConversationRequest
    from edge.routes.generations import GenerationDocument, request_model_for
    from edge.routes.ui import client_metrics_model_for

    settings = app.state.edge.settings
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


def render(app: FastAPI) -> str:
    return json.dumps(build(app), indent=2, sort_keys=True) + "\n"


def main() -> None:
    from edge.app import create_app
    from edge.settings import EdgeSettings

    # The document does not depend on the secrets: development mode lets it render without them.
    settings = EdgeSettings(read_model=False, capacity_check=False, dev_mode=True)
    DOC_PATH.write_text(render(create_app(settings)), encoding="utf-8")
    print(f"wrote {DOC_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
