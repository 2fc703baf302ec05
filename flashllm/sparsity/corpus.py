"""Calibration and evaluation text that every machine already has (docs/DESIGN.md §8).

Code: the running Python's standard-library sources, calibration and evaluation from two disjoint
fixed sets of modules. Prose: the English documentation in `pydoc_data.topics`, the sorted topic
names split alternately. English: general English prose (stories, letters, essays, reports)
written for flashllm and placed in the public domain, shipped beside this module (texts/), one
file of pieces per split, no piece in both. Literature: public-domain classics (a Gothic
letter, a novel's dialogue, an essay, a tale; evaluation: another author's novel), excerpts
shipped beside it (texts/literature-SPLIT.txt; sources in texts/README.md). Calibration's
default is their mix (MIX: every kind in equal shares, each checked on its own). Users pass
their own text with `--text FILE` (`file_text`). Every text carries a description (source,
files, Python version, sha256) that calibration records in the manifest and the benchmarks
print.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from flashllm.errors import FlashError
from flashllm.limits import read_capped

SPLITS = ("calibration", "evaluation")
MAX_TEXT_BYTES = 64 << 20     # a user's text file (wikitext-2's test set: 1.3 MiB)
KINDS = ("code", "prose", "english", "literature")
MIX = "mix"           # calibrate's default corpus: every kind of KINDS, in equal shares
TEXTS = Path(__file__).resolve().parent / "texts"     # {english,literature}-{split}.txt
PIECE_BREAK = "\n\n\n"   # between the pieces of a literature file (two empty lines)

# Present in CPython 3.11 .. 3.13; the two sets share no file.
CODE_FILES = {
    "calibration": ("argparse.py", "textwrap.py", "functools.py", "dataclasses.py", "enum.py",
                    "string.py", "shlex.py", "csv.py", "json/decoder.py", "json/encoder.py",
                    "logging/__init__.py", "difflib.py"),
    "evaluation": ("heapq.py", "bisect.py", "fractions.py", "statistics.py", "shutil.py",
                   "tempfile.py", "configparser.py", "ipaddress.py", "gettext.py", "calendar.py"),
}


class CorpusError(FlashError):
    """A calibration/evaluation text that cannot be read or is empty."""


@dataclass(frozen=True)
class Text:
    text: str
    description: dict = field(default_factory=dict)   # JSON-able: where the text comes from


def stdlib_dir() -> Path:
    """The running Python's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _prefix(text: str, n_chars: Optional[int]) -> str:
    """text cut to at most n_chars, at the last line break before the cut when there is one."""
    if n_chars is None or len(text) <= n_chars:
        return text
    cut = text.rfind("\n", 0, n_chars)
    return text[:cut + 1] if cut > 0 else text[:n_chars]


def code_text(split: str, root: Path, max_chars: Optional[int] = None) -> Text:
    """The standard-library files of `split`, each prefixed by a `# file: NAME` line, joined by a
    blank line. With max_chars every file contributes an equal share (its beginning)."""
    if split not in SPLITS:
        raise CorpusError(f"unknown text split {split!r} (expected one of {', '.join(SPLITS)})")
    names = CODE_FILES[split]
    share = None if max_chars is None else max(1, max_chars // len(names))
    pieces = []
    for name in names:
        try:
            body = (root / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CorpusError(f"cannot read standard-library file {root / name}: {e}") from None
        pieces.append(_prefix(f"# file: {name}\n{body}", share))
    text = "\n".join(pieces)
    return Text(text, {"source": "python-stdlib", "kind": "code", "split": split,
                       "python": platform.python_version(), "root": str(root),
                       "files": list(names), "chars": len(text), "sha256": _sha256(text)})


def prose_text(split: str, max_chars: Optional[int] = None) -> Text:
    """pydoc_data.topics: sorted topic names, even positions for calibration, odd for evaluation."""
    if split not in SPLITS:
        raise CorpusError(f"unknown text split {split!r} (expected one of {', '.join(SPLITS)})")
    from pydoc_data.topics import topics
    names = sorted(topics)[SPLITS.index(split)::2]
    share = None if max_chars is None else max(1, max_chars // len(names))
    text = "\n".join(_prefix(topics[n].strip() + "\n", share) for n in names)
    return Text(text, {"source": "pydoc_data.topics", "kind": "prose", "split": split,
                       "python": platform.python_version(), "topics": names,
                       "chars": len(text), "sha256": _sha256(text)})


def _shipped(path: Path) -> str:
    """A text file shipped beside this module."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read the shipped text {path}: {e}") from None


def english_text(split: str, max_chars: Optional[int] = None, root: Path = TEXTS) -> Text:
    """The shipped English prose of `split` (texts/english-SPLIT.txt), cut to max_chars."""
    if split not in SPLITS:
        raise CorpusError(f"unknown text split {split!r} (expected one of {', '.join(SPLITS)})")
    name = f"english-{split}.txt"
    text = _prefix(_shipped(root / name), max_chars)
    return Text(text, {"source": "flashllm-english", "kind": "english", "split": split,
                       "file": name, "chars": len(text), "sha256": _sha256(text)})


def literature_text(split: str, max_chars: Optional[int] = None, root: Path = TEXTS) -> Text:
    """The shipped literature of `split` (texts/literature-SPLIT.txt): its pieces (PIECE_BREAK
    apart), with max_chars each one's beginning in an equal share, so a short text still holds
    every style."""
    if split not in SPLITS:
        raise CorpusError(f"unknown text split {split!r} (expected one of {', '.join(SPLITS)})")
    name = f"literature-{split}.txt"
    pieces = _shipped(root / name).strip().split(PIECE_BREAK)
    share = None if max_chars is None else max(1, max_chars // len(pieces))
    text = "\n".join(_prefix(p.strip() + "\n", share) for p in pieces)
    return Text(text, {"source": "public-domain-literature", "kind": "literature",
                       "split": split, "file": name,
                       "titles": [p.split("\n", 1)[0] for p in pieces],
                       "chars": len(text), "sha256": _sha256(text)})


def builtin_text(split: str, kind: str = "code", max_chars: Optional[int] = None,
                 root: Optional[Path] = None) -> Text:
    """The shipped text of `kind` (one of KINDS) for `split`."""
    if kind == "code":
        return code_text(split, root or stdlib_dir(), max_chars)
    if kind == "prose":
        return prose_text(split, max_chars)
    if kind == "english":
        return english_text(split, max_chars)
    if kind == "literature":
        return literature_text(split, max_chars)
    raise CorpusError(f"unknown text kind {kind!r} (expected one of {', '.join(KINDS)})")


def file_text(path: Path) -> Text:
    """A user's text file (UTF-8)."""
    try:
        raw = read_capped(path, MAX_TEXT_BYTES)
        text = raw.decode("utf-8") if raw is not None else ""
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read text file {path}: {e}") from None
    if raw is None:
        raise CorpusError(f"text file {path} is more than {MAX_TEXT_BYTES >> 20} MiB (~16M "
                          "tokens, days of passes): give a part of it")
    if not text.strip():
        raise CorpusError(f"text file {path} is empty")
    return Text(text, {"source": "file", "path": str(Path(path).resolve()), "chars": len(text),
                       "sha256": _sha256(text)})
