"""A tiny local chat tokenizer for tests: one token per printable ASCII character plus Qwen-style specials.

No hub access: the vocabulary is built here, the chat template is a short Jinja string in the style of
Qwen's (``<|im_start|>role\\n...<|im_end|>\\n``, tools listed in a system block, ``<tool_call>`` tags).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
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


def char_chat_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer (vocab < 110) with eos ``<|im_end|>``, pad ``<pad>`` and a chat template."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    vocab["<unk>"] = len(vocab)
    # BPE without merges splits every word into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.add_tokens(TAGS)
    tok.chat_template = CHAT_TEMPLATE
    return tok
