"""GSM8K as a list of prompt rows for the rollout workflows.

Each jsonl line holds ``question`` and ``answer`` (a worked solution ending in ``#### <number>``).
A row becomes ``{"messages": [{"role": "user", "content": ...}], "prompt": "Question: ...\nAnswer:",
"answer": "<number>", "question": ..., "solution": ...}``; ``messages`` is what the workflows template (the raw
``prompt`` is used instead when the tokenizer has no chat template, i.e. a base model), ``answer`` is what
``rlcore.rollout.rewards.math.gsm8k_reward`` checks against.

The data ships with rlcore (``rlcore/data/gsm8k/{train,test}.jsonl``, MIT, see the ``LICENSE`` there), so
``load_split`` works on any installation; ``RLCORE_GSM8K_DIR`` or an experiment's ``--data-dir`` override it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent / "gsm8k"
"""The copy shipped as package data (``train.jsonl``, ``test.jsonl``, ``LICENSE``)."""


def _default_dir() -> Path:
    """``$RLCORE_GSM8K_DIR`` when set, else the bundled copy."""
    if os.environ.get("RLCORE_GSM8K_DIR"):
        return Path(os.environ["RLCORE_GSM8K_DIR"])
    return BUNDLED_DIR


GSM8K_DIR = _default_dir()
"""Default location of ``train.jsonl`` and ``test.jsonl`` (override with ``RLCORE_GSM8K_DIR`` or ``--data-dir``)."""

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")

HOW_TO_GET = (
    "drop --data-dir / --data (and unset RLCORE_GSM8K_DIR) to use the copy bundled with rlcore (rlcore/data/gsm8k/; "
    "reinstall rlcore if it is missing), or download it: python -c \"from datasets import load_dataset; "
    "[load_dataset('openai/gsm8k', 'main', split=s).to_json(f'DIR/{s}.jsonl') for s in ('train', 'test')]\" "
    "and pass --data-dir DIR"
)
"""The two ways to get the data, quoted in the missing-file error."""

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
"""Appended to every question (the prompt suffix AReaL's GSM8K examples use)."""


def parse_row(line: str, *, path: str | Path = "<string>", lineno: int = 1, instruction: str = INSTRUCTION) -> dict:
    """Turn one jsonl line into a prompt row; raises ValueError naming ``path:lineno``, the field and what was expected."""
    where = f"{path}:{lineno}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); expected one object per line") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object with fields 'question' and 'answer', got {type(raw).__name__}")
    for key in ("question", "answer"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            got = "missing" if key not in raw else repr(raw[key])[:60]
            raise ValueError(f"{where}: field '{key}' must be a non-empty string, got {got}")
    solution = raw["answer"]
    if "####" not in solution:
        raise ValueError(f"{where}: field 'answer' must end with '#### <final answer>', got {solution[-60:]!r}")
    final = solution.rsplit("####", 1)[1].strip()
    if not final:
        raise ValueError(f"{where}: field 'answer' has an empty final answer after '####'; expected a number")
    number = final.replace(",", "")
    if not _NUMBER.fullmatch(number):
        raise ValueError(
            f"{where}: field 'answer' has a non-numeric final answer {final[:60]!r} after '####'; "
            "expected a number such as '#### 1,203' or '#### -4.5'"
        )
    return {
        "messages": [{"role": "user", "content": raw["question"].strip() + instruction}],
        "prompt": "Question: " + raw["question"].strip() + instruction + "\nAnswer:",
        "answer": number,
        "question": raw["question"],
        "solution": solution,
    }


def load(path: str | Path, *, limit: int | None = None, instruction: str = INSTRUCTION) -> list[dict]:
    """Read a GSM8K-style jsonl file (blank lines skipped) into prompt rows, at most ``limit`` of them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K file {path} does not exist (from --data-dir / --data / RLCORE_GSM8K_DIR / path=); expected a jsonl "
            f"with 'question'/'answer' rows. To get the data: {HOW_TO_GET}"
        )
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}: {e.reason}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not line.strip():
                continue
            rows.append(parse_row(line, path=path, lineno=lineno, instruction=instruction))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def load_split(split: str = "train", *, root: str | Path = GSM8K_DIR, limit: int | None = None) -> list[dict]:
    """``load(root / f"{split}.jsonl")`` for split in {"train", "test"}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return load(Path(root) / f"{split}.jsonl", limit=limit)
