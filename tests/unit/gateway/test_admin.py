"""POST /admin/restart (router/gateway/admin.py): its body checked before anything restarts, the API
key as /v1, one rolling restart at a time, absent from the OpenAPI document; the served restart
itself (drain, stop, start, streams kept) is tested against `tandem serve` in test_serve.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.gateway import build_app
from router.gateway.config import GatewayConfig

KEY = "sk-admin"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Tokenizer:
    def __len__(self):
        return 256


class _Backend:
    """What the app needs of a backend to build, and the workers /admin/restart may name."""

    model_name, max_model_len, tokenizer = "m", 64, _Tokenizer()

    def worker_details(self) -> list[dict]:
        return [{"worker_id": "prefill-0"}, {"worker_id": "decode-0"}]

    def worker_gauges(self) -> list:
        return []


def run(scenario, restart_workers):
    app = build_app(_Backend(), GatewayConfig(api_key=KEY), restart_workers=restart_workers)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await scenario(client)
    return asyncio.run(main())


def test_a_restart_names_known_workers_and_answers_what_happened():
    calls = []

    async def restart_workers(workers, timeout_s):
        calls.append((workers, timeout_s))
        return [{"worker_id": w, "restarted": True} for w in workers or ["prefill-0", "decode-0"]]

    async def scenario(client):
        ok = await client.post("/admin/restart", json={"workers": ["decode-0"], "drain_timeout_s": 2}, headers=AUTH)
        every = await client.post("/admin/restart", json={}, headers=AUTH)
        return ok, every

    ok, every = run(scenario, restart_workers)
    assert ok.status_code == 200 and ok.json() == {"restarted": [{"worker_id": "decode-0", "restarted": True}]}
    assert every.status_code == 200 and len(every.json()["restarted"]) == 2
    assert calls == [(["decode-0"], 2.0), (None, None)]


@pytest.mark.parametrize("body, param", [
    ({"workers": ["decode-9"]}, "workers"), ({"workers": []}, "workers"), ({"workers": "decode-0"}, "workers"),
    ({"drain_timeout_s": -1}, "drain_timeout_s"), ({"drain_timeout_s": True}, "drain_timeout_s"),
    ({"drain_timeout_s": "5"}, "drain_timeout_s"), ({"worker": ["decode-0"]}, "worker")])
def test_a_bad_body_is_400_naming_the_field_and_restarts_nothing(body, param):
    calls = []

    async def restart_workers(workers, timeout_s):
        calls.append(workers)
        return []

    async def scenario(client):
        return await client.post("/admin/restart", json=body, headers=AUTH)

    resp = run(scenario, restart_workers)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert calls == []


def test_the_key_is_required_one_restart_runs_at_a_time_and_the_route_is_undocumented():
    release = asyncio.Event()

    async def restart_workers(workers, timeout_s):
        await release.wait()
        return [{"worker_id": "decode-0", "restarted": True}]

    async def scenario(client):
        assert (await client.post("/admin/restart", json={})).status_code == 401
        first = asyncio.create_task(client.post("/admin/restart", json={}, headers=AUTH))
        await asyncio.sleep(0.1)
        second = await client.post("/admin/restart", json={}, headers=AUTH)
        release.set()
        paths = (await client.get("/openapi.json", headers=AUTH)).json()["paths"]
        return await first, second, paths

    first, second, paths = run(scenario, restart_workers)
    assert second.status_code == 409 and first.status_code == 200
    assert "/admin/restart" not in paths


def test_without_a_controller_the_route_says_so():
    async def scenario(client):
        return await client.post("/admin/restart", json={}, headers=AUTH)

    resp = run(scenario, None)
    assert resp.status_code == 404 and "cannot restart" in resp.json()["error"]["message"]
