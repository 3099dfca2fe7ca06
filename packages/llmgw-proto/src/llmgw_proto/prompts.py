"""A served model's prompts as its engine tokenizes them (vLLM's OpenAI server).

A Hugging Face tokenizer folder (``tokenizer.json``, and ``tokenizer_config.json`` with
its chat template and special tokens, or a ``chat_template.jinja``) loaded once, and:

- chat: the template rendered by Jinja2 as transformers renders it (``trim_blocks``,
  ``lstrip_blocks``, ``raise_exception``, ``tojson``, the tokenizer's special tokens,
  ``add_generation_prompt=True``), then encoded without adding special tokens (the
  template writes them). A message whose content is a list of text parts is those texts
  joined by newlines, as vLLM does for a template that takes strings; any other part
  (an image) makes the prompt unknown here;
- completion: a string prompt encoded with the tokenizer's special tokens (its BOS), a
  list of token ids as given.

Anything it cannot render (a template error, a field it does not know) gives None.

Shared by llmgw-router (precise prefix matching, which adds a token cache on top) and
llmgw-sim (``--tokenizer``). Needs the ``precise`` extra (``tokenizers`` and ``jinja2``),
imported only when a folder is loaded: this module imports without them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PromptEncoder", "TokenizerError", "token_list"]


class TokenizerError(Exception):
    """A tokenizer folder that cannot be used: names what is missing or wrong."""


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def token_list(prompt: object) -> list[int] | None:
    """``prompt`` when it is a list of token ids (unsigned 32-bit); else None."""
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt
    ):
        return prompt
    return None


class PromptEncoder:
    """One model's tokenizer and chat template, loaded once, without any cache.

    ``tokenizer`` is the ``tokenizers.Tokenizer``, ``template`` the chat template's source
    (None: the folder has none), ``special`` the named special tokens the template sees."""

    def __init__(self, folder: Path) -> None:
        try:
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ImportError as err:
            raise TokenizerError(
                f"a model's tokenizer needs the tokenizers and jinja2 packages ({err.name} is "
                "missing): pip install 'llmgw-proto[precise]' (llmgw-router[precise] has them)"
            ) from None
        # One request's texts are a few small ones: spreading them over the tokenizers
        # thread pool costs more CPU than it saves. (Read at each encoding; a value the
        # operator set stays.)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}")
        try:
            self.tokenizer: Any = Tokenizer.from_file(str(path))
        except Exception as err:
            raise TokenizerError(f"{path} is not a tokenizers file: {err}") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text())
            except (OSError, ValueError) as err:
                raise TokenizerError(f"{config_path} is not JSON: {err}") from None
            if isinstance(loaded, dict):
                config = loaded
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        self.template: str | None = template if isinstance(template, str) else None
        self.special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self._render: Callable[..., str] | None = None
        if self.template is not None:

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = raise_exception
            try:
                self._render = env.from_string(self.template).render
            except jinja2.exceptions.TemplateError as err:
                raise TokenizerError(
                    f"the chat template in {folder} does not compile: {err}"
                ) from None
        self._template_error: type[Exception] = jinja2.exceptions.TemplateError

    @property
    def has_chat_template(self) -> bool:
        return self._render is not None

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each of ``texts`` encoded alone."""
        # The batch encoder without offsets: a third of `encode`'s time (2,900 gemma-3
        # tokens: 1.7 against 4.9 ms here), the same ids.
        return [
            e.ids
            for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        ]

    def render(self, messages: object) -> str | None:
        """``messages`` rendered by the chat template as vLLM does; None when not known."""
        if self._render is None or not isinstance(messages, list):
            return None
        conversation = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        return None
                    texts.append(str(part.get("text", "")))
                message = {**message, "content": "\n".join(texts)}
            conversation.append(message)
        try:
            text = self._render(
                messages=conversation, add_generation_prompt=True, tools=None, **self.special
            )
        except (self._template_error, TypeError, ValueError):
            return None
        return text

    def chat(self, messages: object) -> list[int] | None:
        """The token ids vLLM's chat endpoint gives ``messages``; None when not known."""
        text = self.render(messages)
        if text is None:
            return None
        return self.encode_batch([text], False)[0]

    def completion(self, prompt: object) -> list[int] | None:
        """The token ids vLLM's completion endpoint gives ``prompt``; None when not known."""
        if isinstance(prompt, str):
            return self.encode_batch([prompt], True)[0]
        return token_list(prompt)
