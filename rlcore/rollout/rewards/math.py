"""GSM8K answer checking: extract the model's final answer and compare it numerically.

Pure functions on strings, no torch. Extraction looks for ``\\boxed{...}`` (brace-balanced) and
``#### ...`` answers; when several occur, the one that ends last in the text wins. Numbers are
compared exactly as fractions after normalisation, so ``"$1,000.00"``, ``"1000 dollars"``,
``"1000."`` and ``"1e3"`` are all equal, ``"3/4"`` equals ``"0.75"`` and ``"\\frac{3}{4}"``,
``"-5"`` equals ``"−5"``, and ``"25%"`` equals ``"25"`` (GSM8K stores percentages without the sign).

Reward contract used by the workflows (rlcore.rollout.workflows): ``reward_fn(completion, item) ->
float`` where ``item`` is the dataset row (here it needs ``item["answer"]``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d*)?)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*([^\n]*)")


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """``(end position, content)`` of every brace-balanced ``\\boxed{...}`` / ``\\fbox{...}``."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((i, text[m.end() : i - 1]))
    return out


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text``: the last ``\\boxed{...}`` or ``#### ...`` (by end position).

    Returns None when neither form occurs.
    """
    found = _boxed_spans(text)
    found += [(m.end(), m.group(1)) for m in _HASHES.finditer(text)]
    if not found:
        return None
    return max(found, key=lambda x: x[0])[1].strip()


def parse_number(text: str) -> Fraction | None:
    """Normalise an answer string to an exact number, or None when it holds no number.

    Strips LaTeX wrappers, ``$``, thousands separators, units and trailing punctuation, maps the
    unicode minus to ``-``, reads ``a/b`` and ``\\frac{a}{b}`` as fractions and ``x%`` as ``x``.
    When the string holds several numbers the first one is used (``"18 dollars per 2 days"`` ⇒ 18),
    except that a leading ``=`` chain keeps the value after the last ``=`` (``"2+3 = 5"`` ⇒ 5).
    """
    s = text.replace("\u2212", "-").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\(?:left|right|displaystyle)", " ", s)
    s = s.replace("$", " ").replace("\\%", "%").replace("(", "").replace(")", "")
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators only: "1,234" but not "1,2"
    m = _NUMBER.search(s)
    if m is None:
        return None
    tok = re.sub(r"\s+", "", m.group(0))
    try:
        if "/" in tok:
            num, den = tok.split("/")
            value = Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        else:
            value = Fraction(tok)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value


def answers_match(predicted: str | None, reference: str) -> bool:
    """True when ``predicted`` and ``reference`` normalise to the same number (string match if not numeric)."""
    if predicted is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is None or b is None:
        norm = lambda x: re.sub(r"\s+", "", x).strip(".").lower()  # noqa: E731
        return a is None and b is None and norm(predicted) == norm(reference) != ""
    return a == b


def reference_answer(solution: str) -> str:
    """The final answer of a GSM8K ``answer`` field (the text after the last ``####``)."""
    found = _HASHES.findall(solution)
    if not found:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return found[-1].strip()


def score(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals ``answer`` numerically, else 0.0. Never raises."""
    try:
        return 1.0 if answers_match(extract_answer(completion), answer) else 0.0
    except Exception:  # a reward must never kill a rollout; malformed text scores 0
        return 0.0


def gsm8k_reward(completion: str, item: Mapping) -> float:
    """Workflow reward: ``score(completion, item["answer"])`` (``item`` from rlcore.data.gsm8k)."""
    return score(completion, str(item["answer"]))
