"""How few tokens a text can become, known without tokenizing it.

A prompt far past the model's context would be refused after tokenizing, which costs about
half a second of CPU per MB: a flood of them took the cores the ranks' steps needed, and
every running stream slowed (issue 36). When the tokenizer makes it safe, the prompt's
UTF-8 length bounds its token count from below: ``ceil(bytes / most_bytes_per_token)``.

Safe means that every byte of the text becomes one symbol and one token stands for at most
``most_bytes_per_token`` of them: a byte-level BPE (GPT-2, Llama 3, Qwen2: the ``ByteLevel``
pre-tokenizer maps each byte to one character of the vocabulary's alphabet), no normalizer
(one could shrink the text), no pre-tokenizer that drops what it splits on, no fused
unknowns. The longest vocabulary entry (characters = bytes) and the longest added token (its
UTF-8 bytes: a special token written in the text is one token) give the bound. Any other
tokenizer (SentencePiece's Metaspace, WordPiece, ...) gets ``None``: no bound, tokenized.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ORIGIN_KEY", "most_bytes_per_token", "prompt_bytes_limit"]

# The key of a servable's group.json ``origin`` that holds its tokenizer's bound (written
# at export, read by the scheduler for the servable's status).
ORIGIN_KEY = "most_bytes_per_token"

# Pre-tokenizers that keep every byte (when their behavior is not "removed").
_KEEPING = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})


def most_bytes_per_token(spec: dict[str, Any]) -> int | None:
    """The most UTF-8 bytes of text one token stands for, from tokenizer.json's content;
    None when the tokenizer does not make that a safe bound (see the module docstring)."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    if not _byte_level(spec.get("pre_tokenizer")):
        return None
    longest = max((len(entry) for entry in model.get("vocab") or {}), default=0)
    added = spec.get("added_tokens") or []
    special = max((len(str(t.get("content", "")).encode()) for t in added), default=0)
    return max(longest, special, 1)


def _byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    """A ByteLevel pre-tokenizer, alone or in a sequence of ones that keep every byte."""
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    if pre_tokenizer.get("type") != "Sequence":
        steps = [pre_tokenizer]
    keeps = all(
        step.get("type") in _KEEPING and str(step.get("behavior", "")).lower() != "removed"
        for step in steps
    )
    return keeps and any(step.get("type") == "ByteLevel" for step in steps)


def prompt_bytes_limit(context: int, per_token: int) -> int:
    """The most UTF-8 bytes a text may have and still possibly fit in ``context`` tokens:
    one byte more, and it has at least ``context`` tokens (``ceil(bytes / per_token)``)."""
    return (context - 1) * per_token
