"""Structured outputs offline: a JSON schema, a regex, a choice and a grammar, with the bundled
demo model (or a model folder given as argv[1]). The same constraints over HTTP are
`response_format` / `structured_outputs` / `guided_*` fields (see the README)."""

import json
import sys

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def main() -> None:
    llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None, max_model_len=1024)
    constraints = {
        "json schema": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
        "choice": StructuredOutputsParams(choice=["positive", "negative"]),
        "grammar": StructuredOutputsParams(grammar='root ::= "SELECT " [a-z]+ " FROM " [a-z]+'),
    }
    questions = {
        "json schema": "Invent a person with a name and an age.",
        "regex": "Give me a phone number.",
        "choice": "Is this review positive or negative? 'I loved it.'",
        "grammar": "Write a SQL query that reads all users.",
    }
    for name, structured in constraints.items():
        params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=structured)
        out = llm.chat([{"role": "user", "content": questions[name]}], params)[0].outputs[0]
        print(f"{name:12} -> {out.text!r} ({out.finish_reason})")
        if name == "json schema" and out.finish_reason == "stop":
            print("             parsed:", json.loads(out.text))
    llm.shutdown()


if __name__ == "__main__":
    main()
