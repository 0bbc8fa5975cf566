"""The Responses API through the official `openai` client against a running server:

    vllm-lite serve /path/to/Qwen2.5-or-Qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    python examples/responses_api.py [base_url]

A function call (named: its arguments follow the function's schema), streamed as events; the
tool's result sent back with previous_response_id (the server keeps the conversation); then a
JSON answer under text.format."""

import json
import sys

import openai

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def main() -> None:
    client = openai.OpenAI(base_url=(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000") + "/v1",
                           api_key="EMPTY")
    model = client.models.list().data[0].id
    stream = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0,
                                     max_output_tokens=100, stream=True)
    for event in stream:
        if event.type == "response.function_call_arguments.delta":
            print(event.delta, end="", flush=True)
        elif event.type == "response.completed":
            first = event.response
    print()
    call = next(item for item in first.output if item.type == "function_call")
    result = f"sunny, 21 C in {json.loads(call.arguments).get('city', 'Paris')}"
    second = client.responses.create(
        model=model, previous_response_id=first.id, temperature=0.0, max_output_tokens=100,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        text={"format": {"type": "json_schema", "name": "report", "strict": True, "schema": {
            "type": "object", "properties": {"summary": {"type": "string", "maxLength": 80}},
            "required": ["summary"]}}})
    print("answer:", second.output_text)


if __name__ == "__main__":
    main()
