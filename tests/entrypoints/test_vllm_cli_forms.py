"""vLLM's command-line forms on `vllm-lite` (cli_args.vllm_argv and the flags' types): a launch
command written for `vllm serve` means the same here or is refused by name. Parsing only; a live
server started from a `--config` file is test_deployment_flags.py's `defaults_server`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import REPO_ROOT

from vllm_lite.config import EngineArgs
from vllm_lite.entrypoints.cli import build_parser
from vllm_lite.entrypoints.cli_args import engine_args_from, vllm_argv


def parsed(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(vllm_argv(list(argv), parser))


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        parsed(*argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("""
model: from-the-file
port: 9001
max_model_len: 4k
enable-prefix-caching: false
enforce-eager: true
disable-fastapi-docs: false
served-model-name: [a, b]
hf-overrides:
  rope_theta: 1000000
  rope_scaling: {rope_type: linear, factor: 2.0}
""")
    return path


def test_config_file_values_and_their_forms(config_file: Path) -> None:
    args = parsed("serve", "--config", str(config_file))
    assert engine_args_from(args).model == "from-the-file"
    assert (args.port, args.max_model_len) == (9001, 4000)
    assert args.enable_prefix_caching is False and args.enforce_eager is True  # false is --no-..., true the switch
    assert args.disable_fastapi_docs is False  # false for a plain switch: off, its default
    assert args.served_model_name == ["a", "b"]
    assert args.hf_overrides == {"rope_theta": 1000000, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


@pytest.mark.parametrize("model_first", [True, False])
def test_the_command_line_wins_over_the_file(config_file: Path, model_first: bool) -> None:
    """vLLM's order: command line > config file > defaults; `serve`'s model on the command line
    (before --config or just after it) is the model, whatever the file says."""
    config = ["--config", str(config_file)]
    args = parsed("serve", *(["cli-model", *config] if model_first else [*config, "cli-model"]),
                  "--port", "9002", "--served-model-name", "c", "--hf-overrides.rope_scaling.factor", "4",
                  "--no-enforce-eager")
    assert engine_args_from(args).model == "cli-model"
    assert (args.port, args.served_model_name, args.enforce_eager) == (9002, ["c"], False)
    # A JSON flag's keys given on the command line update the file's object, key by key.
    assert args.hf_overrides == {"rope_theta": 1000000, "rope_scaling": {"rope_type": "linear", "factor": 4}}


def test_underscores_short_flags_and_human_readable_integers() -> None:
    args = parsed("serve", "--max_model_len", "1K", "--max-num-batched-tokens=25.6k", "--kv_cache_memory_bytes=2G",
                  "-tp", "2", "-q", "int8", "-asc", "3", "--enable_prefix_caching")
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (1024, 25600, 2 << 30)
    assert (args.tensor_parallel_size, args.quantization, args.api_server_count) == (2, "int8", 3)
    assert args.enable_prefix_caching is True
    assert parsed("engine", "-n", "2", "-r", "1").nnodes == 2


def test_a_json_flag_key_by_key_merges_in_order() -> None:
    args = parsed("serve", "--structured-outputs-config", '{"backend": "auto"}',
                  "--structured-outputs-config.disable_any_whitespace", "true",
                  "--hf-overrides.layer_types+", "a,b", "--hf-overrides.layer_types+", "c",
                  "--hf-overrides.sliding_window=4k", "--hf-overrides.name", "plain text")
    assert args.structured_outputs_config == {"backend": "auto", "disable_any_whitespace": True}
    assert args.hf_overrides == {"layer_types": ["a", "b", "c"], "sliding_window": 4000, "name": "plain text"}
    # The JSON form after the keys replaces them (the last one given wins, as for any flag).
    assert parsed("serve", "--hf-overrides.a", "1", "--hf-overrides", '{"b": 2}').hf_overrides == {"b": 2}


def test_vllms_parallel_and_sleep_flags_are_read() -> None:
    args = parsed("serve", "-pp", "1", "--enable-sleep-mode", "--disable-custom-all-reduce",
                  "--no-enable-expert-parallel")
    assert (args.pipeline_parallel_size, args.enable_sleep_mode, args.disable_custom_all_reduce,
            args.enable_expert_parallel) == (1, True, True, False)
    assert parsed("serve", "-ep").enable_expert_parallel is True  # (then refused by the engine config, by name)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-model-len", "1.5K"], "decimals are not allowed with the binary suffix K"),
    (["--max-model-len", "1.2345k"], "not a whole number"),
    (["--max-num-batched-tokens", "lots"], "not an integer"),
    (["--compilation-config.level", "3"], "unrecognized arguments: --compilation-config"),
    (["-O3"], "unrecognized arguments: -O3"),
    (["--hf-overrides.rope_theta"], "--hf-overrides.rope_theta: expected a value"),
    (["--hf-overrides", "[1]", "--hf-overrides.a", "1"], "--hf-overrides: must be a JSON object"),
])
def test_what_cannot_be_read_is_refused_by_name(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                message: str) -> None:
    assert message in refusal(capsys, "serve", *argv)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("config.yaml", "not-a-flag-here: 1\n", "unrecognized arguments: --not-a-flag-here"),
    ("config.yaml", "no-such-switch: false\n", "unrecognized arguments: --no-such-switch"),
    ("config.yaml", "port:\n", "'port' has no value"),
    ("config.yaml", "- a list\n", "must be a mapping of flag names to values, got list"),
    ("config.yaml", "port: [unclosed\n", "--config"),
    ("config.json", "{}", "the file must be YAML (.yaml or .yml)"),
    ("missing.yaml", None, "No such file"),
])
def test_a_config_file_that_cannot_be_used_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     name: str, text: str | None, message: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert message in refusal(capsys, "serve", "--config", str(path))


def test_config_given_twice_is_refused(capsys: pytest.CaptureFixture[str], config_file: Path) -> None:
    assert "--config: given more than once" in refusal(capsys, "serve", "--config", str(config_file),
                                                       f"--config={config_file}")


def test_max_model_len_auto_fits_the_kv_cache(tiny_llama: Path) -> None:
    """vLLM's `--max-model-len auto` / -1: the model's own length when the KV cache holds it, else
    the longest sequence the cache holds (one block reserved; the last step's KV needs a slot),
    which then runs; under gpu_memory_utilization (measured later) it is refused by name."""
    from vllm_lite import LLM, SamplingParams

    assert parsed("serve", "--max-model-len", "auto").max_model_len == -1
    args = {"model": str(tiny_llama), "device": "cpu", "dtype": "float32"}
    own = EngineArgs(**args).create_engine_config().model_config.max_model_len
    assert EngineArgs(**args, max_model_len=-1).create_engine_config().model_config.max_model_len == own
    small = EngineArgs(**args, max_model_len=-1, num_kv_blocks=5, block_size=16).create_engine_config()
    assert small.model_config.max_model_len == 4 * 16 - 1 < own
    llm = LLM(str(tiny_llama), dtype="float32", multiprocess=False, max_model_len=-1, num_kv_blocks=5, block_size=16)
    try:
        output = llm.generate({"prompt_token_ids": list(range(3, 53))}, SamplingParams(max_tokens=64, ignore_eos=True),
                              use_tqdm=False)[0]
        assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 63  # (cut at max_model_len)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"max_model_len='auto' \(-1\) needs the KV cache's size"):
        EngineArgs(**args, max_model_len=-1, gpu_memory_utilization=0.5).create_engine_config()


def test_the_command_line_program_reads_vllm_forms(tmp_path: Path) -> None:
    """`vllm-lite` itself (not only the parser) rewrites vLLM's forms: a file's unknown flag is
    refused by name before any model is loaded."""
    (tmp_path / "config.yaml").write_text("max_model_len: 1k\nkv-cache-dtype-skip-layers: [0]\n")
    result = subprocess.run([sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", "--config",
                             str(tmp_path / "config.yaml")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "unrecognized arguments: --kv-cache-dtype-skip-layers" in result.stderr, \
        result.stderr[-2000:]
