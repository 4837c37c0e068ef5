"""The journal file: a header, then append-only records, each with its length and a checksum.

Layout (little-endian)::

    file    = magic "LBMJRNL\\n" | u32 header length | header (JSON, UTF-8) | u32 crc32(header) | record*
    record  = "JR" | u8 kind | u8 flags | u32 meta length | u32 payload length | u32 crc32 | meta | payload

The record's crc32 covers kind, flags, both lengths, meta and payload. ``meta`` is a JSON
object; ``payload`` holds the record's arrays back to back (``meta["arrays"]`` lists each
as ``[name, dtype, shape, offset, nbytes]``), zlib-compressed when ``flags & 1``, an LZ4
frame when ``flags & 2`` (``COMPRESSIONS``: what a writer may choose; LZ4 needs the ``lz4``
module to write and to read).

Reading stops at the first record that is incomplete (a torn last write: a crash while it
was appended; ignored, not an error) or whose checksum or framing is wrong (a corrupt
record: everything before it is used and the reason names it). Nothing here writes; the
writer (``writer.py``) appends and rewrites files built from ``encode_record``.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

FORMAT_VERSION = 1
MAGIC = b"LBMJRNL\n"
_REC = struct.Struct("<2sBBIII")  # tag, kind, flags, meta length, payload length, crc32
_TAG = b"JR"
_COMPRESSED = 1  # zlib
_LZ4 = 2
# a writer's choices: raw arrays (the least CPU), an LZ4 frame (fast: about a millisecond for a
# 518x378 frame, which it shrinks by about a third on camera images), zlib level 1 (about ten
# times the CPU, shrinks such a frame by half); a bare int is a zlib level (0 = raw)
COMPRESSIONS = ("lz4", "zlib", "none")
MAX_META = 1 << 24  # a meta longer than this is corruption, not data
MAX_PAYLOAD = 1 << 31

# record kinds (a byte on disk; the names are what code and logs use)
KINDS = {"frame": 1, "seen": 2, "restart": 3, "rollback": 4, "commit": 5, "deferred": 6, "state": 7, "begin": 8,
         # the map journal (``runtime.map_journal``, its own file): a frame's map chunk, an operation on
         # the map or the path, a path entry, the whole map and path at a compaction
         "chunk": 9, "mapop": 10, "pose": 11, "snapshot": 12,
         # the loop-closure journal (``runtime.loop_journal``, its own file): a keyframe of the place
         # database, a verified loop, a pose prior, a rollback, the map frame, a relocalisation
         "lkf": 13, "loop": 14, "prior": 15, "lforget": 16, "lframe": 17, "lreloc": 18}
_NAMES = {v: k for k, v in KINDS.items()}


class JournalError(Exception):
    """A journal that cannot be used at all (missing, not a journal, an unknown format)."""


@dataclass
class Record:
    """One journal record: its kind, JSON meta and named arrays (numpy, host)."""

    kind: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (the meta is small)."""
        return sum(a.nbytes for a in self.arrays.values())


def encode_header(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(body)) + body + struct.pack("<I", zlib.crc32(body))


def _lz4():
    try:
        import lz4.frame
    except ImportError:
        return None
    return lz4.frame


def lz4_available() -> bool:
    return _lz4() is not None


def check_compression(compression: str | int) -> str | int:
    """``compression`` if it is one of ``COMPRESSIONS`` or a zlib level 0..9, else ValueError;
    "lz4" without the ``lz4`` module is refused with the way to install it."""
    if isinstance(compression, bool) or not (compression in COMPRESSIONS or
                                             (isinstance(compression, int) and 0 <= compression <= 9)):
        raise ValueError(f"journal compression {compression!r}: use one of {', '.join(COMPRESSIONS)}")
    if compression == "lz4" and not lz4_available():
        raise ValueError("journal compression 'lz4' needs the lz4 module (pip install lz4, or the "
                         "python3-lz4 package)")
    return compression


def encode_record(record: Record, compression: str | int = 0) -> bytes:
    """The bytes of one record (``encode_record_parts`` joined)."""
    return b"".join(encode_record_parts(record, compression))


def encode_record_parts(record: Record, compression: str | int = 0) -> list:
    """One record as the buffers to write in order: framing, meta, then the arrays' bytes.
    Arrays are stored raw (lossless), or compressed (``compression``: see ``COMPRESSIONS``)
    when that makes them smaller. Raw arrays are not copied (memoryviews of them: the file
    write is the one copy, and it runs without the interpreter lock, as zlib, LZ4 and crc32
    do), so a writer thread holds the lock as little as it can."""
    if record.kind not in KINDS:
        raise ValueError(f"unknown journal record kind {record.kind!r}")
    specs, parts, at = [], [], 0
    for name, a in record.arrays.items():
        a = np.ascontiguousarray(a)
        specs.append([name, a.dtype.str, list(a.shape), at, a.nbytes])
        if a.nbytes:
            parts.append(memoryview(a).cast("B"))
        at += a.nbytes
    flags = 0
    level = 1 if compression == "zlib" else (compression if isinstance(compression, int) else 0)
    if at and level > 0:
        z = zlib.compressobj(level)
        packed = [z.compress(part) for part in parts]
        packed.append(z.flush())
        if sum(len(x) for x in packed) < at:
            parts, flags = packed, _COMPRESSED
    elif at and compression == "lz4":
        frame = _lz4()
        if frame is None:
            raise ValueError("journal compression 'lz4' needs the lz4 module")
        c = frame.LZ4FrameCompressor(content_checksum=False)
        packed = [c.begin(at), *(c.compress(part) for part in parts), c.flush()]
        if sum(len(x) for x in packed) < at:
            parts, flags = packed, _LZ4
    size = sum(len(x) for x in parts) if flags else at
    meta = dict(record.meta)
    if specs:
        meta["arrays"] = specs
    body = json.dumps(meta, sort_keys=True).encode()
    head = _REC.pack(_TAG, KINDS[record.kind], flags, len(body), size, 0)
    crc = zlib.crc32(body, zlib.crc32(head[:12]))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return [_REC.pack(_TAG, KINDS[record.kind], flags, len(body), size, crc), body, *parts]


@dataclass
class Scan:
    """What ``scan`` found: the header, the offsets of the good records, where reading stopped
    and why (``stop`` is "" at a clean end, else the reason; ``corrupt`` tells a damaged
    record from a torn last write)."""

    path: Path
    header: dict[str, Any]
    offsets: list[int]
    kinds: list[str]
    good_bytes: int  # file offset after the last good record
    size: int
    stop: str = ""
    corrupt: bool = False
    file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file scanned: a rewrite replaces it


def read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    start = f.read(len(MAGIC) + 4)
    if len(start) < len(MAGIC) + 4 or start[:len(MAGIC)] != MAGIC:
        raise JournalError(f"{path} is not a journal (no journal header)")
    (n,) = struct.unpack("<I", start[len(MAGIC):])
    if n > MAX_META:
        raise JournalError(f"{path}: the journal header is damaged (length {n})")
    body = f.read(n)
    crc = f.read(4)
    if len(body) < n or len(crc) < 4 or struct.unpack("<I", crc)[0] != zlib.crc32(body):
        raise JournalError(f"{path}: the journal header is damaged (checksum)")
    header = json.loads(body)
    if header.get("format") != FORMAT_VERSION:
        raise JournalError(f"{path}: journal format {header.get('format')!r}, this version reads {FORMAT_VERSION}")
    return header, len(MAGIC) + 8 + n


def scan(path: str | Path) -> Scan:
    """Check every record's framing and checksum; raises JournalError when the file is not a
    readable journal at all (a bad record is not an error: ``Scan.stop`` says where and why)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise JournalError(f"cannot open the journal {path}: {exc.strerror or exc}") from None
    with f:
        size = f.seek(0, 2)
        f.seek(0)
        header, at = read_header(f, path)
        st = os.fstat(f.fileno())
        out = Scan(path, header, [], [], at, size, file_id=(st.st_dev, st.st_ino))
        while at < size:
            head = f.read(_REC.size)
            if len(head) < _REC.size:
                out.stop = f"torn last record at byte {at} (incomplete header; a write was interrupted)"
                break
            tag, kind, flags, nmeta, npay, crc = _REC.unpack(head)
            if tag != _TAG or kind not in _NAMES or nmeta > MAX_META or npay > MAX_PAYLOAD:
                out.stop, out.corrupt = f"corrupt record {len(out.offsets)} at byte {at} (bad framing)", True
                break
            end = at + _REC.size + nmeta + npay
            if end > size:
                out.stop = f"torn last record at byte {at} ({size - at} of {end - at} bytes; a write was interrupted)"
                break
            body = f.read(nmeta + npay)
            if zlib.crc32(body, zlib.crc32(head[:12])) != crc:
                out.stop = f"corrupt record {len(out.offsets)} ({_NAMES[kind]}) at byte {at} (checksum mismatch)"
                out.corrupt = True
                break
            out.offsets.append(at)
            out.kinds.append(_NAMES[kind])
            at = out.good_bytes = end
    return out


def read_record(f: BinaryIO, offset: int) -> Record:
    """The record at ``offset`` (one ``scan`` found good)."""
    f.seek(offset)
    tag, kind, flags, nmeta, npay, _ = _REC.unpack(f.read(_REC.size))
    meta = json.loads(f.read(nmeta))
    payload = f.read(npay)
    if flags & _COMPRESSED:
        payload = zlib.decompress(payload)
    elif flags & _LZ4:
        frame = _lz4()
        if frame is None:
            raise JournalError("the journal was written with LZ4 compression: install the lz4 module to read it "
                               "(pip install lz4, or the python3-lz4 package)")
        payload = frame.decompress(payload)
    payload = bytearray(payload)  # writable arrays (torch.from_numpy warns about read-only ones)
    arrays = {}
    for name, dtype, shape, at, nbytes in meta.pop("arrays", []):
        arrays[name] = np.frombuffer(payload, dtype=np.dtype(dtype), count=int(np.prod(shape, dtype=np.int64)),
                                     offset=at).reshape(shape)
    return Record(_NAMES[kind], meta, arrays)


def iter_records(found: Scan) -> Iterator[Record]:
    """The good records of a scanned journal, in order (read one at a time). Raises
    JournalError when the path names another file than the one scanned (an atomic rewrite, a
    compaction, replaced it in between: its offsets would point into other bytes)."""
    try:
        f = open(found.path, "rb")
    except OSError as exc:
        raise JournalError(f"cannot open the journal {found.path}: {exc.strerror or exc}") from None
    with f:
        st = os.fstat(f.fileno())
        if found.file_id != (0, 0) and (st.st_dev, st.st_ino) != found.file_id:
            raise JournalError(f"{found.path} was replaced after it was scanned (rewritten); scan it again")
        for offset in found.offsets:
            yield read_record(f, offset)


def read_contents(path: str | Path, contents: str, what: str, identity: dict[str, Any] | None = None
                  ) -> tuple[list[Record], Scan]:
    """(the good records, the scan) of the journal at ``path`` whose header says ``contents``
    (the map's, loop closure's); JournalError when it is another kind (``what``: the kind asked
    for, for the message), was written for another ``identity``, or cannot be read."""
    found = scan(path)
    if found.header.get("contents") != contents:
        raise JournalError(f"{path} is not {what}")
    if identity is not None and found.header.get("identity") != identity:
        raise JournalError(f"{path} was written for another model or configuration")
    return list(iter_records(found)), found


def write_journal(f: BinaryIO, header: dict[str, Any], records: list[Record], compression: str | int = 0) -> int:
    """A whole journal (for atomic rewrites and saved sessions); returns the bytes written."""
    n = f.write(encode_header(header))
    for r in records:
        for part in encode_record_parts(r, compression):
            n += f.write(part)
    return n


__all__ = ["COMPRESSIONS", "FORMAT_VERSION", "KINDS", "JournalError", "Record", "Scan", "check_compression",
           "encode_header", "encode_record", "encode_record_parts", "iter_records", "lz4_available", "read_record",
           "scan", "write_journal"]
