"""Stage: serve. An OpenAI-compatible HTTP server with continuous batching and a web chat page.

``server`` loads a run for serving (:class:`ServedModel`) and runs the process (:func:`serve`); ``app`` is the HTTP
layer, with ``chat_routes`` and ``response_routes`` (the Responses API: ``responses``, ``response_events``,
``response_store``) over ``service`` (what every route shares). Both OpenAI dialects parse into one internal chat
request (``request``); ``api`` holds the Chat Completions schemas, ``structured`` constrained replies and tool calls,
``errors`` the OpenAI error shape, ``limits`` the request limits, ``access`` who may use the server, ``metrics`` the
Prometheus metrics; ``static/`` is the page. Needs the ``serve`` extra (``pip install 'lmforge[serve]'``: fastapi,
uvicorn, prometheus_client).
"""

from lmforge.serve.access import exposure_warning
from lmforge.serve.server import ServedModel, bind, serve

__all__ = ["ServedModel", "bind", "exposure_warning", "serve"]
