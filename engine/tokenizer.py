"""A Hugging Face model directory's tokenizer without `transformers`: `tokenizer.json` through the
`tokenizers` library, special tokens and the chat template from `tokenizer_config.json`, the
template rendered with jinja2 the way `apply_chat_template` does (sandboxed, `raise_exception`,
`add_generation_prompt`, `bos_token` / `eos_token`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders


class TokenizerError(ValueError):
    """A missing or unusable tokenizer, or a chat the template refuses."""


def _token_text(value: Any) -> str | None:
    """`tokenizer_config.json` writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        try:
            self._tok = HfTokenizer.from_file(str(tok_file))
        except Exception as exc:  # noqa: BLE001 - the library's errors carry no common type
            raise TokenizerError(f"cannot load {tok_file}: {exc}") from None
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template: str | None = cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) \
            else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template: Any = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (how logprobs name tokens)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: exact for byte-level BPE vocabularies (GPT-2, Llama 3,
        Qwen), also for a token holding part of a character; else its text's UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and isinstance(self._tok.decoder, decoders.ByteLevel) \
                and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return self.token_text(token_id).encode()

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The chat rendered to one prompt string (encode it with `add_special_tokens=False`:
        templates write their own BOS)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json: chat_template)")
        for m in messages:
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise TokenizerError("each message needs a string role and string content")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise TokenizerError(f"the chat template refused the conversation: {exc}") from None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_level_alphabet()


class IncrementalDetokenizer:
    """Text of a growing token list, emitted in pieces that never split a character: the
    decoded text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, token_ids: Sequence[int]) -> str:
        """The new text since the last call (possibly empty)."""
        full = self.tokenizer.decode(token_ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta


__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]
