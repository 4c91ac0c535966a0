"""Data types shared by the engine, its HTTP server, the client and the rollout system.

These mirror the SGLang-native protocol (docs/system.md, ../shared/spec/system.md §1.2, §4) so that
the same rollout code runs against the embedded engine, our HTTP server and a real SGLang server.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["stop", "length", "abort", "tool_calls"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (SGLang's ``sampling_params``)."""

    max_new_tokens: int = 256
    """Maximum number of tokens to generate for this request."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or >= vocab) keeps all."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting any of these ids (the stop token is returned)."""
    ignore_eos: bool = False
    """Do not stop on the model's eos token."""
    seed: int | None = None
    """Per-request sampling seed (SGLang's ``sampling_seed``)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded output contains one (needs the engine's tokenizer). The
    tokens are all returned; the server's ``text`` is cut before the match unless ``no_stop_trim``."""
    no_stop_trim: bool = False
    """Keep the matched stop string at the end of the returned ``text`` (SGLang's ``no_stop_trim``)."""
    min_new_tokens: int = 0
    """The eos ids and ``stop_token_ids`` cannot be sampled before this many tokens (logits set to -inf)."""
    frequency_penalty: float = 0.0
    """OpenAI rule, in [-2, 2]: subtract ``frequency_penalty * count`` from each generated token's logit."""
    presence_penalty: float = 0.0
    """OpenAI rule, in [-2, 2]: subtract ``presence_penalty`` from the logit of every generated token."""
    repetition_penalty: float = 1.0
    """CTRL rule, > 0 (1 = off): the logit of a token generated so far is divided by it when positive and
    multiplied by it otherwise. Penalties change the sampling distribution: RL should leave all three off."""

    def to_sglang(self) -> dict:
        """The ``sampling_params`` JSON object SGLang's /generate expects."""
        d = {
            "max_new_tokens": int(self.max_new_tokens),
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "stop_token_ids": [int(t) for t in self.stop_token_ids],
            "ignore_eos": bool(self.ignore_eos),
            "skip_special_tokens": False,
        }
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        # Newer fields are sent only when set, so the JSON of existing callers is unchanged.
        if self.stop:
            d["stop"] = [self.stop] if isinstance(self.stop, str) else [str(s) for s in self.stop]
        if self.no_stop_trim:
            d["no_stop_trim"] = True
        if self.min_new_tokens:
            d["min_new_tokens"] = int(self.min_new_tokens)
        if self.frequency_penalty:
            d["frequency_penalty"] = float(self.frequency_penalty)
        if self.presence_penalty:
            d["presence_penalty"] = float(self.presence_penalty)
        if self.repetition_penalty != 1.0:
            d["repetition_penalty"] = float(self.repetition_penalty)
        return d


@dataclass
class GenerateOutput:
    """Result of one request; the three ``output_*`` lists have one entry per generated token."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict
    """SGLang shape: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
    ``{"type": "abort", "message": str}``."""
    weight_version: int = 0
    """Engine version when the request finished."""
    latency: float = 0.0
    ttft: float = 0.0


class EngineError(ValueError):
    """Bad input to the engine; the message names the offending field and the fix."""


@dataclass
class ModelRequest:
    """One generation request at the rollout level (n_samples is always 1 here)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    max_tokens: int | None = None
    """Optional cap on prompt + completion length."""
    metadata: dict = field(default_factory=dict)


@dataclass
class ModelResponse:
    """What ``agenerate`` returns: one entry per output token in each list."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0
    ttft: float = 0.0

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    @property
    def head_version(self) -> int:
        return min(self.output_versions) if self.output_versions else -1

    @property
    def tail_version(self) -> int:
        return max(self.output_versions) if self.output_versions else -1


def parallel_sampling(sp: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` per-sample settings of one prompt: sample ``j`` gets seed ``seed + j`` (wrapped to int64)
    when the request has a seed, else none (the engine draws a fresh one per sample)."""
    if sp.seed is None or n == 1:
        return [sp] * n
    return [
        dataclasses.replace(sp, seed=((sp.seed + j + (1 << 63)) % (1 << 64)) - (1 << 63)) for j in range(n)
    ]
