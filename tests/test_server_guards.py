"""The daemon's app in-process (one engine, apps with different settings): web pages and DNS rebinding kept out,
JSON required, lone surrogates and context overflow answered as typed 4xx errors, 401s naming Bearer."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_server import BUDGET, CHAT, COMP, MODEL, _assert_error_shape

from fate_edge.errors import ContextLengthError, GenerationError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    from fate_edge import Engine

    with Engine.load(memory_budget=BUDGET, device="cpu") as eng:
        yield eng


def _app_client(engine, **settings) -> TestClient:
    from fate_edge.apps.engine_args import EngineOptions
    from fate_edge.apps.server import ServerSettings, create_app

    options = EngineOptions(memory_budget=BUDGET, device="cpu")
    app = create_app(ServerSettings(engine=options, **settings), engine=engine)
    return TestClient(app, base_url="http://127.0.0.1:8080")


@pytest.fixture(scope="module")
def tc(engine):
    with _app_client(engine) as c:
        yield c


GOOD = {"prompt": "x = ", "max_tokens": 2, "temperature": 0}


# --------------------------------------------------------------------------- Host and Origin
@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost", "LOCALHOST:1234", "[::1]:8080"])
def test_loopback_host_names_are_served(tc, host):
    assert tc.post(COMP, json=GOOD, headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "[::2]:8080"])
def test_a_host_that_does_not_name_this_server_is_refused(tc, host):
    err = _assert_error_shape(tc.post(COMP, json=GOOD, headers={"Host": host}), 403, "permission_error")
    assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
    _assert_error_shape(tc.get("/v1/models", headers={"Host": host}), 403, "permission_error")


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost:3000", "null"])
def test_cross_origin_requests_are_refused_by_default(tc, origin):
    for resp in (
        tc.post(COMP, json=GOOD, headers={"Origin": origin}),
        tc.get("/v1/models", headers={"Origin": origin}),
        tc.options(COMP, headers={"Origin": origin, "Access-Control-Request-Method": "POST"}),
    ):
        err = _assert_error_shape(resp, 403, "permission_error")
        assert err["code"] == "origin_not_allowed" and "--cors-origins" in err["message"]
        assert "access-control-allow-origin" not in resp.headers


def test_allowed_hosts_and_cors_origins_open_the_guard(engine):
    web = "http://localhost:3000"
    with _app_client(engine, allowed_hosts=["assistant.lan"], cors_origins=[web]) as c:
        assert c.post(COMP, json=GOOD, headers={"Host": "assistant.lan:8080"}).status_code == 200
        _assert_error_shape(c.post(COMP, json=GOOD, headers={"Host": "other.lan"}), 403, "permission_error")
        pre = c.options(
            COMP,
            headers={
                "Origin": web,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == web
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        resp = c.post(COMP, json=GOOD, headers={"Origin": web})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == web
        _assert_error_shape(
            c.post(COMP, json=GOOD, headers={"Origin": "https://evil.example"}), 403, "permission_error"
        )
    with _app_client(engine, allowed_hosts=["*"], cors_origins=["*"]) as c:
        resp = c.post(COMP, json=GOOD, headers={"Host": "anything.example", "Origin": "https://any.example"})
        assert resp.status_code == 200


def test_the_bound_address_is_an_allowed_host(engine):
    with _app_client(engine, host="192.168.7.9") as c:
        assert c.post(COMP, json=GOOD, headers={"Host": "192.168.7.9:8080"}).status_code == 200
    with _app_client(engine, host="0.0.0.0") as c:  # "any address" is no name a client can use
        _assert_error_shape(c.post(COMP, json=GOOD, headers={"Host": "0.0.0.0:8080"}), 403, "permission_error")


# --------------------------------------------------------------------------- content type
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_json_body_needs_the_json_content_type(tc, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    resp = tc.post(COMP, content=b'{"prompt": "x = ", "max_tokens": 2}', headers=headers)
    err = _assert_error_shape(resp, 415, "invalid_request_error")
    assert "application/json" in err["message"]
    ok = tc.post(
        COMP,
        content=b'{"prompt": "x = ", "max_tokens": 2}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "path,raw,param",
    [
        (COMP, rb'{"prompt": "\udfff", "max_tokens": 4}', "prompt"),
        (CHAT, rb'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4}', "messages[0].content"),
        (
            CHAT,
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
            "messages[0].content[0].text",
        ),
        (COMP, rb'{"prompt": "x", "stop": ["\ud83d"]}', "stop[0]"),
        (COMP, rb'{"prompt": "x", "model": "\udfff"}', "model"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(tc, path, raw, param):
    resp = tc.post(path, content=raw, headers={"Content-Type": "application/json"})
    err = _assert_error_shape(resp, 400, "invalid_request_error")
    assert err["param"] == param and "surrogate" in err["message"]
    assert tc.post(COMP, json=GOOD).status_code == 200  # still serving


def test_a_valid_surrogate_pair_is_text(tc):
    resp = tc.post(
        COMP, content=rb'{"prompt": "\ud83d\ude00 = ", "max_tokens": 2}', headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 200, resp.text


def test_401_names_the_bearer_scheme(engine):
    with _app_client(engine, api_key="k3y") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = c.post(COMP, json=GOOD, headers=headers)
            _assert_error_shape(resp, 401, "authentication_error")
            assert resp.headers["www-authenticate"] == "Bearer"
        assert c.post(COMP, json=GOOD, headers={"Authorization": "Bearer k3y"}).status_code == 200


# --------------------------------------------------------------------------- context overflow, by type
def test_context_overflow_is_a_typed_error(engine):
    ids = [5] * engine.model.config.max_position_embeddings
    with pytest.raises(ContextLengthError) as exc:
        engine.generate_text(ids)
    assert exc.value.prompt_tokens == len(ids) and exc.value.context == len(ids)
    assert isinstance(exc.value, GenerationError)  # callers catching GenerationError still catch it


def test_context_overflow_maps_to_context_length_exceeded_by_type_not_by_message():
    from fate_edge.apps.server.errors import error_from_exception

    err = error_from_exception(ContextLengthError(2000, 1024), "prompt")
    assert (err.status, err.type, err.code, err.param) == (
        400,
        "exceed_context_size_error",
        "context_length_exceeded",
        "prompt",
    )
    assert err.body()["error"]["n_ctx"] == 1024 and err.body()["error"]["n_prompt_tokens"] == 2000
    other = error_from_exception(GenerationError("top_p must be in (0, 1] for this context"))
    assert (other.status, other.type, other.code) == (400, "invalid_request_error", None)


def test_server_answers_context_overflow_as_context_length_exceeded(tc):
    for path, body, param in (
        (COMP, {"prompt": [5] * 2000}, "prompt"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
    ):
        err = _assert_error_shape(tc.post(path, json=body), 400, "exceed_context_size_error")
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1024
