"""The on-device assistant daemon (``fate-edge serve``): OpenAI-compatible HTTP API over one shared Engine."""

from fate_edge.apps.server.main import add_serve_parser, cmd_serve

__all__ = ["add_serve_parser", "cmd_serve", "create_app", "ServerSettings"]


def __getattr__(name: str):
    if name in ("create_app", "ServerSettings"):  # imported lazily: FastAPI is only needed to serve
        from fate_edge.apps.server import app

        return getattr(app, name)
    raise AttributeError(name)
