"""Checkpoint folders with a JSON file changed (config.json, tokenizer_config.json,
generation_config.json): the one helper for tests that need a model's configuration edited."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

JsonEdit = Callable[[dict], object] | Mapping[str, Any]


def edit_json(path: Path, edit: JsonEdit) -> None:
    """The JSON object in `path` changed in place: `edit(contents)`, or the given top-level keys set."""
    contents = json.loads(path.read_text())
    if isinstance(edit, Mapping):
        contents.update(edit)
    else:
        edit(contents)
    path.write_text(json.dumps(contents))


def edited_copy(model: Path, dest: Path, edit: JsonEdit, file: str = "config.json") -> Path:
    """`model`'s folder copied to `dest` (which must not exist), its `file` changed by `edit` (see
    `edit_json`)."""
    shutil.copytree(model, dest)
    edit_json(dest / file, edit)
    return dest
