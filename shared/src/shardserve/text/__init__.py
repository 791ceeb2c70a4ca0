"""Text for generation: tokenizing, chat templates, incremental detokenizing, stop strings.

* ``tokenizer.TextModel``: a servable version's tokenizer folder -> encode / encode_chat /
  decode / eos ids / token texts / check_ids (the scheduler loads one per version);
* ``chat.ChatTemplate``: the chat template rendered with jinja2 as transformers does;
* ``folder.TokenizerFolder``: what tokenizer_config.json and its neighbours say;
* ``detokenize.IncrementalDetokenizer``: one per sequence, ids in, text deltas out;
* ``stops.StopStrings``: one per sequence, deltas in, text safe to send out.

Pure: no I/O besides reading the tokenizer folder, no asyncio.
"""

from shardserve.text.chat import ChatTemplate
from shardserve.text.detokenize import IncrementalDetokenizer
from shardserve.text.stops import StopPiece, StopStrings, stop_token_ids
from shardserve.text.tokenizer import TextModel

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "StopPiece",
    "StopStrings",
    "TextModel",
    "stop_token_ids",
]
