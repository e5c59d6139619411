"""Stage: serve. An OpenAI-compatible HTTP server with continuous batching and a web chat page.

``server`` loads a run for serving (:class:`ServedModel`: engine, tokenizer, the batching scheduler, the chat
renderer) and runs the process (:func:`serve`: bind, uvicorn, drain on SIGTERM); ``app`` is the HTTP layer
(FastAPI: routes, limits, streaming), which only calls the scheduler, with ``service`` (what every route shares:
the tenant of a request, its body, its scheduler requests) and ``response_routes`` (the Responses API's routes;
``responses``, ``response_events`` and ``response_store`` its schema, events and per-tenant store); ``access``
decides who may use it (the API keys, one tenant each; the allowed ``Host`` names); ``api`` holds the OpenAI
request schemas, error shape and response builders; ``metrics`` the Prometheus metrics; ``static/`` is the page. Needs the ``serve`` extra
(``pip install 'lmforge[serve]'``: fastapi, uvicorn, prometheus_client).
"""

from lmforge.serve.access import exposure_warning
from lmforge.serve.server import ServedModel, bind, serve

__all__ = ["ServedModel", "bind", "exposure_warning", "serve"]
