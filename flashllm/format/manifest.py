"""manifest.json read once: read_manifest parses and validates a converted folder's manifest into
a Manifest, the one object the planner, the reader, the converter's checks and the session pass
down (no other code parses the file; format/files.update_manifest writes it).

A Manifest is a read-only mapping over the JSON object (its sections are the JSON's own dicts
and lists, as docs/FORMAT.md describes them) with typed accessors for what the planner reads.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

from flashllm.errors import FormatError
from flashllm.format.layout import (EXPERT_ROWS, MAGIC, MANIFEST_FILE, READ_VERSIONS,
                                    expert_rows_version)
from flashllm.limits import loads_json, read_capped

SECTIONS = ("config", "dense", "ffn", "tokenizer", "sparsity", "predictor")   # JSON objects
MAX_MANIFEST_BYTES = 64 << 20   # a 28-layer model's manifest: ~72 KiB


class Manifest(Mapping):
    """A validated manifest.json: magic, format version, its sections objects."""

    __slots__ = ("_data", "path")

    def __init__(self, data: dict, path: Path) -> None:
        self._data = data
        self.path = Path(path)                 # the manifest file

    def __getitem__(self, key: str):
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Manifest({self.path})"

    def to_dict(self) -> dict:
        """A deep copy of the JSON object (to edit and write: format/files.update_manifest)."""
        return copy.deepcopy(self._data)

    @property
    def config(self) -> dict:
        return self._data["config"]

    @property
    def ffn(self) -> dict:
        return self._data["ffn"]

    @property
    def dense(self) -> dict:
        return self._data["dense"]


def read_manifest(folder: Path, validate: bool = True) -> Manifest:
    """The validated manifest of the converted folder; FormatError (one line) otherwise. Not
    validate: any JSON object (what `models` lists of a folder, complete or not)."""
    path = Path(folder) / MANIFEST_FILE
    try:
        raw = read_capped(path, MAX_MANIFEST_BYTES)
        if raw is None:
            raise FormatError(f"{path}: more than {MAX_MANIFEST_BYTES >> 20} MiB, more than any "
                              "model's manifest (not a flashllm manifest)")
        m = loads_json(raw.decode("utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{path}: missing (not a converted flashllm model?)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not validate:
        if not isinstance(m, dict):
            raise FormatError(f"{path}: not a JSON object")
        return Manifest(m, path)
    return parse_manifest(m, path)


def parse_manifest(m, path: Path) -> Manifest:
    """m, a manifest's JSON object, validated: its magic, version and sections."""
    if not isinstance(m, dict) or m.get("magic") != MAGIC:
        raise FormatError(f"{path}: bad magic (not a flashllm manifest)")
    if m.get("format_version") not in READ_VERSIONS:
        raise FormatError(f"{path}: format version {m.get('format_version')!r}, "
                          f"this flashllm reads versions {', '.join(map(str, READ_VERSIONS))}")
    for key in SECTIONS:
        if not isinstance(m.get(key), dict):
            raise FormatError(f"{path}: field {key!r} missing or not dict")
    rows = m["ffn"].get("experts") == EXPERT_ROWS
    if m["format_version"] != expert_rows_version(rows):
        raise FormatError(f"{path}: format version {m['format_version']} "
                          f"{'with' if rows else 'without'} expert rows")
    return Manifest(m, path)
