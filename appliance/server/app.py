"""The Litestar application factory."""

from __future__ import annotations

from litestar import Litestar
from litestar.datastructures import State

from appliance.server import admin, lora_routes, ops, routes
from appliance.server.errors import exception_handler
from appliance.server.openapi_doc import openapi_json
from appliance.server.state import ServerState


def create_app(state: ServerState) -> Litestar:
    return Litestar(
        route_handlers=[
            routes.router(),
            admin.router(),
            lora_routes.router(),
            *ops.route_handlers,
            openapi_json,
        ],
        exception_handlers={Exception: exception_handler},
        request_max_body_size=state.config.server.max_request_body_bytes,
        state=State({"server": state}),
        # No Litestar schema generation (the routes decode their own bodies, so it would
        # describe none: /openapi.json comes from the Structs, openapi_doc.py), and no
        # Litestar logging setup: the daemon configures logging once.
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
