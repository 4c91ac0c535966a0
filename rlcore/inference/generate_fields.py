"""/generate's request fields and log-prob shapes (SGLang's ``GenerateReqInput`` and ``meta_info``), used by
``server``: which top-level fields are refused or accepted without effect, the per-prompt field rules, and the
``[logprob, token_id, text]`` triples of ``input_*`` / ``output_*`` log-probs, top-k alternatives included."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlcore.inference.engine import Engine
from rlcore.inference.openai_api import MASKED_LOGPROB
from rlcore.inference.protocol import BadRequest, json_int


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """How a /generate answer renders text (SGLang's request fields); the token ids are never affected."""

    no_stop_trim: bool = False
    skip_special_tokens: bool = False
    """``sampling_params.skip_special_tokens``: SGLang's default for a request is True; ours for direct
    callers of ``generate_response`` is False (text keeps special tokens, as ``SamplingParams.to_sglang`` asks)."""
    text_in_logprobs: bool = False
    """``return_text_in_logprobs``: fill the third element of each log-prob triple with the token's text."""


def _triples(engine: Engine, lps: list, ids: list[int], with_text: bool) -> list[list]:
    """SGLang's ``[logprob, token_id, text | None]`` triples. A log-prob of ``-inf`` (a token the sampler could not
    draw: outside top-k / top-p / min-p, or biased by -100) is sent as ``MASKED_LOGPROB`` (JSON has no infinity)."""
    lps = [lp if lp is None or lp > MASKED_LOGPROB else MASKED_LOGPROB for lp in lps]
    if with_text and engine.tokenizer is not None:
        texts = engine.tokenizer.batch_decode([[t] for t in ids])
        return [[lp, t, x] for lp, t, x in zip(lps, ids, texts)]
    return [[lp, t, None] for lp, t in zip(lps, ids)]


@dataclasses.dataclass
class PromptScores:
    """Prompt-side log-probs of one /generate request from ``logprob_start_len`` on (SGLang's ``input_*`` fields)."""

    values: list
    """``input_token_logprobs`` values: None first, then ``log p(ids[j] | ids[:j])``."""
    ids: list[int]
    """The prompt ids those values are of (``prompt[start:]``)."""
    top: list | None = None
    """``input_top_logprobs``: None first, then ``(id, log-prob)`` pairs per position (with ``top_logprobs_num``)."""
    chosen: list | None = None
    """``input_token_ids_logprobs``: None first, then the log-probs of ``token_ids_logprob`` per position."""
    token_ids: tuple[int, ...] = ()
    """The request's ``token_ids_logprob`` (the ids of every ``*_token_ids_logprobs`` triple)."""


def _logprob_meta(
    engine: Engine, meta: dict, scores: PromptScores | None, prompt: list[int], opts: TextOptions,
    out_lps: list, out_ids: list[int], out_top: list | None, out_tid: list | None,
) -> None:
    """Fill SGLang's log-prob fields of ``meta_info``: ``input_token_logprobs`` / ``output_token_logprobs``
    (``[logprob, id, text]`` triples), and with ``top_logprobs_num`` ``input_top_logprobs`` /
    ``output_top_logprobs`` (per position a list of triples, None for the first prompt position), and with
    ``token_ids_logprob`` ``input_token_ids_logprobs`` / ``output_token_ids_logprobs`` (per position the triples of
    the chosen ids, in their order)."""
    sc = scores if scores is not None else PromptScores([None], prompt[-1:], [None], [None])
    text = opts.text_in_logprobs
    meta["input_token_logprobs"] = _triples(engine, sc.values, sc.ids, text)
    meta["output_token_logprobs"] = _triples(engine, out_lps, out_ids, text)
    if out_top is not None:
        meta["input_top_logprobs"] = [None if row is None else _triples(engine, [lp for _, lp in row],
                                                                        [t for t, _ in row], text)
                                      for row in (sc.top if sc.top is not None else [None])]
        meta["output_top_logprobs"] = [_triples(engine, [lp for _, lp in row], [t for t, _ in row], text)
                                       for row in out_top]
    if out_tid is not None:
        chosen = list(sc.token_ids)
        meta["input_token_ids_logprobs"] = [None if row is None else _triples(engine, row, chosen, text)
                                            for row in (sc.chosen if sc.chosen is not None else [None])]
        meta["output_token_ids_logprobs"] = [_triples(engine, row, chosen, text) for row in out_tid]


_MM = "text-only models; send text or input_ids"
_PD = "prefill/decode disaggregation is not available"
_DP = "there is one data-parallel rank"
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    # field: (SGLang's default, why a non-default value is refused)
    "session_id": (None, "sessions are not kept; send the whole prompt"),
    "session_params": (None, "sessions are not kept; send the whole prompt"),
    "input_embeds": (None, "send text or input_ids"),
    "image_data": (None, _MM), "video_data": (None, _MM), "audio_data": (None, _MM), "mm_hashes": (None, _MM),
    "mm_content_hashes": (None, _MM), "use_audio_in_video": (False, _MM), "video_config": (None, _MM),
    "modalities": (None, _MM), "need_wait_for_mm_inputs": (None, _MM), "num_items_assigned": (None, _MM),
    "encoder_urls": (None, _MM), "max_dynamic_patch": (None, _MM), "min_dynamic_patch": (None, _MM),
    "image_max_dynamic_patch": (None, _MM), "video_max_dynamic_patch": (None, _MM), "images_config": (None, _MM),
    "mm_processor_kwargs": (None, _MM),
    "watermark": (None, "watermarking is not available"),
    "return_sampling_mask": (False, "sampling masks are not returned"),
    "sampling_logprobs_mode": (None, "log-probs are always those of the distribution sampled (docs/engine.md)"),
    "return_flat_raw_top_logprobs": (False, "top log-probs come in the nested shape only"),
    "return_flat_raw_output_top_logprobs": (False, "top log-probs come in the nested shape only"),
    "return_flat_raw_top_logprobs_b64": (False, "top log-probs come in the nested shape only"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "return_routed_experts": (False, "MoE routing is not exposed"),
    "routed_experts_start_len": (0, "MoE routing is not exposed"),
    "return_indexer_topk": (False, "sparse-attention indexers are not exposed"),
    "return_entropy": (False, "entropies are not returned"),
    "return_bytes": (False, "token bytes are not returned; use return_text_in_logprobs"),
    "return_prompt_token_ids": (False, "send input_ids, or call /tokenize"),
    "lora_id": (None, "name the adapter with lora_path (its lora_name); SGLang's internal lora_id is not used"),
    "custom_logit_processor": (None, "custom logit processors do not run in the embedded engine"),
    "positional_embed_overrides": (None, "positions are always 0..n-1"),
    "bootstrap_host": (None, _PD), "bootstrap_port": (None, _PD), "bootstrap_room": (None, _PD),
    "bootstrap_pair_key": (None, _PD), "decode_tp_size": (None, _PD), "disagg_prefill_dp_rank": (None, _PD),
    "routed_dp_rank": (None, _DP), "data_parallel_rank": (None, _DP),
    "background": (False, "requests are answered in the call that sends them"),
    "require_reasoning": (False, "there is no reasoning parser"),
    "max_thinking_tokens": (None, "there is no reasoning parser; cap the output with max_new_tokens"),
    "priority": (None, "there is no priority scheduling"),
    "multi_item_delimiter_indices": (None, "multi-item scoring is not available; score each item"),
    "token_indices_to_pool": (None, "pooling is not available (generation only)"),
    "kv_hints": (None, "KV placement hints are not used"),
}
"""Top-level fields of SGLang's ``GenerateReqInput`` (0.5.23) that /generate refuses (400 naming the field) when
given a value other than SGLang's default, rather than ignores."""

NO_EFFECT_FIELDS: dict[str, str] = {
    "log_metrics": "metrics switch; SGLang's output does not depend on it",
    "no_logs": "logging switch; SGLang's output does not depend on it",
    "custom_labels": "metrics labels; SGLang's output does not depend on them",
    "external_trace_header": "tracing header; SGLang's output does not depend on it",
    "received_time": "a timestamp for SGLang's latency metrics",
    "http_worker_ipc": "SGLang's internal worker address",
    "routing_key": "a router's key; one server here",
    "conversation_id": "a router's affinity key; one server here",
    "extra_key": "a prefix-cache namespace: without EngineConfig.prefix_cache there is no cache to partition",
    "cache_salt": "a prefix-cache salt: without EngineConfig.prefix_cache there is no cache to salt",
}
"""Top-level ``GenerateReqInput`` fields accepted without effect: they change nothing in SGLang's output either."""


def check_cache_keys(engine: Engine, body: dict, refuse: type[Exception] = BadRequest) -> None:
    """``extra_key`` / ``cache_salt`` partition SGLang's prefix cache; this one is not partitioned, so with
    ``EngineConfig.prefix_cache`` on they are refused (a 400 naming them) rather than silently shared."""
    if getattr(engine.cfg, "prefix_cache", False):
        for key in ("extra_key", "cache_salt"):
            if body.get(key) not in (None, "", []):
                raise refuse(f"{key} is not supported with EngineConfig.prefix_cache on: the cache is not "
                             "partitioned per tenant; drop it or serve tenants from separate engines")


def _check_lora_path(engine: Engine, raw: Any, n_prompts: int) -> None:
    """``lora_path`` (SGLang: the name of a loaded adapter, one for all prompts or a list with one per prompt).

    The embedded engine merges one adapter into its weights, the most recently loaded (``Engine.lora_applied``), and
    serves every request with it: a request may name any *loaded* adapter (an older one was superseded by a newer
    publish, as a request in flight across a full weight load is; its tokens carry the version that produced them in
    ``output_token_versions``). A name that is not loaded is refused."""
    if raw is None:
        return
    names = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and len(raw) != n_prompts:
        raise BadRequest(f"lora_path: a list needs one entry per prompt ({n_prompts}), got {len(raw)}")
    loaded = engine.lora_adapters
    for x in names:
        if x is None:
            continue
        if not isinstance(x, str):
            raise BadRequest("lora_path must be an adapter name (string), null, or a list of them")
        if x not in loaded:
            raise BadRequest(f"lora_path {x!r} is not a loaded LoRA adapter (loaded: {list(loaded)}); load it first "
                             "with /load_lora_adapter")


def _json_top_k(x: Any, name: str) -> int:
    return json_int(x, name, 0)


def _json_token_ids(x: Any, name: str) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(type(t) is int for t in x):
        raise BadRequest(f"{name} must be a flat list of integers (token ids), or one such list per prompt")
    return tuple(x)


def _per_prompt(raw: Any, n: int, name: str, parse: Any, nested: bool = False) -> list:
    """A top-level /generate field given once for the batch or as a list with one entry per prompt (SGLang)."""
    if raw is None:
        return [() if nested else 0] * n
    per = isinstance(raw, list) and (not nested or (bool(raw) and isinstance(raw[0], list)))
    if per:
        if len(raw) != n:
            raise BadRequest(f"{name}: a list needs one entry per prompt ({n}), got {len(raw)}")
        return [parse(x, f"{name}[{i}]") if x is not None else (() if nested else 0) for i, x in enumerate(raw)]
    return [parse(raw, name)] * n


def _logprob_starts(raw: Any, prompts: list[list[int]]) -> list[int | None]:
    """``logprob_start_len`` per prompt: None for SGLang's default (-1: the last prompt token only), else the
    first prompt position reported in ``input_token_logprobs`` (which then covers ``prompt[start:]``)."""
    vals = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(vals) != len(prompts):
        raise BadRequest(f"logprob_start_len: a list needs one entry per prompt ({len(prompts)}), got {len(vals)}")
    out: list[int | None] = []
    for x, v in zip(prompts, vals):
        if v is None or v == -1:
            out.append(None)
            continue
        v = json_int(v, "logprob_start_len", -1)
        if v >= len(x):
            raise BadRequest(f"logprob_start_len ({v}) must be < the prompt's {len(x)} tokens (-1 for the default)")
        out.append(v if v < len(x) - 1 else None)
    return out
