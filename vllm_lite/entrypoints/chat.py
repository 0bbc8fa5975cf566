"""`vllm-lite chat`: an interactive, streaming chat with a local engine or with any
OpenAI-compatible server (`--url`). `--quick MESSAGE` sends one message and exits."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator

from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from

Conversation = list[dict[str, str]]
Replier = Callable[[Conversation], Iterator[str]]


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="interactive streaming chat (local engine, or a server with --url)")
    chat.add_argument("--url", default=None, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    chat.add_argument("--model-name", default=None, help="with --url: the model to ask for (default: the server's first)")
    chat.add_argument("--api-key", default=None)
    chat.add_argument("--system-prompt", default=None)
    chat.add_argument("--quick", default=None, metavar="MESSAGE", help="send one message, print the reply, exit")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    reply = _server_replier(args) if args.url else _local_replier(args)
    conversation: Conversation = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    turns = [args.quick] if args.quick is not None else _read_turns()
    for message in turns:
        conversation.append({"role": "user", "content": message})
        pieces = []
        for piece in reply(conversation):
            print(piece, end="", flush=True)
            pieces.append(piece)
        print()
        conversation.append({"role": "assistant", "content": "".join(pieces)})
    return 0


def _read_turns() -> Iterator[str]:
    print("Chat: type a message (Ctrl-D or /exit to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip() == "/exit":
            return
        if line.strip():
            yield line


def _local_replier(args: argparse.Namespace) -> Replier:
    from vllm_lite.entrypoints.llm import LLM
    from vllm_lite.sampling_params import SamplingParams
    from vllm_lite.sampling_params import RequestOutputKind

    llm = LLM(**dataclasses.asdict(engine_args_from(args)))
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            output_kind=RequestOutputKind.DELTA)
    request_ids = itertools.count()

    def reply(conversation: Conversation) -> Iterator[str]:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        engine.add_request(f"chat-{next(request_ids)}", prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                yield output.outputs[0].text

    return reply


def _server_replier(args: argparse.Namespace) -> Replier:
    import httpx

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(headers=headers, timeout=httpx.Timeout(None, connect=10.0))
    model = args.model_name or client.get(f"{base}/v1/models").raise_for_status().json()["data"][0]["id"]

    def reply(conversation: Conversation) -> Iterator[str]:
        body = {"model": model, "messages": conversation, "stream": True, "max_tokens": args.max_tokens,
                "temperature": args.temperature}
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise ValueError(f"server answered {response.status_code}: {response.read().decode()}")
            for line in response.iter_lines():
                data = line[len("data: "):] if line.startswith("data: ") else None
                if data is None or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ValueError(f"server error: {chunk['error']['message']}")
                for choice in chunk.get("choices", ()):
                    yield choice["delta"].get("content") or ""

    return reply
