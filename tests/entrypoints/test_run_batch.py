"""`vllm-lite run-batch` (vLLM's batch runner): a real process over a JSONL file of OpenAI batch
lines; each answered as the server answers it, in order, a line's failure its own. Input and
output over HTTP (GET / PUT) against a local server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from live_server import REPO_ROOT

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.run_batch import read_input, write_output

MODEL = "tiny"
STORY = [{"role": "user", "content": "Tell me a story"}]


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_batch_file_is_answered_line_by_line(tiny_qwen3: Path, tmp_path: Path) -> None:
    chat = {"model": MODEL, "messages": STORY, "max_tokens": 6, "temperature": 0.0}
    lines = [
        line("chat", "/v1/chat/completions", chat),
        line("completion", "/v1/completions", {"model": MODEL, "prompt": "The river", "max_tokens": 5,
                                                "temperature": 0.0}),
        line("audio", "/v1/audio/transcriptions", {"model": MODEL}),
        line("streamed", "/v1/chat/completions", {**chat, "stream": True}),
        "{not json",
        line("bad-temperature", "/v1/chat/completions", {**chat, "temperature": -1}),
        line("other-model", "/v1/chat/completions", {**chat, "model": "gpt-4o"}),
        line("get", "/v1/chat/completions", chat, method="GET"),
        "",  # (blank lines are skipped, as in vLLM)
        line("chat-again", "/v1/chat/completions", chat),
        line("stream-false", "/v1/chat/completions", {**chat, "stream": "false"}),  # (pydantic's false)
        line("surrogate", "/v1/completions", {"model": MODEL, "prompt": "\ud800", "max_tokens": 2}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "run-batch", "-i",
                             str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_qwen3),
                             "--served-model-name", MODEL, "--max-model-len", "128", "--dtype", "float32",
                             "--enable-log-requests", "--max-log-len", "4"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    # serve's request-handling flags work here too: each request the engine ran logged, its prompt cut to 4
    assert result.stderr.count("Received request") == 4 and "prompt: 'The '" in result.stderr, result.stderr[-3000:]
    outputs = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["chat", "completion", "audio", "streamed", None, "bad-temperature",
                                                 "other-model", "get", "chat-again", "stream-false", "surrogate"]
    by_id = {o["custom_id"]: o for o in outputs}
    assert [o["response"]["status_code"] for o in outputs] == [200, 200, 400, 400, 400, 400, 404, 400, 200, 200, 400]
    assert all(o["id"].startswith("vllm-") and o["response"]["request_id"].startswith("vllm-batch-") for o in outputs)
    assert len({o["id"] for o in outputs}) == len(outputs)

    expected = LLM(str(tiny_qwen3), max_model_len=128, dtype="float32", multiprocess=False)
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        text = expected.chat(STORY, greedy, use_tqdm=False)[0].outputs[0].text
        completion = expected.generate("The river", SamplingParams(max_tokens=5, temperature=0.0),
                                       use_tqdm=False)[0].outputs[0].text
    finally:
        expected.shutdown()
    assert "unpaired UTF-16 surrogate" in by_id["surrogate"]["error"]["error"]["message"]  # the server's answer
    for name in ("chat", "chat-again", "stream-false"):
        reply = by_id[name]
        assert reply["error"] is None and reply["response"]["body"]["object"] == "chat.completion"
        assert reply["response"]["body"]["choices"][0]["message"]["content"] == text
    assert by_id["completion"]["response"]["body"]["choices"][0]["text"] == completion
    assert "URL /v1/audio/transcriptions was used" in by_id["audio"]["error"]
    assert by_id["streamed"]["error"] == "Request must not be sent in stream mode"
    assert outputs[4]["error"].startswith("the line is not JSON")
    assert by_id["bad-temperature"]["error"]["error"]["param"] == "temperature"  # the server's own error body
    assert by_id["other-model"]["error"]["error"]["code"] == 404
    assert by_id["get"]["error"] == "method must be POST, got 'GET'"
    assert all(o["response"]["body"] is None for o in outputs if o["error"] is not None)


def test_a_missing_input_file_is_an_error_before_any_engine(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "run-batch", "-i",
                             str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "missing.jsonl" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture
def http_files() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A local HTTP server: GET /<name> serves `files[name]`, PUT /<name> stores the body there."""
    files: dict[str, bytes] = {"in.jsonl": b'{"custom_id": "a"}\n'}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def do_PUT(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else self._read_chunked()
            files[self.path.lstrip("/")] = data
            self.send_response(200)
            self.end_headers()

        def _read_chunked(self) -> bytes:
            data = b""
            while size := int(self.rfile.readline().strip(), 16):
                data += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return data

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", files
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_input_and_output_over_http(http_files: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    base, files = http_files
    assert asyncio.run(read_input(f"{base}/in.jsonl")) == '{"custom_id": "a"}\n'
    asyncio.run(write_output(f"{base}/direct.jsonl", "one\n", None))
    asyncio.run(write_output(f"{base}/through-tmp.jsonl", "two\n" * 1000, str(tmp_path)))
    assert files["direct.jsonl"] == b"one\n" and files["through-tmp.jsonl"] == b"two\n" * 1000
    assert list(tmp_path.iterdir()) == []  # (the temporary file is gone)
    with pytest.raises(ValueError, match="--input-file .*missing.jsonl"):
        asyncio.run(read_input(f"{base}/missing.jsonl"))
