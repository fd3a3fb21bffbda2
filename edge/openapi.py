"""The edge's OpenAPI document, served at ``/openapi.json`` and kept in ``docs/openapi.json``.

``python -m edge.openapi`` rewrites ``docs/openapi.json``; a unit test fails when the committed file
differs from what the app serves. FastAPI's generated document is adjusted in one place,
``edge.openapi_spec.build_openapi`` (which ``edge.app`` serves): the request body is a named
component (the route reads the body itself, to count bytes while reading), bearer authentication is a
security scheme, ``Idempotency-Key`` is a required header, and FastAPI's default 422 answers are
removed (the edge answers every validation failure as a typed 400; its own 422 is
``output_refused``). The request body's bounds are the app's settings (``request_model_for``): the
committed file shows the defaults.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastapi import FastAPI

from edge.app import create_app
from edge.openapi_spec import build_openapi
from edge.settings import EdgeSettings

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"


def render(app: FastAPI) -> str:
    return json.dumps(build_openapi(app), indent=2, sort_keys=True) + "\n"


def main() -> None:
    # The document does not depend on the secrets: development mode lets it render without them.
    settings = EdgeSettings(read_model=False, capacity_check=False, dev_mode=True)
    DOC_PATH.write_text(render(create_app(settings)), encoding="utf-8")
    print(f"wrote {DOC_PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
