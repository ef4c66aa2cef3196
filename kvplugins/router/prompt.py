"""A request's prompt tokens as the engine will see them, so the router's block ids match the engine's blocks
(and the blocks its KV events name: blocks.py). Source followed: vLLM 0.32's OpenAI serving (completions:
the prompt text tokenized with the tokenizer's special tokens unless ``add_special_tokens`` is false; token-id
prompts as given; chat: the model's chat template applied with the generation prompt, its text tokenized
without special tokens); SGLang does the same.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("kvplugins.router")


class EngineTokens:
    """``tokens(body)``: the prompt's token ids (list[int]) of an OpenAI request body, with ``tokenizer`` (a
    Hugging Face tokenizer: the engines')."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase"):
        self.tok = tokenizer
        self._no_template = False

    def __call__(self, body: dict[str, object]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        messages = body.get("messages")
        if prompt is None and isinstance(messages, list):
            return self.chat([m for m in messages if isinstance(m, dict)])
        if isinstance(prompt, list):  # a batch of prompts: the first one's blocks decide
            prompt = prompt[0] if prompt else ""
        special = body.get("add_special_tokens", True) is not False
        return list(self.tok(str(prompt or ""), add_special_tokens=special)["input_ids"])

    def chat(self, messages: list[dict[str, object]]) -> list[int]:
        if not self._no_template:
            try:
                chat = cast("list[dict[str, str]]", messages)  # as the engine passes them: contents may be lists
                text = self.tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                return list(self.tok(text, add_special_tokens=False)["input_ids"])
            except (ValueError, TypeError, KeyError) as e:  # no chat template: the engine refuses chats too
                self._no_template = True
                log.warning("router: the tokenizer has no usable chat template (%s); chats hashed as plain text", e)
        text = "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
