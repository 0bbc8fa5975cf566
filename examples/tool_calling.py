"""Tool calling through the official `openai` client against a running server:

    vllm-lite serve /path/to/Qwen2.5-or-Qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    python examples/tool_calling.py [base_url]

A named function (the arguments are generated under the function's JSON schema, so they always
parse), then the tool's result sent back for the final answer."""

import json
import sys

import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def get_weather(city: str) -> str:
    return f"sunny, 21 C in {city}"


def main() -> None:
    client = openai.OpenAI(base_url=(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000") + "/v1",
                           api_key="EMPTY")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    print("tool call:", call.function.name, arguments)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": get_weather(**arguments)}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0.0)
    print("answer:", final.choices[0].message.content, final.choices[0].message.tool_calls or "")


if __name__ == "__main__":
    main()
