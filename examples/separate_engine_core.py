"""Run the engine core as its own process (`vllm-lite engine`) and attach to it with LLM.

The engine core could equally be started by hand in another terminal:

    vllm-lite engine --max-model-len 1024 --address ipc:///tmp/my-engine/engine.sock

Any number of LLM / AsyncLLM clients can then attach to the address; each gets its own outputs.
Uses the bundled demo model (or a folder in argv[1]).
"""

import os
import select
import subprocess
import sys
import tempfile

from vllm_lite import LLM, SamplingParams


def start_engine_core(model: str | None, address: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "engine", "--max-model-len", "1024",
            "--address", address]
    proc = subprocess.Popen(args + (["--model", model] if model else []), stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if "serving at" not in line:
        proc.kill()
        raise RuntimeError("the engine core did not start")
    print(line.strip())
    return proc


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory() as private_dir:  # mode 0700: only this user can connect
        engine = start_engine_core(model, f"ipc://{os.path.join(private_dir, 'engine.sock')}")
        try:
            llm = LLM(engine_address=f"ipc://{private_dir}/engine.sock")  # model etc. come from the engine
            params = SamplingParams(temperature=0.0, max_tokens=24)
            for output in llm.generate(["The capital of France is", "def add(a, b):"], params):
                print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
            print(llm.stats())
            llm.shutdown()  # detaches; the engine core keeps serving other clients
        finally:
            engine.terminate()
            engine.wait()


if __name__ == "__main__":
    main()
