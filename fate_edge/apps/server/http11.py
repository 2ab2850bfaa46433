"""Uvicorn's h11 protocol, answering the requests it rejects itself in the OpenAI error shape, and closing
connections that are slow to send their headers.

A request h11 cannot parse (a non-numeric ``Content-Length``, a malformed request line) never reaches
the app: uvicorn answers it with a plain-text 400. Clients of an OpenAI-compatible server parse the
``{"error": ...}`` body, so this protocol sends that instead.

Uvicorn has no header timeout: its keep-alive timer stops at the first byte of a request, so a connection
sending a header byte every few seconds (or nothing at all after connecting) stays open for ever. Here every
request's line and headers must arrive within ``header_timeout`` seconds of its first byte (or of the
connection, for the first one).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fate_edge.apps.server.errors import invalid

log = logging.getLogger("fate_edge.apps.server")


class JSONErrorH11Protocol(H11Protocol):
    header_timeout = 10.0  # with_timeouts() sets the daemon's
    _header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeouts(cls, header_timeout: float) -> type[JSONErrorH11Protocol]:
        return type(cls.__name__, (cls,), {"header_timeout": header_timeout})

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request begun, its headers not yet complete
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = asyncio.get_running_loop().call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request headers in %g s", self.header_timeout)
            self.transport.close()

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
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
