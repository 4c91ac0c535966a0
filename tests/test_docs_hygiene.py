"""The product speaks of the product, and docs/results/ holds exactly the raw files the docs cite.

- No work-process words (how the team scheduled its work) in README, CHANGELOG, docs, code, docstrings, comments,
  tests, notebooks, CI scripts, file or folder names, or the keys of the benchmark JSON: the product carries
  versions and dates; history is in git and CHANGELOG.md.
- Every ``docs/results/...`` path named anywhere exists, and every file under ``docs/results/`` is named (itself or
  a folder above it) somewhere outside ``docs/results/``: no raw file without a number that needs it.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

# The words, assembled so that this file does not match itself.
_S, _I, _W = "sess" + "ion", "iss" + "ue", "wa" + "ve"
WORK_WORDS = re.compile(
    "|".join(
        [
            rf"\b{_S}\s*\d+",                       # "<period> 16", "<period>16"
            rf"\b{_S}s\s+\d",                       # "<periods> 5-7"
            rf"\b(last|next|earlier|previous|later|second|first) {_S}s\b",   # "earlier <periods>"
            rf"\b(as of|in|since|before|after|during) (this|that|the last|the next|an earlier|the second) {_S}\b",
            rf"\b{_S}'s (code|numbers?|runs?|box|defaults?|changes?)\b",
            rf"\b{_I}\s*#?\d+",                     # "<ticket> 16"
            r"\bitems?\s+\d+(\.\d+)?\b",            # "item 3", "items 1-2"
            rf"\b{_W}s?\b",
        ]
    ),
    re.I,
)

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".ini", ".txt", ""}
SKIP_PARTS = {".git", "site", "runs", "__pycache__", ".venv", "node_modules", ".pytest_cache"}


def _tracked_files() -> list[Path]:
    """The files a fresh clone of this working tree has (git's view; every file under the root otherwise)."""
    import subprocess

    res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=False)
    if res.returncode == 0:
        return [ROOT / p for p in res.stdout.decode().split("\0") if p and (ROOT / p).is_file()]
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if any(part in SKIP_PARTS or part.endswith(".egg-info") or part.startswith(".dev_") for part in rel.parts):
            continue
        if p.is_file():
            out.append(p)
    return out


def _scanned_text_files() -> list[Path]:
    keep = []
    for p in _tracked_files():
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(("docs/results/", "rlcore/data/gsm8k/")) or rel == "tests/test_docs_hygiene.py":
            continue  # raw logs; a data set's text; this file's own examples
        if p.suffix in TEXT_SUFFIXES and p.stat().st_size < 2_000_000:
            keep.append(p)
    return keep


def test_no_work_process_words_in_the_product():
    hits = []
    for p in _scanned_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = WORK_WORDS.search(line)
            if m:
                hits.append(f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "work-process words in the product:\n" + "\n".join(hits[:80])


def test_no_work_process_words_in_file_names_or_bench_keys():
    bad = [p.relative_to(ROOT).as_posix() for p in _tracked_files() if WORK_WORDS.search(p.name.replace("_", " "))]
    dirs = {p.parent for p in _tracked_files()} | {q for p in _tracked_files() for q in p.parents if ROOT in q.parents}
    bad += [d.relative_to(ROOT).as_posix() for d in dirs if WORK_WORDS.search(d.name.replace("_", " "))]

    def keys(obj, path=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield f"{path}.{k}"
                yield from keys(v, f"{path}.{k}")
        elif isinstance(obj, list):
            for v in obj:
                yield from keys(v, path)

    for j in sorted((RESULTS / "suite").glob("*.json")):
        bad += [f"{j.name}:{k}" for k in keys(json.loads(j.read_text())) if WORK_WORDS.search(k.replace("_", " "))]
    assert not bad, bad


def test_the_word_pattern_catches_what_it_must_and_spares_the_product_sessions():
    for s in (f"{_S} 16", f"{_S}16", f"as of this {_S}", f"{_I} 7", f"{_I} #12", "item 3", f"a {_W} of work"):
        assert WORK_WORDS.search(s), s
    for s in ("/rl/start_session", "aiohttp.ClientSession()", "an agent session's key", "session_id",
              'scope="session"', "a new process session (setsid)", "sessions expire", "itemsize", "items()",
              f"this {_S} was exported and is gone", f"the key that opened this {_S}"):
        assert not WORK_WORDS.search(s), s


# ----------------------------------------------------------------------------------------------------------
# docs/results/ <-> the docs that cite it
# ----------------------------------------------------------------------------------------------------------

RESULT_REF = re.compile(r"(?:docs/)?results/[A-Za-z0-9_.{},/-]*[A-Za-z0-9_}/]")


def _expand_braces(s: str) -> list[str]:
    parts = re.split(r"(\{[^{}]*\})", s)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def _references() -> dict[str, list[str]]:
    """``docs/results/...`` paths named in text files outside docs/results/ -> where they are named."""
    refs: dict[str, list[str]] = {}
    for p in _scanned_text_files():
        rel = p.relative_to(ROOT).as_posix()
        text = p.read_text(encoding="utf-8", errors="replace")
        for m in RESULT_REF.finditer(text):
            raw = m.group(0)
            if not raw.startswith("docs/"):
                # a bare "results/..." counts only as a relative link from a page in docs/
                if not rel.startswith("docs/") or text[max(0, m.start() - 1)] not in "(`'\" ":
                    continue
                raw = "docs/" + raw
            for path in _expand_braces(raw.rstrip(".,;:")):
                refs.setdefault(path.rstrip("/"), []).append(rel)
    return refs


def test_every_cited_result_exists():
    missing = {r: where for r, where in _references().items() if not (ROOT / r).exists()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_every_result_file_is_cited():
    refs = set(_references())
    orphans = []
    for f in sorted(p for p in _tracked_files() if RESULTS in p.parents):
        rel = f.relative_to(ROOT).as_posix()
        ancestors = {rel} | {p.relative_to(ROOT).as_posix() for p in f.parents if ROOT in p.parents}
        if not ancestors & refs:
            orphans.append(rel)
    assert not orphans, f"files under docs/results/ that nothing cites (delete them, git keeps them): {orphans}"


@pytest.mark.parametrize("s,expected", [("a/{b,c}.json", ["a/b.json", "a/c.json"]), ("x{,_2}.log", ["x.log", "x_2.log"])])
def test_brace_expansion(s: str, expected: list[str]):
    assert _expand_braces(s) == expected
