"""A tiny character-level tokenizer and a tiny Qwen2-style model, for tests and the CPU main job.

Nothing here downloads anything: the tokenizer is a ``PreTrainedTokenizerFast`` built over a
character vocabulary (one token per character, plus ``<pad>``, ``<eos>`` and ``<unk>``) with a
Jinja chat template, and the model is a ``Qwen2ForCausalLM`` built from a config. Both round-trip
through ``save_pretrained`` / ``from_pretrained``, so the engine, the trainer and the SFT script
can all load the same directory.

Chat template: every message's content is written as it is, and an assistant message is followed
by ``<eos>``. There is no role marker and no generation prompt, so the countdown prompt
``"3579:42="`` (rlcore.data.countdown) is exactly the text the model continues.

``generate`` is a small batched sampler over the HF forward with a KV cache, used to evaluate
(greedy) and to calibrate; the RL loop itself samples through the embedded engine.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

COUNTDOWN_ALPHABET = "0123456789+-*:="
"""Characters of the countdown task: digits, the three operators, ``:`` and ``=``."""
BOXED_ALPHABET = COUNTDOWN_ALPHABET + ",\\boxed{}"
"""Countdown with worked steps and a ``\\boxed{}`` answer (rlcore.data.countdown.worked_solution): adds ``,``,
the backslash, the letters of ``boxed`` and the braces."""
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
"""Special tokens; they take ids 0, 1, 2 in this order."""
COUNTDOWN_TINY_DIR = Path(__file__).resolve().parent / "assets" / "countdown-tiny"
"""The main job's warm-started tiny Countdown model (HF model + tokenizer + chat template + warmstart.json, made
by experiments/sft_warmstart.py). Package data (pyproject ``[tool.setuptools.package-data]``), so it is there in
an installed wheel as in the checkout: ``AutoModelForCausalLM.from_pretrained(COUNTDOWN_TINY_DIR)``."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Content verbatim; ``<eos>`` after each assistant turn; no generation prompt."""


def build_tokenizer(alphabet: str = COUNTDOWN_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` (ids 3, 4, ... in order), plus the special tokens.

    Characters outside the alphabet encode to ``<unk>``. ``decode`` joins characters without spaces.
    """
    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise ValueError(f"alphabet must be non-empty with no repeated characters, got {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved with ``save_pretrained`` (ours or any local HF tokenizer)."""
    return AutoTokenizer.from_pretrained(str(path))


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen2 decoder (defaults: 2 layers, width 64, about 0.1M parameters)."""

    num_layers: int = 2
    """Number of decoder layers."""
    hidden_size: int = 64
    """Model width."""
    num_heads: int = 4
    """Attention heads; must divide ``hidden_size``."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 192
    """Width of the SwiGLU MLP."""
    max_positions: int = 64
    """Longest sequence (prompt + completion) the rotary table is sized for."""
    tie_embeddings: bool = True
    """Share the input embedding and the LM head."""
    attn_implementation: str = "sdpa"
    """HF attention backend (``sdpa`` or ``eager``)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if min(self.num_layers, self.hidden_size, self.intermediate_size, self.max_positions) < 1:
            raise ValueError("num_layers, hidden_size, intermediate_size and max_positions must be >= 1")


def build_config(tokenizer: PreTrainedTokenizerBase, cfg: TinyModelConfig = TinyModelConfig()) -> Qwen2Config:
    """A ``Qwen2Config`` sized for ``tokenizer`` (vocab, pad and eos ids taken from it)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = cfg.attn_implementation
    return config


def build_model(
    tokenizer: PreTrainedTokenizerBase, cfg: TinyModelConfig = TinyModelConfig(), *, seed: int = 0
) -> Qwen2ForCausalLM:
    """A freshly initialised tiny ``Qwen2ForCausalLM`` (float32, eval mode, deterministic in ``seed``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(build_config(tokenizer, cfg))
    return model.eval()


def num_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    pad_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched sampling from equal-length prompts with a KV cache (no padding inside the prompt).

    Args:
      input_ids: ``(b t)`` prompt ids, all rows the same length ``t``.
      max_new_tokens: number of decoding steps at most.
      stop_ids: a row is finished after it emits one of these ids (the stop id is kept).
      pad_id: written after a row has finished.
      temperature: 0 means greedy; otherwise sample from ``softmax(logits / temperature)``.
    Returns:
      ``tokens (b n)`` (n ≤ max_new_tokens, ``pad_id`` after the stop token), ``logp (b n)`` (log-prob
      of each token under the sampling distribution; 0 after the stop) and ``lengths (b,)``
      (generated tokens per row, stop token included).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (b t) with t >= 1, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b = input_ids.shape[0]
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=input_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    tokens, logps = [], []
    # transformers 5.2x renamed ``past_key_values`` to ``cache``; support both spellings.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if temperature > 0:
            logp_all = torch.log_softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        else:
            logp_all = torch.log_softmax(logits, dim=-1)
            nxt = logits.argmax(-1)
        lp = logp_all.gather(1, nxt[:, None]).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        logps.append(torch.where(done, torch.zeros_like(lp), lp))
        done = done | torch.isin(nxt, stop)
        if bool(done.all()):
            break
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        out = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache})
    tok = torch.stack(tokens, dim=1)
    finished_before = torch.cumsum(torch.isin(tok, stop).long(), dim=1) - torch.isin(tok, stop).long()
    lengths = (finished_before == 0).sum(1)
    return tok, torch.stack(logps, dim=1), lengths


def decode_rows(tokenizer: PreTrainedTokenizerBase, tokens: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Decode each row's first ``lengths[i]`` tokens, dropping special tokens."""
    return [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
        for row, n in zip(tokens, lengths.tolist())
    ]

