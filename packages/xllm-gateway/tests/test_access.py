"""API keys and priority permission: the policy on its own, then through the app (the fake engine)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from xllm.gateway.access import AccessPolicy, Caller
from xllm.gateway.app import create_app
from xllm.gateway.metrics import EngineMetrics
from xllm.gateway.openai.errors import APIError
from xllm.gateway.openai.protocol import ChatCompletionRequest

MSG = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
KEYS = AccessPolicy(api_keys=frozenset({"sk-user"}), priority_keys=frozenset({"sk-prio"}))


def status_of(fn, *args) -> int:
    try:
        fn(*args)
    except APIError as err:
        return err.status
    return 200


# ---- the policy -----------------------------------------------------------------------------------


def test_open_server_takes_anyone_without_priority():
    open_ = AccessPolicy()
    assert not open_.requires_key
    assert open_.authenticate(None) == Caller(False, False, admin=True)  # no keys: anyone may do anything
    assert open_.authenticate("Bearer whatever") == Caller(False, False, admin=True)


def test_keys_are_required_and_checked():
    assert KEYS.requires_key
    for header in (None, "", "Bearer", "Bearer ", "Basic sk-user", "sk-user", "Bearer sk-use", "Bearer sk-user2",
                   "Bearer SK-USER"):
        with pytest.raises(APIError) as info:
            KEYS.authenticate(header)
        assert (info.value.status, info.value.type) == (401, "authentication_error")
    assert KEYS.authenticate("Bearer sk-user") == Caller(True, False)
    assert KEYS.authenticate("bearer  sk-user ") == Caller(True, False)
    assert KEYS.authenticate("Bearer sk-prio") == Caller(True, True)  # a priority key is an API key too


def test_priority_keys_without_api_keys():
    policy = AccessPolicy(priority_keys=frozenset({"sk-prio"}))
    assert not policy.requires_key
    assert policy.authenticate(None) == Caller(False, False, admin=True)
    assert policy.authenticate("Bearer nope") == Caller(False, False, admin=True)
    assert policy.authenticate("Bearer sk-prio") == Caller(True, True, admin=True)


def test_allow_client_priority():
    policy = AccessPolicy(allow_client_priority=True)
    assert policy.authenticate(None) == Caller(False, True, admin=True)
    with pytest.raises(ValueError, match="--allow-client-priority"):
        AccessPolicy(api_keys=frozenset({"k"}), allow_client_priority=True)
    for bad in ("", " k", "k\n"):
        with pytest.raises(ValueError, match="non-empty"):
            AccessPolicy(api_keys=frozenset({bad}))


@pytest.mark.parametrize(("fields", "param"), [({"priority": -1}, "priority"),
                                               ({"service_tier": "priority"}, "service_tier"),
                                               ({"service_tier": "scale"}, "service_tier"),
                                               ({"service_tier": "flex", "priority": -2}, "priority")])
def test_check_priority(fields, param):
    req = ChatCompletionRequest.model_validate({"messages": MSG, **fields})
    with pytest.raises(APIError) as info:
        AccessPolicy.check_priority(Caller(True, False), req)
    assert (info.value.status, info.value.type, info.value.param) == (403, "permission_error", param)
    AccessPolicy.check_priority(Caller(True, True), req)
    default = ChatCompletionRequest.model_validate({"messages": MSG, "priority": 0, "service_tier": "default"})
    AccessPolicy.check_priority(Caller(False, False), default)


@pytest.mark.parametrize("fields", [{"service_tier": "flex"}, {"priority": 1}, {"priority": 9},
                                    {"service_tier": "flex", "priority": 3}])
def test_asking_for_less_needs_no_permission(fields):
    """Offline (flex) and lower priorities are downgrades: anyone may ask for them."""
    req = ChatCompletionRequest.model_validate({"messages": MSG, **fields})
    AccessPolicy.check_priority(Caller(False, False), req)


def test_scheduling_maps_tier_and_priority():
    def sched(policy: AccessPolicy, **fields):
        s = policy.scheduling(ChatCompletionRequest.model_validate({"messages": MSG, **fields}))
        return s.priority, s.offline, s.service_tier

    default = AccessPolicy()
    assert sched(default) == (0, False, "default")
    assert sched(default, service_tier="auto") == (0, False, "default")
    assert sched(default, service_tier="flex") == (1, True, "flex")
    assert sched(default, priority=1) == (1, True, "flex")  # at or above --offline-priority (1)
    assert sched(default, priority=-4) == (-4, False, "default")
    assert sched(default, service_tier="priority") == (-1, False, "priority")
    assert sched(default, service_tier="flex", priority=-2) == (-2, True, "flex")  # flex is offline regardless
    high = AccessPolicy(offline_priority=10)
    assert sched(high, priority=9) == (9, False, "default")  # lower priority, still online
    assert sched(high, priority=10) == (10, True, "flex")
    assert sched(high, service_tier="flex") == (1, True, "flex")


# ---- through the app ------------------------------------------------------------------------------


@pytest.fixture
def app_with(fake_state):
    """``app_with(access=...)``: a test client of an app over the fake engine with those settings."""
    from fastapi.testclient import TestClient

    clients = []

    def make(**changes):
        state = dataclasses.replace(fake_state, metrics=EngineMetrics(), **changes)  # one metrics registry per app
        c = TestClient(create_app(state), raise_server_exceptions=False)
        clients.append(c.__enter__())
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def assert_error(r, status: int, type_: str, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"]) == (type_, param), err
    return err


def test_api_key_on_every_v1_route_only(app_with, fake_engine):
    client = app_with(access=KEYS)
    for method, path, body in (("POST", CHAT, {"messages": MSG, "max_tokens": 1}),
                               ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("GET", "/v1/models", None), ("GET", "/v1/nope", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic sk-user"}):
            r = client.request(method, path, json=body, headers=headers)
            err = assert_error(r, 401, "authentication_error")
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            assert "sk-user" not in r.text
    assert fake_engine.submitted == []
    ok = {"Authorization": "Bearer sk-user"}
    assert client.post(CHAT, json={"messages": MSG, "max_tokens": 1}, headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-prio"}).status_code == 200
    assert client.get("/health").status_code == 200  # probes and scrapers need no key
    assert client.get("/metrics").status_code == 200


def test_auth_comes_before_the_body_is_read(app_with):
    """A client without a key cannot make the server read (or size-check) a body."""
    client = app_with(access=KEYS)
    r = client.post(CHAT, content=b"x" * 100, headers={"content-length": str(10**12)})
    assert r.status_code == 401


@pytest.mark.parametrize(("fields", "param", "engine_priority"), [
    ({"priority": -3}, "priority", -3), ({"service_tier": "priority"}, "service_tier", -1),
    ({"service_tier": "scale"}, "service_tier", -1),
])
def test_priority_needs_permission(app_with, fake_engine, fields, param, engine_priority):
    body = {"messages": MSG, "max_tokens": 1, **fields}
    default_server = app_with()
    err = assert_error(default_server.post(CHAT, json=body), 403, "permission_error", param)
    assert err["code"] == "permission_denied"
    keyed = app_with(access=KEYS)
    assert_error(keyed.post(CHAT, json=body, headers={"Authorization": "Bearer sk-user"}), 403,
                 "permission_error", param)
    assert_error(keyed.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **fields},
                            headers={"Authorization": "Bearer sk-user"}), 403, "permission_error", param)
    assert fake_engine.submitted == []
    r = keyed.post(CHAT, json=body, headers={"Authorization": "Bearer sk-prio"})
    assert r.status_code == 200, r.text
    permissive = app_with(access=AccessPolicy(allow_client_priority=True))
    assert permissive.post(CHAT, json=body).status_code == 200
    assert [q.priority for q in fake_engine.submitted] == [engine_priority, engine_priority]


def test_default_scheduling_needs_no_permission(app_with, fake_engine):
    client = app_with()
    for fields in ({}, {"priority": 0}, {"service_tier": "auto"}, {"service_tier": "default"}):
        assert client.post(CHAT, json={"messages": MSG, "max_tokens": 1, **fields}).status_code == 200
    assert [q.priority for q in fake_engine.submitted] == [0, 0, 0, 0]


def test_flex_is_offline_for_anyone_and_echoed(app_with, fake_engine):
    """service_tier flex (and a priority at or above --offline-priority) needs no permission, reaches
    the engine as offline, and the response echoes the tier it was served at (OpenAI does)."""
    keyed = app_with(access=KEYS)
    user = {"Authorization": "Bearer sk-user"}
    r = keyed.post(CHAT, json={"messages": MSG, "max_tokens": 2, "service_tier": "flex"}, headers=user)
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "flex"
    r = keyed.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": 4}, headers=user)
    assert r.status_code == 200, r.text
    assert r.json()["service_tier"] == "flex"
    r = keyed.post(CHAT, json={"messages": MSG, "max_tokens": 2, "stream": True, "service_tier": "flex"},
                   headers=user)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events and all(e["service_tier"] == "flex" for e in events)
    r = keyed.post(CHAT, json={"messages": MSG, "max_tokens": 2}, headers=user)
    assert r.json()["service_tier"] == "default"
    assert [(q.priority, q.offline) for q in fake_engine.submitted] == [(1, True), (4, True), (1, True), (0, False)]
    online = app_with(access=dataclasses.replace(KEYS, offline_priority=5))
    assert online.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "priority": 4},
                       headers=user).json()["service_tier"] == "default"
    assert (fake_engine.submitted[-1].priority, fake_engine.submitted[-1].offline) == (4, False)


@pytest.mark.parametrize("tier", ["platinum", "", 1, "FLEX"])
def test_unknown_service_tier_is_a_400_naming_the_field(app_with, fake_engine, tier):
    client = app_with()
    for path, body in ((CHAT, {"messages": MSG}), ("/v1/completions", {"prompt": "x"})):
        assert_error(client.post(path, json={**body, "service_tier": tier}), 400, "invalid_request_error",
                     "service_tier")
    assert fake_engine.submitted == []
    assert client.post(CHAT, json={"messages": MSG, "max_tokens": 1}).status_code == 200  # still serving


def test_admin_keys_alone_may_change_what_is_served():
    policy = AccessPolicy(api_keys=frozenset({"sk-user"}), admin_keys=frozenset({"sk-admin"}))
    user, admin = policy.authenticate("Bearer sk-user"), policy.authenticate("Bearer sk-admin")
    assert (user.authenticated, user.admin) == (True, False) and (admin.authenticated, admin.admin) == (True, True)
    with pytest.raises(APIError) as refused:
        policy.check_admin(user, "loading a LoRA adapter")
    assert refused.value.status == 403
    policy.check_admin(admin, "loading a LoRA adapter")
    assert AccessPolicy(admin_keys=frozenset({"sk-admin"})).requires_key  # an admin key is an API key too
