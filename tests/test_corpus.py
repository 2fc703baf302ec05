"""Calibration / evaluation texts: disjoint, deterministic, traceable to their files."""
from __future__ import annotations

import hashlib

import pytest

from flashllm.sparsity.corpus import (CODE_FILES, KINDS, PIECE_BREAK, TEXTS, CorpusError,
                                     builtin_text, code_text, english_text, file_text,
                                     literature_text, prose_text, stdlib_dir)


def test_code_sets_are_disjoint_and_exist():
    cal, ev = set(CODE_FILES["calibration"]), set(CODE_FILES["evaluation"])
    assert cal and ev and not cal & ev
    for name in cal | ev:
        assert (stdlib_dir() / name).is_file(), name


def test_code_text_is_the_files_in_order():
    t = code_text("evaluation", stdlib_dir())
    root = stdlib_dir()
    want = "\n".join(f"# file: {n}\n" + (root / n).read_text(encoding="utf-8")
                     for n in CODE_FILES["evaluation"])
    assert t.text == want
    assert t.description["sha256"] == hashlib.sha256(want.encode()).hexdigest()
    assert t.description["files"] == list(CODE_FILES["evaluation"])


def test_texts_are_deterministic_and_disjoint():
    for kind in KINDS:
        a1, a2 = builtin_text("calibration", kind), builtin_text("calibration", kind)
        b = builtin_text("evaluation", kind)
        assert a1.text == a2.text and a1.description == a2.description
        assert a1.text != b.text
    cal, ev = prose_text("calibration"), prose_text("evaluation")
    assert cal.description["topics"] and not set(cal.description["topics"]) & set(ev.description["topics"])
    # no evaluation line of some length appears in the calibration code text
    cal_code = code_text("calibration", stdlib_dir()).text
    ev_lines = [l for l in code_text("evaluation", stdlib_dir()).text.splitlines() if len(l) > 60]
    assert sum(l in cal_code for l in ev_lines) < 0.02 * len(ev_lines)


def test_max_chars_takes_a_share_of_every_file():
    t = code_text("calibration", stdlib_dir(), max_chars=12000)
    assert len(t.text) <= 12000 + len(CODE_FILES["calibration"])
    for name in CODE_FILES["calibration"]:
        assert f"# file: {name}\n" in t.text


def test_file_text_and_errors(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello world\n", encoding="utf-8")
    assert file_text(p).text == "hello world\n"
    (tmp_path / "e.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(CorpusError, match="empty"):
        file_text(tmp_path / "e.txt")
    with pytest.raises(CorpusError, match="cannot read"):
        file_text(tmp_path / "missing.txt")
    with pytest.raises(CorpusError, match="unknown text kind"):
        builtin_text("calibration", "poetry")
    with pytest.raises(CorpusError, match="cannot read standard-library file"):
        code_text("calibration", tmp_path)


def test_english_splits_share_no_piece_and_are_long_enough(tmp_path):
    """The shipped English prose: no paragraph of one split is in the other; the evaluation
    split holds a perplexity fixture's 8 chunks of 512 tokens (~4.3 characters a token)."""
    cal, ev = english_text("calibration"), english_text("evaluation")
    paragraphs = lambda t: {p.strip() for p in t.text.split("\n\n") if len(p.strip()) > 40}  # noqa: E731
    assert paragraphs(cal) and not paragraphs(cal) & paragraphs(ev)
    assert len(cal.text) > 7000 and len(ev.text) > 8 * 512 * 4.3
    assert cal.description["sha256"] == hashlib.sha256(cal.text.encode()).hexdigest()
    cut = english_text("calibration", max_chars=1000)
    assert cal.text.startswith(cut.text) and len(cut.text) <= 1000
    with pytest.raises(CorpusError, match="cannot read the shipped text"):
        english_text("calibration", root=tmp_path)


def test_literature_splits_share_no_author_and_a_short_text_holds_every_piece(tmp_path):
    """The shipped public-domain literature: the evaluation split holds no author (title line)
    of the calibration split and a fixture's 4 chunks of 512 tokens; cut to max_chars, each
    calibration piece contributes its beginning (whole paragraphs, an equal share)."""
    cal, ev = literature_text("calibration"), literature_text("evaluation")
    author = lambda title: title.split(", by ")[1].split(" (")[0]          # noqa: E731
    titles = cal.description["titles"]
    assert len(titles) >= 3 and not {author(t) for t in titles} & \
        {author(t) for t in ev.description["titles"]}
    assert len(ev.text) > 4 * 512 * 4.3 and len(cal.text) < 64_000
    pieces = (TEXTS / "literature-calibration.txt").read_text(encoding="utf-8").strip() \
        .split(PIECE_BREAK)
    assert cal.text == "\n".join(p.strip() + "\n" for p in pieces)
    cut = literature_text("calibration", max_chars=4096)
    assert len(cut.text) <= 4096 + len(pieces)
    for piece in pieces:
        title, first = piece.split("\n\n")[:2]
        assert f"{title}\n\n{first}\n" in cut.text
    assert cut.description["sha256"] == hashlib.sha256(cut.text.encode()).hexdigest()
    with pytest.raises(CorpusError, match="cannot read the shipped text"):
        literature_text("calibration", root=tmp_path)
