"""Models by hub id, from a local hub cache laid out as huggingface_hub lays it out
(`models--org--name/refs/<ref>` holding a commit, `snapshots/<commit>/<files>`), offline
(tests/conftest.py sets HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from test_parity import run_greedy
from vllm_lite import LLM, SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.hub import weight_patterns

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def add_snapshot(cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str | None = "main") -> Path:
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_llama: Path, tiny_qwen2: Path) -> Path:
    cache = tmp_path / "hub"
    add_snapshot(cache, "tiny-org/tiny-model", tiny_llama, COMMIT_A, "main")
    add_snapshot(cache, "tiny-org/tiny-model", tiny_qwen2, COMMIT_B, "v2")
    return cache


def test_generates_from_a_cached_hub_id(hub_cache: Path, tiny_llama: Path,
                                        prompts_token_ids: list[list[int]]) -> None:
    llm = LLM("tiny-org/tiny-model", download_dir=str(hub_cache), max_model_len=256, dtype="float32", multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert run_greedy(llm, prompts_token_ids[:3], params) == hf_greedy(tiny_llama, prompts_token_ids[:3], 8)


@pytest.mark.parametrize("revision,architecture", [
    (None, "LlamaForCausalLM"), ("main", "LlamaForCausalLM"), ("v2", "Qwen2ForCausalLM"),
    (COMMIT_B, "Qwen2ForCausalLM"),
])
def test_revision_picks_the_snapshot(hub_cache: Path, revision: str | None, architecture: str) -> None:
    config = EngineArgs(model="tiny-org/tiny-model", revision=revision, download_dir=str(hub_cache)).create_engine_config()
    assert config.model_config.hf.architecture == architecture
    assert Path(config.model_config.model).parent.name == "snapshots"
    assert config.model_config.tokenizer == config.model_config.model  # the snapshot's tokenizer


def test_offline_and_not_cached_is_a_clear_error(hub_cache: Path) -> None:
    with pytest.raises(ValueError, match="not in the hub cache.*HF_HUB_OFFLINE"):
        EngineArgs(model="tiny-org/other-model", download_dir=str(hub_cache)).create_engine_config()
    with pytest.raises(ValueError, match="not in the hub cache"):
        EngineArgs(model="tiny-org/tiny-model", revision="v3", download_dir=str(hub_cache)).create_engine_config()


def test_not_a_folder_nor_a_hub_id() -> None:
    with pytest.raises(ValueError, match="neither an existing folder"):
        EngineArgs(model="./no/such/folder").create_engine_config()


def test_trust_remote_code_models_are_refused(tmp_path: Path, tiny_llama: Path) -> None:
    snapshot = add_snapshot(tmp_path / "hub", "tiny-org/custom", tiny_llama, COMMIT_A)
    cfg = json.loads((snapshot / "config.json").read_text())
    cfg.update(architectures=["CustomForCausalLM"], model_type="custom",
               auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (snapshot / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineArgs(model="tiny-org/custom", download_dir=str(tmp_path / "hub")).create_engine_config()


def test_sharded_snapshot_reads_the_index(tmp_path: Path, tiny_llama_sharded: Path) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, "tiny-org/sharded", tiny_llama_sharded, COMMIT_A)
    config = EngineArgs(model="tiny-org/sharded", download_dir=str(cache)).create_engine_config()
    snapshot = Path(config.model_config.model)
    assert (snapshot / "model.safetensors.index.json").is_file()
    # only the shards the index names are fetched (not, e.g., a consolidated copy beside them)
    shards = sorted(p.name for p in snapshot.glob("*.safetensors"))
    (snapshot / "consolidated.safetensors").write_bytes(b"")
    assert weight_patterns(snapshot) == shards


def test_tokenizer_revision_picks_the_tokenizers_snapshot(hub_cache: Path, tiny_llama: Path) -> None:
    """vLLM's tokenizer_revision: the model's repository at another revision for its tokenizer,
    or the revision of a `tokenizer` repository (unset: the model's `revision`)."""
    config = EngineArgs(model="tiny-org/tiny-model", tokenizer_revision="v2",
                        download_dir=str(hub_cache)).create_engine_config()
    assert config.model_config.hf.architecture == "LlamaForCausalLM"  # the model stays at main
    assert Path(config.model_config.tokenizer).name == COMMIT_B
    config = EngineArgs(model=str(tiny_llama), tokenizer="tiny-org/tiny-model", tokenizer_revision=COMMIT_B,
                        download_dir=str(hub_cache)).create_engine_config()
    assert Path(config.model_config.tokenizer).name == COMMIT_B
    config = EngineArgs(model="tiny-org/tiny-model", revision="v2", tokenizer="tiny-org/tiny-model",
                        download_dir=str(hub_cache)).create_engine_config()
    assert Path(config.model_config.tokenizer).name == COMMIT_B  # unset: the model's revision (vLLM's rule)
    with pytest.raises(ValueError, match="tokenizer_revision='v2' names a hub revision, but the model"):
        EngineArgs(model=str(tiny_llama), tokenizer_revision="v2").create_engine_config()


def test_hf_token_reaches_the_hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    tokens = []
    download = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        tokens.append(kwargs.get("token"))
        return download(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    EngineArgs(model="tiny-org/tiny-model", hf_token="hf_secret", download_dir=str(hub_cache)).create_engine_config()
    assert tokens and set(tokens) == {"hf_secret"}
