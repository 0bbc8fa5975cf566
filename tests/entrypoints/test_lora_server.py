"""vLLM's LoRA serving: `--enable-lora --lora-modules`, a request's `model` naming an adapter, the
adapters in /v1/models, and the runtime routes (/v1/load_lora_adapter, /v1/unload_lora_adapter
under VLLM_ALLOW_RUNTIME_LORA_UPDATING). A live server's greedy tokens with an adapter equal PEFT's."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from fake_engine import FakeEngine
from hf_reference import hf_greedy
from live_server import running_server
from lora_adapters import edit_adapter_config, make_adapter, peft_greedy
from vllm_lite.entrypoints.cli_args import add_request_handling_args
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.entrypoints.openai.serving_models import LoRAModulePath

KEY = "lora-key"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("server_adapters")
    bad = make_adapter(tiny_llama, folder / "dora", seed=9)
    edit_adapter_config(bad, use_dora=True)
    return {"a": make_adapter(tiny_llama, folder / "a", seed=1), "b": make_adapter(tiny_llama, folder / "b", seed=2),
            "c": make_adapter(tiny_llama, folder / "c", seed=3, r=4), "dora": bad}


def completion_tokens(client: httpx.Client, model: str, prompt: list[int]) -> list[int]:
    reply = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    return reply.json()["choices"][0]["token_ids"]


def test_served_adapters_answer_as_peft_and_load_at_run_time(tiny_llama: Path, adapters: dict[str, Path],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            prompts_token_ids: list[list[int]]) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    resolver = tmp_path / "resolver"  # vLLM's filesystem resolver: adapters by model name
    shutil.copytree(adapters["c"], resolver / "resolved-c")
    shutil.copytree(adapters["dora"], resolver / "resolved-dora")
    shutil.copytree(adapters["a"], resolver / "other-base")
    edit_adapter_config(resolver / "other-base", base_model_name_or_path="someone/else")
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(resolver))
    modules = ("--lora-modules", f"a={adapters['a']}",
               json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "tiny"}))
    prompt = prompts_token_ids[1]
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "adapter_config.json").write_text("this is not json")
    with running_server(tiny_llama, tmp_path / "server.log", "tiny", KEY,
                        ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", *modules)) as server, \
            httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"], c.get("parent")) for c in cards] == [
            ("tiny", str(tiny_llama), None), ("a", str(adapters["a"]), "tiny"), ("b", str(adapters["b"]), "tiny")]
        no_processor = client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1,
                                                            "vllm_xargs": {"k": 1}})
        assert no_processor.status_code == 400 and "read by custom logits processors only" in no_processor.text
        metrics = client.get("/metrics").text
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        assert completion_tokens(client, "a", prompt) == peft_greedy(tiny_llama, adapters["a"], [prompt], NEW_TOKENS)[0]
        assert completion_tokens(client, "b", prompt) == peft_greedy(tiny_llama, adapters["b"], [prompt], NEW_TOKENS)[0]
        assert completion_tokens(client, "tiny", prompt) == hf_greedy(tiny_llama, [prompt], NEW_TOKENS)[0]
        chat = client.post("/v1/chat/completions", json={"model": "a", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "a", chat.text

        missing = client.post("/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        assert missing.json()["error"]["message"] == "The model `c` does not exist. Valid aliases: tiny."
        assert completion_tokens(client, "resolved-c", prompt) == peft_greedy(tiny_llama, adapters["c"], [prompt],
                                                                              NEW_TOKENS)[0]
        assert "resolved-c" in [card["id"] for card in client.get("/v1/models").json()["data"]]
        for name, status, message in [("resolved-dora", 400, "was found but could not be loaded"),
                                      ("other-base", 404, "does not exist"), ("..", 404, "does not exist")]:
            reply = client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
            assert reply.status_code == status and message in reply.json()["error"]["message"], (name, reply.text)
        client.post("/v1/unload_lora_adapter", json={"lora_name": "resolved-c"}).raise_for_status()
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'c' added successfully."
        assert completion_tokens(client, "c", prompt) == peft_greedy(tiny_llama, adapters["c"], [prompt], NEW_TOKENS)[0]
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        # in place: the name now serves the other folder (its own id: nothing cached under c's old weights is read)
        replaced = client.post("/v1/load_lora_adapter",
                               json={"lora_name": "c", "lora_path": str(adapters["a"]), "load_inplace": True})
        assert replaced.status_code == 200, replaced.text
        assert completion_tokens(client, "c", prompt) == peft_greedy(tiny_llama, adapters["a"], [prompt], NEW_TOKENS)[0]
        for body, status, message in [
            ({"lora_name": "d", "lora_path": str(adapters["dora"])}, 400, "does not yet support DoRA"),
            ({"lora_name": "tiny", "lora_path": str(adapters["a"])}, 400, "conflicts with a served base model"),
            ({"lora_name": "d", "lora_path": str(tmp_path / "nowhere")}, 404,
             f"Loading lora d failed: No adapter found for {tmp_path / 'nowhere'}"),
            ({"lora_name": "d", "lora_path": str(not_json)}, 400, "is not readable JSON"),
            ({"lora_name": "d", "lora_path": str(adapters["a"]), "is_3d_lora_weight": True}, 400, "is_3d_lora_weight"),
            ({"lora_name": "d", "lora_path": str(adapters["a"]), "revision": "x"}, 400, "revision"),
        ]:
            reply = client.post("/v1/load_lora_adapter", json=body)
            assert reply.status_code == status and message in reply.text, (body, reply.text)
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'c' removed successfully."
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
        assert client.post("/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1}).status_code == 404
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["tiny", "a", "b"]
        # vLLM's test_multiple_lora_adapters: adapters loaded and run at once, more than max_cpu_loras (2)
        got = asyncio.run(_load_and_run_concurrently(server.base_url, adapters, prompt))
        for folder, tokens in got:
            assert tokens == peft_greedy(tiny_llama, adapters[folder], [prompt], NEW_TOKENS)[0], folder
        assert client.get("/health").status_code == 200
    assert server.leftover_processes() == set()


async def _load_and_run_concurrently(base_url: str, adapters: dict[str, Path],
                                     prompt: list[int]) -> list[tuple[str, list[int]]]:
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120) as client:
        async def load_and_run(index: int) -> tuple[str, list[int]]:
            folder, name = "abc"[index % 3], f"x{index}"
            loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                     "lora_path": str(adapters[folder])})
            assert loaded.status_code == 200, loaded.text
            beam = await client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 4,
                                                              "use_beam_search": True, "n": 2})
            assert beam.status_code == 200 and len(beam.json()["choices"]) == 2, beam.text
            reply = await client.post("/v1/completions", json={
                "model": name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert reply.status_code == 200, reply.text
            return folder, reply.json()["choices"][0]["token_ids"]

        return list(await asyncio.gather(*(load_and_run(i) for i in range(6))))


def test_adapter_routes_are_off_without_the_environment_switch(tokenizer) -> None:
    from starlette.testclient import TestClient

    with TestClient(build_app(FakeEngine(tokenizer), ["m"])) as client:
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_lora_modules_on_an_engine_without_lora_stop_the_start(tokenizer) -> None:
    options = ServerOptions(lora_modules=(LoRAModulePath("a", "/x"),))
    with pytest.raises(ValueError, match="--lora-modules a=/x: this engine serves no LoRA adapters"):
        build_app(FakeEngine(tokenizer), ["m"], options=options)


@pytest.mark.parametrize("values, expected", [
    (["a=/x"], [LoRAModulePath("a", "/x")]),
    (['{"name": "b", "path": "/y", "base_model_name": "m"}', "c=/z"],
     [LoRAModulePath("b", "/y", "m"), LoRAModulePath("c", "/z")]),
])
def test_lora_modules_flag_takes_vllms_two_forms(values: list[str], expected: list[LoRAModulePath]) -> None:
    parser = argparse.ArgumentParser()
    add_request_handling_args(parser)
    assert parser.parse_args(["--lora-modules", *values]).lora_modules == expected


@pytest.mark.parametrize("value, message", [
    ("{not json", "neither name=path nor a JSON object"),
    ('{"name": "a"}', "needs string 'name' and 'path'"),
    ('{"name": "a", "path": "/x", "is_3d_lora_weight": true}', "keys ['is_3d_lora_weight']"),
])
def test_lora_modules_flag_refuses_what_it_cannot_read(value: str, message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_request_handling_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", value])
    assert message in capsys.readouterr().err


def test_the_resolver_reads_nothing_without_runtime_updating(tiny_llama: Path, adapters: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """vLLM's rule: the filesystem resolver answers only under VLLM_ALLOW_RUNTIME_LORA_UPDATING
    (build_app gives ServedModels no folder otherwise); with the folder, a LoRA of the served model
    is loaded under the requested name."""
    from vllm_lite.entrypoints.openai.errors import ApiError
    from vllm_lite.entrypoints.openai.serving_models import ServedModels

    shutil.copytree(adapters["a"], tmp_path / "found")
    checked = []
    without = ServedModels(("tiny",), checked.append, resolver_dir=None, base_model_ids=frozenset({str(tiny_llama)}))
    with pytest.raises(ApiError, match="does not exist"):
        without.resolve("found")
    with_folder = ServedModels(("tiny",), checked.append, resolver_dir=str(tmp_path),
                               base_model_ids=frozenset({str(tiny_llama)}))
    name, lora = with_folder.resolve("found")
    assert (name, lora.lora_path) == ("found", str(tmp_path / "found")) and checked == [lora]


def test_an_embedding_server_serves_adapters(tiny_qwen3: Path, tmp_path: Path,
                                             prompts_token_ids: list[list[int]]) -> None:
    """/v1/embeddings (and /v1/score) with a request's model naming an adapter of the embedding model."""
    import torch

    from lora_adapters import peft_hidden_states
    from test_embeddings import decoder_only_checkpoint

    checkpoint = decoder_only_checkpoint(tiny_qwen3, tmp_path)
    adapter = make_adapter(checkpoint, tmp_path / "adapter", seed=6, decoder_only=True)
    prompt = prompts_token_ids[2]
    with running_server(checkpoint, tmp_path / "server.log", "embedder", KEY,
                        ("--enable-lora", "--lora-modules", f"tuned={adapter}")) as server, \
            httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        reply = client.post("/v1/embeddings", json={"model": "tuned", "input": prompt})
        assert reply.status_code == 200 and reply.json()["model"] == "tuned", reply.text
        want = torch.nn.functional.normalize(peft_hidden_states(checkpoint, adapter, prompt)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(reply.json()["data"][0]["embedding"]), want, atol=2e-5, rtol=1e-4)
        base = client.post("/v1/embeddings", json={"model": "embedder", "input": prompt}).json()["data"][0]
        assert base["embedding"] != reply.json()["data"][0]["embedding"]
        score = client.post("/v1/score", json={"model": "tuned", "text_1": "a", "text_2": ["b", "c"]})
        assert score.status_code == 200 and len(score.json()["data"]) == 2, score.text
    assert server.leftover_processes() == set()


def test_unloaded_and_replaced_adapters_are_let_go(adapters: dict[str, Path]) -> None:
    """The engine forgets an adapter id no longer served (unloaded, or replaced in place): a
    server loading and unloading adapters all day keeps no record of the old ones."""
    from vllm_lite.entrypoints.openai.serving_models import ServedModels

    forgotten: list[int] = []
    models = ServedModels(("tiny",), lambda lora: None, forgotten.append)
    models.load("x", str(adapters["a"]))
    first = models.loras["x"].lora_int_id
    models.load("x", str(adapters["b"]), load_inplace=True)
    assert forgotten == [first] and models.loras["x"].lora_int_id != first
    second = models.loras["x"].lora_int_id
    models.unload("x")
    assert forgotten == [first, second] and not models.loras

