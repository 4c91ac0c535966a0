"""A tiny local chat tokenizer for tests: one token per printable ASCII character plus Qwen-style specials.

No hub access: the vocabulary is built here, the chat template is a short Jinja string in the style of
Qwen's (``<|im_start|>role\\n...<|im_end|>\\n``, tools listed in a system block, ``<tool_call>`` tags).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


THINK_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if m.content %}{{ m.content }}{% endif %}",
    # Qwen3's rule: an earlier assistant turn is re-rendered without its <think>...</think> block
    "{% if m.content %}{% if m.role == 'assistant' and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}{% else %}{{ m.content }}{% endif %}{% endif %}",
)
"""A thinking template: earlier assistant messages lose their ``<think>`` block when re-rendered."""


def char_chat_tokenizer(
    chat_template: str = CHAT_TEMPLATE, merges: tuple[tuple[str, str], ...] = ()
) -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer (vocab < 110) with eos ``<|im_end|>``, pad ``<pad>`` and a chat template.

    ``merges`` adds BPE merges (e.g. ``((" ", "2"),)`` makes ``" 2"`` one token), so a text has a canonical
    tokenisation that a model may not have sampled (sampled ``" "``, ``"2"`` vs templated ``" 2"``)."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    vocab["<unk>"] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    # BPE without merges splits every word into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.add_tokens(TAGS)
    tok.chat_template = chat_template
    return tok


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (GPT-2's byte alphabet): every UTF-8 byte is one token, so a multi-byte
    character spans several tokens and any single token may decode to an incomplete character."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok
