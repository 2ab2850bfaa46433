"""Uvicorn's h11 protocol, answering the requests it rejects itself in the OpenAI error shape.

A request h11 cannot parse (a non-numeric ``Content-Length``, a malformed request line) never reaches
the app: uvicorn answers it with a plain-text 400. Clients of an OpenAI-compatible server parse the
``{"error": ...}`` body, so this protocol sends that instead.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fate_edge.apps.server.errors import invalid


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = (
            invalid(
                f"malformed HTTP request ({msg.rstrip('.')}): check the request line and headers, such as "
                "Content-Length"
            )
            .response()
            .body
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=bytes(body))))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
