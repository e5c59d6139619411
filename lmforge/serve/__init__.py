"""Stage: serve. An OpenAI-compatible HTTP server with continuous batching and a web chat page.

``server`` loads a run for serving (:class:`ServedModel`: engine, tokenizer, the batching scheduler, the chat
renderer) and runs the process (:func:`serve`: bind, uvicorn, drain on SIGTERM); ``app`` is the HTTP layer
(FastAPI: middleware, error shape, the page, health, models, embeddings, tokenize, metrics), with ``chat_routes``
(chat completions and completions) and ``response_routes`` (the Responses API; ``responses``, ``response_events``
and ``response_store`` its schema, events and per-tenant store) over ``service`` (what every route shares: the
tenant of a request, its body, its scheduler jobs). Both OpenAI dialects parse into one internal chat request
(``request``); ``api`` holds the Chat Completions schemas and response builders, ``errors`` the OpenAI error shape,
``limits`` the request limits (token counts, salts, JSON-Schema size); ``access`` decides who may use the server
(the API keys, one tenant each; the allowed ``Host`` names); ``metrics`` the Prometheus metrics; ``static/`` is the
page. Needs the ``serve`` extra (``pip install 'lmforge[serve]'``: fastapi, uvicorn, prometheus_client).
"""

from lmforge.serve.access import exposure_warning
from lmforge.serve.server import ServedModel, bind, serve

__all__ = ["ServedModel", "bind", "exposure_warning", "serve"]
