"""vLLM's custom logits processors on the server: `--logits-processors module:Class` and a
request's `vllm_xargs` (its SamplingParams.extra_args), on a live server."""

from __future__ import annotations

from pathlib import Path

import httpx

from live_server import running_server

KEY = "lp-key"


def test_vllm_xargs_reach_the_servers_logits_processor(tiny_llama: Path, tmp_path: Path) -> None:
    args = ("--logits-processors", "tests.custom_logits_processors:ForcedToken")
    with running_server(tiny_llama, tmp_path / "server.log", "tiny", KEY, args) as server, \
            httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        forced = client.post("/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
            "vllm_xargs": {"target_token": 67}})
        assert forced.status_code == 200, forced.text
        assert forced.json()["choices"][0]["token_ids"] == [67] * 6
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": {"target_token": 68}})
        assert chat.status_code == 200 and chat.json()["choices"][0]["token_ids"] == [68] * 4, chat.text
        refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                       "vllm_xargs": {"target_token": "x"}})
        assert refused.status_code == 400 and "target_token must be an int" in refused.json()["error"]["message"]
        plain = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6,
                                                     "ignore_eos": True, "return_token_ids": True})
        assert plain.status_code == 200 and plain.json()["choices"][0]["token_ids"] != [67] * 6
    assert server.leftover_processes() == set()
