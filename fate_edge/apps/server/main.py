"""``fate-edge serve``: run the OpenAI-compatible daemon under uvicorn.

SIGTERM (and Ctrl-C) stop accepting connections, let in-flight requests finish (streams included, up to
``--shutdown-timeout`` seconds), close the engine and exit 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys

from fate_edge.apps.cli_args import comma_list
from fate_edge.apps.engine_args import EngineOptions, add_engine_args
from fate_edge.errors import FateEdgeError


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP daemon (chat/completions, SSE, /metrics, /health)",
        description="Serve the model over an OpenAI-compatible API. Binds 127.0.0.1 by default.",
    )
    add_engine_args(p)  # model, budget, policy, device, dtype, link, threads, verify: as run/chat/demo
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--unix-socket", default=None, metavar="PATH", help="listen on a Unix socket instead of TCP")
    p.add_argument(
        "--socket-mode",
        default="600",
        metavar="OCTAL",
        help="permissions of the --unix-socket file (default 600: only this user may connect)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAMES",
        help="comma-separated Host names to accept besides localhost, 127.0.0.1, [::1] and the --host "
        "address ('*': any); other Hosts get 403 (blocks DNS rebinding)",
    )
    p.add_argument(
        "--cors-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API, e.g. http://localhost:3000 "
        "('*': any); requests from other origins get 403 (default: none)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("FATE_EDGE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $FATE_EDGE_API_KEY, else no key)",
    )
    p.add_argument("--model-alias", default=None, help="model id to report and accept (default: directory name)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=0,
        help="concurrent requests served together in one batch, each streaming on its own (default 0: "
        "8 on a CPU, 16 on a GPU; 1 serves one request at a time)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait behind the running one; more get 429 (default 16)",
    )
    p.add_argument("--max-body-bytes", default="1MB", help="largest request body; larger gets 413 (default 1MB)")
    p.add_argument(
        "--max-tokens-default",
        default=None,
        help="max_tokens when a request gives none: a number, or 'context' (the default: until end of text or "
        "the context is full, as llama-server and Ollama)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds in-flight requests get to finish after SIGTERM (default 60)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send a request's line and headers; slower connections are closed "
        "(default 10)",
    )
    p.add_argument(
        "--body-timeout", type=float, default=60.0, help="seconds a client may take to send a body; 408 (default 60)"
    )
    p.add_argument(
        "--max-connections", type=int, default=64, help="open connections at once; more get 503 (default 64)"
    )
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="testing only: add POST /debug/fault-injection, which makes expert reads fail on demand",
    )
    p.set_defaults(func=cmd_serve)
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from fate_edge.apps.server.app import ServerSettings, create_app
    from fate_edge.apps.server.http11 import JSONErrorH11Protocol
    from fate_edge.apps.server.unix_socket import bind_unix_socket, parse_mode
    from fate_edge.runtime.auto_budget import is_auto
    from fate_edge.runtime.budget import parse_bytes

    try:
        if not is_auto(args.memory_budget):  # auto: chosen when the engine loads, and said on one line
            parse_bytes(args.memory_budget)
        max_body = parse_bytes(args.max_body_bytes)
    except ValueError as exc:
        raise FateEdgeError(str(exc)) from None
    if args.max_queue < 0:
        raise FateEdgeError(f"--max-queue must be >= 0, got {args.max_queue}")
    if min(args.header_timeout, args.body_timeout) <= 0 or args.max_connections < 1:
        raise FateEdgeError("--header-timeout and --body-timeout must be > 0 s and --max-connections >= 1")
    if args.max_batch < 0:
        raise FateEdgeError(f"--max-batch must be >= 0 (0: the machine's default), got {args.max_batch}")
    socket_mode = parse_mode(args.socket_mode)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    if not args.unix_socket and not _is_loopback(args.host) and not args.api_key:
        logging.getLogger("fate_edge.apps.server").warning(
            "listening on %s without --api-key: anyone who can reach this address can use the model", args.host
        )
    settings = ServerSettings(
        engine=EngineOptions.from_args(args),
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        max_body_bytes=max_body,
        default_max_tokens=args.max_tokens_default,
        model_alias=args.model_alias,
        enable_fault_injection=args.enable_fault_injection,
        host=args.host,
        # no browser reaches a Unix socket, and its clients send all kinds of Host names
        allowed_hosts=["*"] if args.unix_socket else comma_list(args.allowed_hosts),
        cors_origins=comma_list(args.cors_origins),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
    )
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        access_log=args.log_level == "debug",
        lifespan="on",
        http=JSONErrorH11Protocol.with_timeouts(args.header_timeout),
        timeout_keep_alive=5,  # an idle kept-alive connection closes after this (uvicorn's default, said here)
        limit_concurrency=args.max_connections,
    )
    server = uvicorn.Server(config)
    bound = bind_unix_socket(args.unix_socket, socket_mode) if args.unix_socket else None  # refuses a live one
    where = f"unix:{args.unix_socket}" if args.unix_socket else f"http://{args.host}:{args.port}"
    print(
        f"fate-edge serve: {where} (model {app.state.fate_edge.model_id}, policy {args.policy}, expert budget "
        f"{args.memory_budget}; loading in the background, GET /health turns 200 when ready)",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn re-raises a caught SIGTERM once it has drained; with this handler in place that re-raise is a
    # no-op and the process exits 0 after a graceful shutdown instead of dying of the signal.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[bound.sock] if bound else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if bound is not None:
            bound.cleanup()
    from fate_edge.runtime.load_threads import exit_if_loading

    exit_if_loading(0)  # stopped while the model still loads (converts): exit now, not abort at interpreter exit
    err = app.state.fate_edge.load_error
    if err is not None:
        if isinstance(err, FateEdgeError):
            raise err
        raise FateEdgeError(f"cannot load the model: {err}") from err
    return 0
