"""Stand-in for `python -m vllm.entrypoints.openai.api_server --model NAME ...` (vLLM's shutdown
test starts the server that way): the server under test on the demo model, served as NAME, in
this process's place (exec), so that signals sent to this process reach the server."""

from __future__ import annotations

import os
import sys

from tests.utils import DROPPED_FLAGS, _vllm_command, _vllm_lite_command, _without, target


def main(argv: list[str]) -> None:
    args = _without(argv, DROPPED_FLAGS)
    model = "model"
    if "--model" in args:
        at = args.index("--model")
        model = args[at + 1]
        del args[at:at + 2]
    t = target()
    if t.name == "vllm":
        cmd = _vllm_command(t, model, 0, args)
        os.environ["PYTHONPATH"] = t.peer_site
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    else:
        cmd = _vllm_lite_command(t, model, 0, args, os.environ.get("VLLM_API_KEY"))
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
