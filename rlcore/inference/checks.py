"""Request checks against the model, shared by the engine (``Engine.check``) and the servers: every sampling setting
the engine's sampling step (``rlcore.inference.sampling``) could not run safely is refused with an ``EngineError``
naming the field and the fix."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rlcore.inference.protocol import EngineError, SamplingParams
from rlcore.inference.sampling import stop_strings

MIN_TEMPERATURE = 1e-5
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are refused: ``logits / T`` overflows float32 (NaN log-probs)."""
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
"""``repetition_penalty`` must lie here (1 = off): outside it the penalised logits overflow or vanish."""
INT64_MAX = (1 << 63) - 1


def context_advice(context_limit: str, setting: str) -> str:
    """The end of a "prompt too long" message: raise ``setting`` (``EngineConfig.max_seq_len``, ``--max-seq-len``)
    when it bounds the context (``context_limit == "max_seq_len"``), else name the model config field that does."""
    if context_limit == "max_seq_len":
        return f" or raise {setting}"
    return f" (the model's config.json {context_limit} bounds the context: a larger {setting} is clipped to it)"


def check_request(
    prompt: Sequence[int],
    sp: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    has_tokenizer: bool,
    context_limit: str = "max_seq_len",
) -> SamplingParams:
    """Validate one request against the model; returns the settings the engine runs (``max_new_tokens``
    clamped to the room left in the context, ``prompt + output <= max_seq_len``). ``context_limit``: what bounds
    ``max_seq_len``, ``EngineConfig``'s own or the model config field that clipped it (``Engine.context_limit``).

    Raises ``EngineError`` naming the field and the fix for anything the sampling step could not run safely:
    token ids outside the vocabulary, a prompt that leaves no room, temperatures that overflow, penalties
    outside their ranges, ``min_new_tokens`` that cannot fit.
    """
    if not prompt:
        raise EngineError("input_ids is empty; pass at least one token id")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"input_ids contains ids outside [0, {vocab_size}); check the tokenizer")
    if len(prompt) >= max_seq_len:
        raise EngineError(  # SGLang's text first (public context-overflow detectors match it), then the fix
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({max_seq_len} tokens): "
            f"input_ids must leave room for one new token; shorten the prompt"
            f"{context_advice(context_limit, 'EngineConfig.max_seq_len')}"
        )
    for name in ("max_new_tokens", "min_new_tokens", "top_k"):
        x = getattr(sp, name)
        if isinstance(x, bool) or not isinstance(x, int) or abs(x) > INT64_MAX:
            raise EngineError(f"sampling_params.{name} must be an integer that fits in 64 bits, got {x!r}")
    if not (sp.max_new_tokens >= 0):
        raise EngineError(f"sampling_params.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    t = sp.temperature
    if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
        raise EngineError(
            f"sampling_params.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {t}; smaller positive values overflow float32 logits (send 0 for greedy)"
        )
    if not (0 < sp.top_p <= 1):
        raise EngineError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise EngineError(f"sampling_params.top_k must be -1 (off) or >= 1, got {sp.top_k}")
    bad = [
        x
        for x in sp.stop_token_ids
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab_size
    ]
    if bad:
        raise EngineError(
            f"sampling_params.stop_token_ids has ids outside [0, {vocab_size}) (the model's vocabulary): "
            f"{bad[:5]}; check the tokenizer"
        )
    stops = stop_strings(sp)
    if not all(isinstance(x, str) and x for x in stops):
        raise EngineError(f"sampling_params.stop must be non-empty strings, got {sp.stop!r}")
    if stops and not has_tokenizer:
        raise EngineError(
            "sampling_params.stop (stop strings) needs a tokenizer to decode the output; this engine has "
            "none: start it with a tokenizer (--tokenizer DIR) or use stop_token_ids"
        )
    if not (0 <= sp.min_new_tokens <= sp.max_new_tokens):
        raise EngineError(
            f"sampling_params.min_new_tokens must be in [0, max_new_tokens={sp.max_new_tokens}], "
            f"got {sp.min_new_tokens}"
        )
    room = max_seq_len - len(prompt)
    if sp.min_new_tokens > room:
        raise EngineError(
            f"sampling_params.min_new_tokens ({sp.min_new_tokens}) does not fit: the prompt has {len(prompt)} "
            f"tokens and max_seq_len is {max_seq_len}, so at most {room} can be generated"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        x = getattr(sp, name)
        if not (math.isfinite(x) and -2 <= x <= 2):
            raise EngineError(f"sampling_params.{name} must be in [-2, 2] (0 = off), got {x}")
    lo, hi = REPETITION_PENALTY_RANGE
    if not (math.isfinite(sp.repetition_penalty) and lo <= sp.repetition_penalty <= hi):
        raise EngineError(
            f"sampling_params.repetition_penalty must be in [{lo}, {hi}] (1 = off), got {sp.repetition_penalty}"
        )
    if not (math.isfinite(sp.min_p) and 0 <= sp.min_p <= 1):
        raise EngineError(f"sampling_params.min_p must be in [0, 1] (0 = off), got {sp.min_p}")
    bad = [t for t, b in sp.logit_bias if not 0 <= t < vocab_size or not math.isfinite(b)]
    if bad:
        raise EngineError(
            f"logit_bias has token ids outside [0, {vocab_size}) or non-finite biases: {bad[:5]}; keys are token ids"
        )
    if sp.top_logprobs_num < 0:
        raise EngineError(f"top_logprobs_num must be >= 0, got {sp.top_logprobs_num}")
    bad = [t for t in sp.token_ids_logprob if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(
            f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; valid range is [0, {vocab_size})"
        )
    if sp.stop_regex and not has_tokenizer:
        raise EngineError(
            "sampling_params.stop_regex needs a tokenizer to decode the output; this engine has none: start it "
            "with a tokenizer (--tokenizer DIR) or use stop_token_ids"
        )
    if sp.seed is not None and not -(1 << 63) <= sp.seed <= INT64_MAX:
        raise EngineError(f"sampling_params.sampling_seed must fit in a signed 64-bit integer, got {sp.seed}")
    if sp.max_new_tokens > room:
        return dataclasses.replace(sp, max_new_tokens=room)
    return sp
