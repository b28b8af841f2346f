"""Tokenizer, chat template and incremental detokenization for a model directory."""

from __future__ import annotations

import json
import pathlib
from typing import Any


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


class Tokenizer:
    """A model directory's tokenizer (HF fast tokenizer) plus its chat template.

    Thread-safety: encoding and decoding are safe from several threads.
    """

    def __init__(self, model_dir: str | pathlib.Path) -> None:
        model_dir = pathlib.Path(model_dir)
        self._tok = _tokenizer_class(model_dir).from_pretrained(str(model_dir))
        self.vocab_size = len(self._tok)
        self.eos_token_ids = _eos_ids(model_dir, self._tok.eos_token_id)
        self.bos_token_id = self._tok.bos_token_id
        self.all_special_ids = frozenset(self._tok.all_special_ids)
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        # the template renders a request's tools itself (else xllm.gateway.openai.tools describes them)
        self.template_renders_tools = "tools" in str(getattr(self._tok, "chat_template", None) or "")
        # decoding straight through the Rust tokenizer when transformers would add nothing to it (no
        # clean-up of spaces): a quarter of the cost per call, and the engine decodes two small windows
        # per generated token (xllm.core.detokenizer)
        self._raw_decode = _raw_decoder(self._tok)
        # a model that takes images (xllm.gateway.media): its directory (the image processor's) and image token
        self.image_dir, self.image_token_id = _image_inputs(model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Printable text of each token on its own (for logprob entries)."""
        return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """Render ``messages`` with the model's template and tokenize (no extra BOS)."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            text = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors (e.g. a role the template rejects)
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        return self.encode(text, add_special_tokens=False)


def _tokenizer_class(model_dir: pathlib.Path) -> Any:
    """The tokenizer class ``AutoTokenizer`` would pick for a directory with a ``tokenizer.json``
    (the ``tokenizer_class`` its ``tokenizer_config.json`` names), imported without
    ``AutoTokenizer``, whose import chain loads torch: a cluster gateway tokenizes without it.
    Anything else goes through ``AutoTokenizer``."""
    import transformers

    config = model_dir / "tokenizer_config.json"
    if (model_dir / "tokenizer.json").is_file() and config.is_file():
        name = json.loads(config.read_text()).get("tokenizer_class")
        if isinstance(name, str):
            for candidate in (name, name.removesuffix("Fast")):
                cls = getattr(transformers, candidate, None)
                if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
                    return cls
    return transformers.AutoTokenizer


def _raw_decoder(tok: Any) -> Any:
    """The Rust tokenizer's ``decode`` when it gives what ``tok.decode`` gives (a fast tokenizer that
    does not clean up tokenization spaces), else None."""
    import transformers

    if isinstance(tok, transformers.PreTrainedTokenizerFast) and not tok.clean_up_tokenization_spaces:
        return tok.backend_tokenizer.decode
    return None


def _eos_ids(model_dir: pathlib.Path, tok_eos: int | None) -> frozenset[int]:
    ids: set[int] = set() if tok_eos is None else {int(tok_eos)}
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def _image_inputs(model_dir: pathlib.Path) -> tuple[str | None, int | None]:
    """``(model_dir, image token id)`` when the directory is a model that takes images (an image processor's
    ``preprocessor_config.json`` and a ``config.json`` with a ``vision_config`` and ``image_token_id``, or LLaVA's
    ``image_token_index``), else ``(None, None)``."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not (model_dir / "preprocessor_config.json").is_file() or not cfg.get("vision_config") or \
            not isinstance(token, int):
        return None, None
    return str(model_dir), token
