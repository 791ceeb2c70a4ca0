"""A servable's text side: prompt and chat encoding, decoding, EOS ids, token texts.

Loaded from the ``tokenizer/`` folder of an exported version (see ``shardserve.text.folder``
for what each file contributes). Ids are those of transformers: ``encode(prompt)`` equals
``tokenizer(prompt)["input_ids"]`` (special tokens added, e.g. Llama's BOS, by tokenizer.json's
post-processor), ``encode_chat(messages)`` equals ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)`` (the rendered text encoded WITHOUT adding special
tokens: the template writes them). ``decode`` skips special tokens by default, as the OpenAI
servers answer; it does not apply ``clean_up_tokenization_spaces`` (the fixtures and current
checkpoints set it false, and it would break streaming equality).

Usage (scheduler)::

    text = TextModel.load(version_folder / "tokenizer", servable="llama", model_vocab=512)
    ids = text.encode("Hello")                      # or text.encode_chat(messages)
    text.check_ids(ids)                             # BadInputError on an id outside the vocab
    detokenizer = text.detokenizer()                # one per sequence, see text.detokenize
    stop_ids = text.eos_token_ids                   # the model's EOS ids
    text.token_text(42)                             # one token's text
    text.with_texts(logprob)                        # the agent's TokenLogprob, texts filled

Errors (all BadInputError, HTTP 400): chat on a servable without chat template ("servable X
has no chat template"), a template that raises, ids outside the vocabulary. A folder without
tokenizer.json raises RepositoryError.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from shardserve.errors import BadInputError, RepositoryError
from shardserve.text.chat import ChatTemplate, Message
from shardserve.text.detokenize import IncrementalDetokenizer
from shardserve.text.folder import TOKENIZER_FILE, TokenizerFolder
from shardserve.text.token_bound import most_bytes_per_token, prompt_bytes_limit
from shardserve.wire.protocol import TokenLogprob

__all__ = ["TextModel"]


class TextModel:
    """Tokenizer, chat template and EOS ids of one servable version.

    Args:
        tokenizer: the checkpoint's tokenizer.json, loaded with the ``tokenizers`` package.
        folder: the side files (special tokens, chat template, generation config).
        servable: the name used in error messages.
        model_vocab: the model's vocabulary size (its embedding rows); ids must be below it.
            Defaults to the tokenizer's size (with added tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        folder: TokenizerFolder,
        servable: str,
        model_vocab: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.servable = servable
        self.special_tokens = folder.special_tokens
        self.eos_token_ids: tuple[int, ...] = folder.eos_token_ids(tokenizer.token_to_id)
        self.sampling_defaults = folder.sampling_defaults
        tokenizer_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size: int = tokenizer_vocab if model_vocab is None else model_vocab
        self._chat_source = folder.chat_template

    @classmethod
    def load(
        cls, path: Path, servable: str = "servable", model_vocab: int | None = None
    ) -> TextModel:
        """Load a tokenizer folder (``<version>/tokenizer`` or a Hugging Face checkpoint)."""
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise RepositoryError(f"{servable}: no {TOKENIZER_FILE} in {path}")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # the Rust side raises plain Exception subclasses
            raise RepositoryError(f"{servable}: {file} does not load: {error}") from error
        return cls(tokenizer, TokenizerFolder.read(path), servable, model_vocab)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_source is not None

    @cached_property
    def _chat(self) -> ChatTemplate:
        if self._chat_source is None:
            raise BadInputError(f"servable {self.servable} has no chat template")
        return ChatTemplate(self._chat_source, self.special_tokens, f"servable {self.servable}")

    def encode(self, prompt: str, context: int | None = None) -> list[int]:
        """Prompt ids as transformers' ``tokenizer(prompt)`` gives them. With ``context``,
        a prompt that surely has at least that many tokens is refused without tokenizing
        (BadInputError; see ``token_bound``)."""
        self._check_can_fit(prompt, context)
        return self._encode(prompt, add_special_tokens=True)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (dicts with ``role`` and ``content``)."""
        return self._chat.render(messages, add_generation_prompt)

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        context: int | None = None,
    ) -> list[int]:
        """Prompt ids of a chat: the rendered template encoded without adding special tokens
        (``context`` as for ``encode``)."""
        rendered = self.render_chat(messages, add_generation_prompt)
        self._check_can_fit(rendered, context)
        return self._encode(rendered, add_special_tokens=False)

    @cached_property
    def _most_bytes_per_token(self) -> int | None:
        return most_bytes_per_token(json.loads(self._tokenizer.to_str()))

    def _check_can_fit(self, text: str, context: int | None) -> None:
        """BadInputError when ``text`` has at least ``context`` tokens by the byte bound."""
        per_token = self._most_bytes_per_token
        if context is None or per_token is None:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > prompt_bytes_limit(context, per_token):
            fewest = -(-size // per_token)
            raise BadInputError(
                f"the prompt has at least {fewest} tokens ({size} bytes, at most {per_token} "
                f"a token); the model's context is {context} tokens, which leaves no room to "
                "generate"
            )

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: the same ids, but it releases the GIL while the Rust
        # side works (encode holds it: a 1 MB prompt stalled every other thread, and so
        # the event loop that calls this from a worker thread, for 0.7 s; measured).
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise BadInputError unless every id is in ``[0, vocab_size)``."""
        for position, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise BadInputError(
                    f"prompt token {position} of servable {self.servable} is {token}, "
                    f"outside the vocabulary [0, {self.vocab_size})"
                )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes of an unfinished character decode to U+FFFD."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included ("" for an id the tokenizer lacks).
        A token that is part of a character (a byte token: its text alone is U+FFFD) is named
        by its vocabulary entry ("<0xE2>", "âĢ"), so logprobs' alternatives stay distinct."""
        text = self.decode([token], skip_special_tokens=False)
        if "\ufffd" in text:
            return str(self._tokenizer.id_to_token(token) or text)
        return text

    def with_texts(self, logprob: TokenLogprob) -> TokenLogprob:
        """The agent's TokenLogprob (texts "") with each token's text filled in."""
        top = tuple(t.model_copy(update={"text": self.token_text(t.token_id)}) for t in logprob.top)
        return logprob.model_copy(update={"text": self.token_text(logprob.token_id), "top": top})

    def token_id(self, text: str) -> int | None:
        """The id of a token's text (e.g. a special token), None when it is not one token."""
        found = self._tokenizer.token_to_id(text)
        return None if found is None else int(found)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one sequence's generated ids."""
        return IncrementalDetokenizer(self.decode)
