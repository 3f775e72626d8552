"""An OpenAI-compatible HTTP server: protocol (bodies, errors), scheduler (rows in, rows out),
app (routes). `create_app`, `make_server` and `serve` are the entry points."""

from .app import create_app, make_server, serve

__all__ = ["create_app", "make_server", "serve"]
