"""A GGUF file's tokenizer metadata rebuilt as ``tokenizer.json`` (the ``tokenizers``
package's format) plus ``tokenizer_config.json`` and ``generation_config.json``, so the
served model reads it like a Hugging Face checkpoint's.

Two kinds, as llama.cpp names them in ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE. Tokens and merges are stored spelled in GPT-2's byte alphabet;
  the text split before BPE depends on the model family (``tokenizer.ggml.pre``).
* ``llama``: SentencePiece BPE with byte fallback (``<0x41>`` tokens), a ``▁`` for spaces
  and a prefix space. Files rarely carry merges; they are recovered from the token scores
  (each token made of two tokens is a merge, better scores merge first), the same order
  transformers' GGUF loader derives.

Control tokens (type 3) stay whole as special tokens, user-defined ones (type 4) whole but
not special; BOS (and EOS) are added by the post-processor when the file says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shardserve.errors import ExportError
from shardserve.repo.repository import sha256_file
from shardserve.tools.export.gguf.file import GgufFile

__all__ = ["build_tokenizer", "write_tokenizer"]

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"

# How each byte-level model family splits text before BPE (tokenizer.ggml.pre -> regex).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: printable Latin-1 bytes stand for
    themselves, the rest take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling, extra = {b: chr(b) for b in keep}, 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


class _Vocabulary:
    def __init__(self, file: GgufFile) -> None:
        self.kind = file.need("tokenizer.ggml.model")
        self.tokens: list[str] = list(file.need("tokenizer.ggml.tokens"))
        self.types: list[int] = list(file.get("tokenizer.ggml.token_type") or [])
        self.scores: list[float] = list(file.get("tokenizer.ggml.scores") or [])
        self.merges: list[str] | None = file.get("tokenizer.ggml.merges")
        self.pre = file.get("tokenizer.ggml.pre", "default")
        self.add_bos = bool(file.get("tokenizer.ggml.add_bos_token", self.kind == "llama"))
        self.add_eos = bool(file.get("tokenizer.ggml.add_eos_token", False))
        self.prefix_space = bool(file.get("tokenizer.ggml.add_space_prefix", True))
        self.special = {
            name: self._token(file.get(f"tokenizer.ggml.{key}"))
            for name, key in (
                ("bos_token", "bos_token_id"),
                ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"),
            )
        }

    def _token(self, index: int | None) -> str | None:
        if index is None:
            return None
        if not 0 <= index < len(self.tokens):
            raise ExportError(f"GGUF tokenizer: special token id {index} is outside the vocabulary")
        return self.tokens[index]


def build_tokenizer(file: GgufFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and the tokenizer_config.json entries the file describes."""
    vocab = _Vocabulary(file)
    if vocab.kind == "gpt2":
        tokenizer = _byte_level(vocab)
    elif vocab.kind == "llama":
        tokenizer = _sentencepiece(vocab)
    else:
        raise ExportError(
            f"GGUF tokenizer {vocab.kind!r} is not supported; supported: gpt2 (byte-level "
            "BPE), llama (SentencePiece BPE)"
        )
    _add_whole_tokens(tokenizer, vocab)
    _add_post_processor(tokenizer, vocab)
    config: dict[str, Any] = {
        **{name: token for name, token in vocab.special.items() if token is not None},
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = file.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tokenizer, config


def _byte_level(vocab: _Vocabulary) -> Tokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    ids = {spelled(token): index for index, token in enumerate(vocab.tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=_file_merges(vocab.merges or [])))
    split = SPLITS.get(vocab.pre)
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif vocab.pre == "smollm":  # SmolLM's own tokenizer: digits one by one, then GPT-2's split
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(vocab: _Vocabulary) -> Tokenizer:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    if vocab.merges is not None:
        merges = _file_merges(vocab.merges)
    else:
        merges = merges_from_scores(vocab.tokens, vocab.scores)
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=True, byte_fallback=True))
    prepend = "first" if vocab.prefix_space else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme=prepend, split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _file_merges(lines: list[str]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges: "left right" per merge."""
    merges = []
    for line in lines:
        left, space, right = line.partition(" ")
        if not space:
            raise ExportError(f"GGUF tokenizer: merge {line!r} is not two tokens")
        merges.append((left, right))
    return merges


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; the merged token's score ranks it
    (higher first, then longer left and right parts), ties kept in vocabulary order."""
    if len(scores) != len(tokens):
        raise ExportError("GGUF tokenizer: SentencePiece vocabulary without merges or scores")
    ids = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ids and token[cut:] in ids
        ]
        pairs.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((left, right, score) for left, right in pairs)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_whole_tokens(tokenizer: Tokenizer, vocab: _Vocabulary) -> None:
    """Control tokens and the named special tokens as special, user-defined ones as plain
    added tokens: matched whole in text, never cut by BPE."""
    alphabet = set(_byte_alphabet().values()) if vocab.kind == "gpt2" else None
    named = {token for token in vocab.special.values() if token is not None}
    special, plain = [], []
    for index, token in enumerate(vocab.tokens):
        kind = vocab.types[index] if index < len(vocab.types) else 1
        if kind == CONTROL or token in named:
            if alphabet is None or set(token) <= alphabet:
                special.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _add_post_processor(tokenizer: Tokenizer, vocab: _Vocabulary) -> None:
    bos, eos = vocab.special["bos_token"], vocab.special["eos_token"]
    start = f"{bos}:0 " if vocab.add_bos and bos is not None else ""
    end = f" {eos}:0" if vocab.add_eos and eos is not None else ""
    if not start and not end:
        return
    used = [t for t, on in ((bos, bool(start)), (eos, bool(end))) if on and t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{start}$A:0{end}",
        pair=f"{start}$A:0{end} {start.replace(':0', ':1')}$B:1{end.replace(':0', ':1')}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(used)],
    )


def write_tokenizer(file: GgufFile, target: Path) -> dict[str, str]:
    """Write the tokenizer folder; return ``tokenizer/<file>`` -> sha256."""
    tokenizer, config = build_tokenizer(file)
    target.mkdir(exist_ok=True)
    tokenizer.save(str(target / "tokenizer.json"))
    _write_json(target / "tokenizer_config.json", config)
    generation = {
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(file.eos_ids()),
        # GGUF files rarely carry sampling defaults: greedy unless a request asks to sample,
        # so the same question gets the same answer.
        "do_sample": False,
    }
    _write_json(target / "generation_config.json", generation)
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    return {f"{target.name}/{name}": sha256_file(target / name) for name in names}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
