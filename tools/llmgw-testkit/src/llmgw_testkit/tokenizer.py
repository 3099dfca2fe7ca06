"""A small word-level tokenizer folder in the Hugging Face layout, for precise matching.

The simulator (``--tokenizer``) and llmgw-router (``cache_aware.tokenizers``) both load it:
``tokenizer.json`` (one token per whitespace-separated word of ``words``, anything else
``<unk>``) and ``tokenizer_config.json`` with a chat template. It stands in for a real
model's files where no real engine runs; the real-vLLM suite uses gemma-3's own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "TURN_TEMPLATE",
    "TURN_WORDS",
    "turn_ids",
    "write_turn_tokenizer",
    "write_word_tokenizer",
]

SPECIALS = ["<s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_word_tokenizer(folder: Path, words: Iterable[str]) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab: dict[str, int] = {}
    for word in [*SPECIALS, *words]:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))  # noqa: S106 (a token, no secret)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The markers are special (added) tokens, as a real model's turn markers are: the ids
    # stay, and the router's token cache can cut a rendered chat at them.
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# A fixed vocabulary whose ids tests can spell out (:func:`turn_ids`), with a template that
# writes its own BOS and wraps each turn in ``<turn> ROLE ... <end>``.
TURN_WORDS = ["<bos>", "<unk>", "<turn>", "<end>", "user", "model", "hello", "there", "a", "b", "c"]
TURN_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}<turn> {{ m['role'] }} {{ m['content'] }} <end> "
    "{% endfor %}{% if add_generation_prompt %}<turn> model {% endif %}"
)


def write_turn_tokenizer(folder: Path, template: str | None = TURN_TEMPLATE) -> Path:
    """A word-level tokenizer folder over :data:`TURN_WORDS` (anything else ``<unk>``) with
    a BOS post-processor, and ``template`` as its chat template (None: it has none)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(TURN_WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))  # noqa: S106 (a token, no secret)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 0)]
    )
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<bos>", "eos_token": {"content": "<end>"}}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def turn_ids(text: str) -> list[int]:
    """The ids of ``text``'s words in :data:`TURN_WORDS`."""
    return [TURN_WORDS.index(w) for w in text.split()]
