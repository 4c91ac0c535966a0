"""Constrained decoding (SGLang's ``regex``, ``json_schema``, ``ebnf``; OpenAI's ``response_format``) with xgrammar.

Why xgrammar: it is what SGLang and vLLM use by default, so the grammar dialects (its EBNF, its regex and JSON-Schema
subsets, the JSON whitespace rules) are the ones their clients are written against; it compiles against the
tokenizer's vocabulary once per grammar (cached here) and fills a per-step token bitmask on the CPU in microseconds;
it runs without a GPU. It is an optional extra (``pip install 'rlcore[grammar]'``): without it the grammar fields
answer 400 naming the extra.

A request's ``SamplingParams.grammar`` is ``(kind, spec)``; ``Constraint`` holds its matcher. Each sampling step,
``masks`` gives the allowed tokens of every constrained row (from the matcher's state after the tokens so far), the
engine sets the other logits to ``-inf`` before temperature and top-k / top-p, and ``Constraint.accept`` advances
the matcher with the committed token; a matcher that reaches its end finishes the request. The reported log-probs
are therefore those of the masked, renormalised distribution actually sampled (post-mask), as SGLang's are.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from rlcore.inference.protocol import GRAMMAR_EXTRA, EngineError, grammar_available

KINDS = ("regex", "json_schema", "ebnf", "json_object")
"""``SamplingParams.grammar[0]``: a regular expression, a JSON Schema (a JSON string), an EBNF grammar (xgrammar's
GBNF dialect, root rule ``root``), or any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
EXTRA = GRAMMAR_EXTRA


def available() -> bool:
    """True when xgrammar can be imported here."""
    return grammar_available()


def require(field: str) -> None:
    """Raise ``EngineError`` naming ``field`` and the extra when xgrammar is missing."""
    if not available():
        raise EngineError(f"{field}: constrained decoding needs xgrammar, which is not installed; {EXTRA}")


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer: Any, vocab_size: int) -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1)


@functools.lru_cache(maxsize=64)
def _compiled(tokenizer: Any, vocab_size: int, kind: str, spec: str) -> Any:
    comp = _compiler(tokenizer, vocab_size)
    if kind == "regex":
        return comp.compile_regex(spec)
    if kind == "ebnf":
        return comp.compile_grammar(spec)
    if kind == "json_object":
        return comp.compile_builtin_json_grammar()
    return comp.compile_json_schema(spec, any_whitespace=False)


def compile_constraint(tokenizer: Any, vocab_size: int, grammar: tuple[str, str]) -> Constraint:
    """A fresh ``Constraint`` for one request; a grammar xgrammar cannot compile is an ``EngineError`` naming the
    field."""
    kind, spec = grammar
    require(kind)
    if tokenizer is None:
        raise EngineError(f"{kind}: constrained decoding needs the engine's tokenizer (start it with one)")
    if kind == "json_schema":
        try:
            json.loads(spec)
        except (TypeError, ValueError) as e:
            raise EngineError(f"json_schema must be a JSON Schema as a JSON string: {e}") from None
    try:
        import xgrammar as xgr

        return Constraint(xgr.GrammarMatcher(_compiled(tokenizer, vocab_size, kind, spec)), vocab_size, kind)
    except EngineError:
        raise
    except Exception as e:  # xgrammar's parse errors (RuntimeError / ValueError) name the position
        raise EngineError(f"{kind} could not be compiled by xgrammar: {type(e).__name__}: {e}") from None


class Constraint:
    """One request's grammar state (an ``xgrammar.GrammarMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int, kind: str = "regex") -> None:
        self.matcher, self.vocab_size, self.kind = matcher, vocab_size, kind

    @property
    def field(self) -> str:
        """The request field that set this grammar (for error messages)."""
        return "response_format" if self.kind == "json_object" else f"sampling_params.{self.kind} ({self.kind})"

    def accept(self, token: int) -> bool:
        """Advance with a committed token; False if the grammar does not allow it (the mask should prevent it)."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete and accepted its end (a stop token)."""
        return bool(self.matcher.is_terminated())


def masks(constraints: list[Constraint], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``(j, vocab)`` bool: the tokens each constrained row may sample next (from its matcher's state)."""
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(len(constraints), vocab_size)  # (j, ceil(v / 32)) int32
    for i, c in enumerate(constraints):
        c.matcher.fill_next_token_bitmask(bm, i)
    bits = (bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # (j, w, 32), bit b of word w = token 32w+b
    return bits.reshape(len(constraints), -1)[:, :vocab_size].bool().to(device)


__all__ = ["EXTRA", "KINDS", "Constraint", "available", "compile_constraint", "masks", "require"]
