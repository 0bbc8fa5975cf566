"""A model named by Hugging Face hub id (`org/name`) resolves to a local snapshot folder with
huggingface_hub: only the files the engine reads (config, generation config, tokenizer files,
then the safetensors shards the weight index names, or every safetensors file without one), at
`revision`, into `download_dir` (default:
the hub cache). HF_HUB_OFFLINE=1 is honoured by huggingface_hub: a cached snapshot is used,
and an uncached one is an error that says so. A local folder or file is used as it is.

Torch-free: the engine configuration resolves the model before any worker starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

METADATA_PATTERNS = (
    "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.json", "chat_template.jinja",
)
WEIGHT_INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/"))


def resolve_model_path(name: str, revision: str | None = None, download_dir: str | None = None,
                       token: str | bool | None = None, weights: bool = True, field: str = "model") -> Path:
    """A local folder or file as it is; else a hub id, downloaded (or found in the cache) with
    `token` (vLLM's hf_token: a token, True for the saved login, None for the default) and
    without the weights unless `weights`. `field` names the argument in errors."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not looks_like_repo_id(name):
        raise ValueError(f"{field}: '{name}' is neither an existing folder or file nor a hub id (org/name)")
    return download_snapshot(name, revision, download_dir, token, weights, field)


def download_snapshot(repo_id: str, revision: str | None, download_dir: str | None,
                      token: str | bool | None = None, weights: bool = True, field: str = "model") -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    where = download_dir or constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                        allow_patterns=list(METADATA_PATTERNS), token=token))
        if weights:
            snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                              allow_patterns=weight_patterns(folder), token=token)
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"{field}: '{repo_id}' (revision {revision or 'main'}) is not in the hub cache "
                             f"'{where}' and HF_HUB_OFFLINE=1 forbids downloading it") from exc
        raise ValueError(f"{field}: could not download '{repo_id}' (revision {revision or 'main'}) and it "
                         f"is not in the hub cache '{where}': {exc}") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ValueError(f"{field}: hub repository '{repo_id}' (revision {revision or 'main'}) was not "
                         f"found or is not accessible: {exc}") from exc
    return folder


def weight_patterns(folder: Path) -> list[str]:
    """The shards a weight index names, or every *.safetensors when there is no index (so a
    repository that also ships a consolidated copy, as Mistral's do, is fetched once)."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["*.safetensors"]
