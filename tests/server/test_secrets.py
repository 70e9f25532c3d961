"""The API key of `art serve` never leaves the process: not in its output, not in its log lines
(requests with right and wrong keys, a registration, a rollout, a training step, a failure),
not in any file it writes under --path."""

from __future__ import annotations

import httpx
import pytest

import art
from tests.support.servers import gather, start_server, stop_server

pytestmark = pytest.mark.integration

KEY = "sk-art-NEVER-LOG-ME-4242"


async def test_the_key_never_appears_in_output_or_files(tiny_model_path, tmp_path):
    root, log = tmp_path / "server", tmp_path / "serve.log"
    process, url = start_server(root, log, "--api-key", KEY,  # on the command line: the worst place
                                models_dir=tiny_model_path.parent)
    try:
        wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                 {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY},
                 {"Authorization": f"bearer  {KEY[::-1]}"}]
        for headers in wrong:
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/art/models")):
                response = httpx.request(method, url + path, headers=headers, json={"model": "x"})
                assert response.status_code == 401 and KEY not in response.text, (headers, path)
        # A key in the URL (logged by every proxy and access log) is refused, right or wrong, with
        # or without the header, on every path, /health included, and redacted from the access log.
        for query in (f"api_key={KEY}", f"key={KEY}", f"token={KEY}&x=1", f"x=1&Authorization=Bearer%20{KEY}",
                      f"API_KEY={KEY}", f"access_token={KEY}"):
            for path in ("/v1/models", "/health", "/art/models", "/nowhere"):
                for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
                    response = httpx.get(f"{url}{path}?{query}", headers=headers)
                    assert response.status_code == 400 and KEY not in response.text, (path, query)
                    assert response.json()["error"]["code"] == "credentials_in_url"
        health = httpx.get(url + "/health").json()
        assert health == {"status": "ok"}  # no key: no model names, no stacks
        assert "engines" in httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        async with art.RemoteBackend(url, api_key=KEY) as backend:
            model = art.TrainableModel(name="tiny", project="secret", base_model=str(tiny_model_path))
            await model.register(backend)
            await model.train(await gather(model, 0), config=art.TrainConfig(learning_rate=1e-2))
            await model.log(await gather(model, 1), split="val")
            with pytest.raises(art.ArtValueError):  # a failure is logged too
                await backend.train(model, [], learning_rate=-1.0)
            assert await model.get_step() == 1
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        output = stop_server(process, log)
    assert "Application shutdown complete" in output and "POST /art/models" in output  # the log is there
    assert "api_key=***" in output  # the refused requests are in the access log, redacted
    assert KEY not in output
    written = [path for path in root.rglob("*") if path.is_file()]
    assert any(path.name == "model.json" for path in written) and any(path.suffix == ".jsonl" for path in written)
    for path in written:
        assert KEY.encode() not in path.read_bytes(), path

