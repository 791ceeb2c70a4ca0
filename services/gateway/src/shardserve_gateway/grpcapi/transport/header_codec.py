"""HPACK (RFC 7541) for a gRPC server: a decoder that follows the client's dynamic table,
and an encoder that needs none.

Why not ``hpack``'s classes: decoding a gRPC client's header block cost 27-38 us a call
with them (a Python object per field, its table's generic bookkeeping), the largest single
part of the pure-Python HTTP/2 front's CPU per call (docs/performance.md, issue 38). A
gRPC call's block is a few indexed fields and short literals; this decoder walks it with
integer arithmetic on ``bytes``. The static table and the Huffman code are hpack's (the
well-kept tables, not a copy). The encoder writes literals without indexing: stateless,
so a constant header list is encoded once and reused (and the peer's table size never
matters).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

Header = tuple[bytes, bytes]
STATIC: tuple[Header, ...] = tuple(HeaderTable.STATIC_TABLE)
ENTRY_OVERHEAD = 32  # RFC 7541 4.1: an entry's size is its name, its value and 32
DEFAULT_TABLE_BYTES = 4096  # SETTINGS_HEADER_TABLE_SIZE's default, which we keep
_MAX_INTEGER_SHIFT = 28  # an integer past 2**35 is no header length or index


class HeaderBlockError(ValueError):
    """The block is not valid HPACK: a COMPRESSION_ERROR for the whole connection."""


class HeaderDecoder:
    """Decodes one connection's header blocks, in order, keeping its dynamic table."""

    def __init__(self, table_bytes: int = DEFAULT_TABLE_BYTES) -> None:
        self._max_table = table_bytes  # what we allow (our SETTINGS)
        self._table_limit = table_bytes  # what the encoder chose, at most _max_table
        self._table: collections.deque[Header] = collections.deque()
        self._table_size = 0

    def decode(self, block: bytes) -> tuple[list[Header], int]:
        """The fields of ``block`` and the header list's size (RFC 7540 6.5.2).

        Every instruction is applied, so the table stays in step with the client's
        even when the caller then refuses the request as too large."""
        headers: list[Header] = []
        list_size = 0
        pos, end = 0, len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                header = self._field(index)
            elif first & 0x40:  # literal, added to the table
                header, pos = self._literal(block, pos, 6)
                self._add(header)
            elif first & 0x20:  # table size update
                if headers:
                    raise HeaderBlockError("a table size update after the first field")
                size, pos = _integer(block, pos, 5)
                self._resize(size)
                continue
            else:  # literal without indexing (0000) or never indexed (0001)
                header, pos = self._literal(block, pos, 4)
            headers.append(header)
            list_size += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        return headers, list_size

    def _field(self, index: int) -> Header:
        if 0 < index <= len(STATIC):
            return STATIC[index - 1]
        dynamic = index - len(STATIC) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HeaderBlockError(f"header index {index} is not in the table")
        return self._table[dynamic]

    def _literal(self, block: bytes, pos: int, prefix: int) -> tuple[Header, int]:
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._field(index)[0]
        else:
            name, pos = _string(block, pos)
        value, pos = _string(block, pos)
        return (name, value), pos

    def _add(self, header: Header) -> None:
        size = len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        self._table.appendleft(header)
        self._table_size += size
        self._evict()

    def _resize(self, size: int) -> None:
        if size > self._max_table:
            raise HeaderBlockError(f"table size {size} exceeds the allowed {self._max_table}")
        self._table_limit = size
        self._evict()

    def _evict(self) -> None:
        while self._table_size > self._table_limit:
            name, value = self._table.pop()
            self._table_size -= len(name) + len(value) + ENTRY_OVERHEAD


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer with a ``prefix``-bit prefix at ``block[pos]`` and the position after."""
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise HeaderBlockError("the block ends inside an integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > _MAX_INTEGER_SHIFT:
            raise HeaderBlockError("an integer too large for a header block")


def _string(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        raise HeaderBlockError("the block ends before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HeaderBlockError("a string runs past the end of the block")
    text = block[pos:end]
    if huffman:
        try:
            text = decode_huffman(text)
        except Exception as exc:  # hpack's HPACKDecodingError
            raise HeaderBlockError(f"bad Huffman string: {exc}") from None
    return text, end


def encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """A block of literals without indexing (names and values as they are, no Huffman)."""
    block = bytearray()
    for name, value in headers:
        block.append(0)
        for text in (name.encode("latin-1"), value.encode("latin-1")):
            block += _encode_integer(len(text), 7)
            block += text
    return bytes(block)


def _encode_integer(value: int, prefix: int) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((value,))
    out = bytearray((mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
