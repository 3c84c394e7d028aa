"""The framing of a shard's cold copy (`NNNNNN.mdb.zst`): zstd frames cut at record
boundaries, then a seek table, so a remote home can serve one record without the rest.

Layout of the .zst (docs/FORMAT.md, "Cold copies"):

    frame 0 .. frame F-1     ordinary zstd frames (content size and checksum set); their
                             concatenation decompresses to the shard, byte for byte
    seek table               one zstd *skippable* frame (magic 0x184D2A5B): zstd and every
                             stream decoder skip it, so the file as a whole still
                             decompresses to exactly the shard

The seek table's payload (little-endian):

    0   8   magic b"KVSEEK01"
    8   4   F: frame count
    12  4   N: slot count (0 without a slot directory)
    16  4   flags: bit 0 = slot directory present; no other bit is defined
    20  4   reserved (0)
    24  8   uncompressed size (the shard's bytes)
    32  24F frames: compressed size u32, uncompressed size u32, sha256(compressed frame)[:16]
    ..  12N slots:  offset u64, size u32 of each slot's LMDB value in the shard, slot order
    ..  12  trailer: the whole skippable frame's length u32, magic b"KVSEEK01" (found from the end)

Frame offsets are the running sums of the sizes (no offsets are stored, so frames can never
overlap or leave gaps). The manifest's zst entry records the table's size and sha256, so a
reader fetches the table with one ranged GET, checks it against the manifest, and each frame
it fetches later against the table. `decode_seek_table` treats the bytes as hostile: any
inconsistency is a CorruptDatasetError, nothing else.

Cutting: a frame ends only where no record value is cut (a value's first or last byte, or a
page boundary no value crosses); frames grow to `target` bytes, and a value larger than that
is a frame of exactly its bytes. The value
ranges come from the caller (the side-index rows) or from the LMDB file itself
(`lmdb_values`: a walk of its B-tree from the newest meta page's root).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptDatasetError

SKIPPABLE_MAGIC = 0x184D2A5B
TABLE_MAGIC = b"KVSEEK01"
FLAG_SLOTS = 1
FRAME_TARGET = 128 << 10       # uncompressed bytes per frame at most, unless one record is larger
FRAME_MIN = 16 << 10           # ... and at least (zstd and the seek table stay efficient)
RECORDS_PER_FRAME = 8          # a record read fetches about this many records' bytes
DIGEST_BYTES = 16
_SKIP = struct.Struct("<II")
_HEAD = struct.Struct("<8sIIIIQ")
_TRAIL = struct.Struct("<I8s")
FRAME_DTYPE = np.dtype([("csize", "<u4"), ("usize", "<u4"), ("digest", f"V{DIGEST_BYTES}")])
SLOT_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4")])
MIN_TABLE = _SKIP.size + _HEAD.size + _TRAIL.size

# ---------------------------------------------------------------- LMDB pages (read only)

_PAGE_HDR = 16
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2, _P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
_F_BIGDATA = 0x01
_P_INVALID = 0xFFFFFFFFFFFFFFFF
_LMDB_MAGIC = 0xBEEFC0DE
_META = struct.Struct("<II16xI76xQQQQ")  # magic, version, psize (free db md_pad), entries, root, last_pg, txnid
_PAGE = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")


def lmdb_values(buf: memoryview | bytes, txnid: int | None = None) -> np.ndarray | None:
    """(offset, size) of every slot's value in an LMDB file whose keys are the 8-byte slot
    numbers 0..n-1 (a sealed shard), in slot order, as SLOT_DTYPE rows -- or None when the
    file is not laid out so (any doubt: the caller then cuts frames at page boundaries and
    writes no slot directory).

    The main B-tree is walked from the newest meta page's root (or, with `txnid`, from the root
    of the meta page of that transaction: a live tail read under a read transaction that pins
    it; None if neither meta page is that transaction's) one level at a time, every
    page of a level at once in numpy (a file that was not compacted holds free pages with
    stale nodes; only the tree says which pages are live). A node-by-node walk in Python cost
    ~2 us a record, most of a small-record seal. Every gathered position is checked against
    the file before it is read, and each level's size against what the file can hold, so
    hostile pages cost at most a few passes over the file."""
    size = len(buf)
    meta = lmdb_meta(buf, txnid)
    if meta is None:
        return None
    _txnid, psize, entries, root, last_pg = meta
    npages = min(last_pg + 1, size // psize)
    if entries > size // 16:  # a value takes a node of at least 16 bytes
        return None
    if root == _P_INVALID:
        return np.zeros(0, dtype=SLOT_DTYPE) if entries == 0 else None
    if not 2 <= root < npages:
        return None
    try:
        return _walk(np.frombuffer(buf, np.uint8), psize, entries, root, npages, size)
    except (MemoryError, ValueError, IndexError, OverflowError):  # any doubt is None; the frames that
        return None                                              # held views of `buf` are gone by now


def lmdb_meta(buf: memoryview | bytes, txnid: int | None = None) -> tuple[int, int, int, int, int] | None:
    """(txnid, page size, entries, root page, last page) of the newest valid meta page of an
    LMDB file -- or of the one written by transaction `txnid`; None if there is none."""
    if len(buf) < 2 * 512:
        return None
    best: tuple[int, int, int, int, int] | None = None
    try:
        psize0 = _META.unpack_from(buf, _PAGE_HDR)[2]
    except struct.error:
        return None
    if psize0 & (psize0 - 1) or not 512 <= psize0 <= 65536 or len(buf) < 2 * psize0:
        return None
    for at in (0, psize0):
        magic, _version, psize, entries, root, last_pg, tid = _META.unpack_from(buf, at + _PAGE_HDR)
        if magic != _LMDB_MAGIC or psize != psize0:
            continue
        if txnid is None and (best is None or tid > best[0]) or txnid is not None and tid == txnid:
            best = (tid, psize, entries, root, last_pg)
    return best


WALK_CHUNK = 1 << 16  # nodes gathered at once: the walk's temporaries stay a few MB whatever the file says


def _walk(u8: np.ndarray, psize: int, entries: int, root: int, npages: int, size: int) -> np.ndarray | None:
    """lmdb_values' walk from `root`: the branch levels (at most npages children in all), then the
    leaf level a chunk of pages at a time, each chunk's keys checked before the next is read (a
    crafted leaf level fails in its first chunk, not after a pass over everything it claims)."""
    pages = np.array([root], dtype=np.int64)
    visited = 0
    for _depth in range(64):
        visited += len(pages)
        if visited > npages or pages.min() < 2 or pages.max() >= npages:
            return None
        base = pages * psize
        flags, lower = _u16(u8, base + 10), _u16(u8, base + 12)
        if (lower < _PAGE_HDR).any() or (lower > psize).any() \
                or (flags & (_P_LEAF2 | _P_SUBP | _P_OVERFLOW | _P_META)).any():
            return None
        branch = (flags & _P_BRANCH) != 0
        if branch.any() and not branch.all():  # a B+tree's leaves are all at one depth
            return None
        if not branch.all() and not (flags & _P_LEAF).all():
            return None
        counts = (lower - _PAGE_HDR) >> 1
        total = int(counts.sum())
        if total > (npages if branch[0] else entries):  # children are distinct pages; a leaf node is a slot
            return None
        if not branch[0]:
            return _leaf_level(u8, base, counts, psize, entries, npages, size) if total == entries else None
        page_base, ptrs = _pointers(u8, base, counts)
        if (ptrs + _NODE.size > psize).any():
            return None
        hdr = _block(u8, page_base + ptrs, 6).view("<u2").astype(np.int64)  # lo, hi, flags: the child page
        pages = hdr[:, 0] | (hdr[:, 1] << 16) | (hdr[:, 2] << 32)
        if not len(pages) or len(np.unique(pages)) != len(pages):  # a tree, not a graph that revisits pages
            return None
    return None


def _pointers(u8: np.ndarray, base: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the page's offset, the node pointer) of every node of the pages at `base`, page by page."""
    total = int(counts.sum())
    page_base = np.repeat(base, counts)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return page_base, _u16(u8, page_base + _PAGE_HDR + 2 * within)


def _leaf_level(u8: np.ndarray, base: np.ndarray, counts: np.ndarray, psize: int, entries: int, npages: int,
                size: int) -> np.ndarray | None:
    """The SLOT_DTYPE rows of the leaf pages at `base` (key order), WALK_CHUNK nodes at a time."""
    parts: list[np.ndarray] = []  # no array the size the meta page claims before the keys say it is so
    ends = np.cumsum(counts)
    done, p0 = 0, 0
    while p0 < len(base):
        p1 = max(p0 + 1, int(np.searchsorted(ends, done + WALK_CHUNK, "right")))
        page_base, ptrs = _pointers(u8, base[p0:p1], counts[p0:p1])
        rows = _leaf_values(u8, page_base, ptrs, psize, done, npages, size)
        if rows is None:
            return None
        parts.append(rows)
        done += len(rows)
        p0 = p1
    if done != entries:
        return None
    return np.concatenate(parts) if parts else np.zeros(0, dtype=SLOT_DTYPE)


def _u16(u8: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Little-endian uint16 at each byte position (any alignment), as int64."""
    return u8[pos].astype(np.int64) | (u8[pos + 1].astype(np.int64) << 8)


def _block(u8: np.ndarray, pos: np.ndarray, width: int) -> np.ndarray:
    """The `width` bytes at each byte position, one row each (one gather per node, not one per
    field: the nodes lie all over the file, and each separate gather missed the cache again);
    rows of a sliding view, so no index matrix is built."""
    return np.lib.stride_tricks.sliding_window_view(u8, width)[pos]


def _u64(u8: np.ndarray, pos: np.ndarray, order: str) -> np.ndarray:
    """uint64 of byte order `order` ('<' or '>') at each byte position."""
    return _block(u8, pos, 8).view(order + "u8").ravel()


def _leaf_values(u8: np.ndarray, page_base: np.ndarray, ptrs: np.ndarray, psize: int, first: int,
                 npages: int, size: int) -> np.ndarray | None:
    """The SLOT_DTYPE rows of leaf nodes (key order) whose keys must be the slots first, first+1, ...;
    None on any doubt."""
    if (ptrs + _NODE.size + 8 > psize).any():
        return None
    node = page_base + ptrs
    blk = _block(u8, node, _NODE.size + 8)  # the node's header and its key, the slot number
    hdr = blk[:, :_NODE.size].view("<u2").astype(np.int64)
    dsize = hdr[:, 0] | (hdr[:, 1] << 16)
    if (hdr[:, 3] != 8).any() or (hdr[:, 2] & ~_F_BIGDATA).any():  # key size, node flags
        return None
    if not np.array_equal(blk[:, _NODE.size:].view(">u8").ravel(),
                          np.arange(first, first + len(node), dtype=np.uint64)):
        return None
    nflags = hdr[:, 2]
    start = node + _NODE.size + 8
    big = (nflags & _F_BIGDATA) != 0
    inline = ~big
    if (start[inline] + dsize[inline] > page_base[inline] + psize).any():
        return None
    if big.any():
        at = start[big]
        if (at + 8 > page_base[big] + psize).any():
            return None
        opg = _u64(u8, at, "<")
        if (opg < 2).any() or (opg >= npages).any():
            return None
        obase = opg.astype(np.int64) * psize
        opages = _u16(u8, obase + 12) | (_u16(u8, obase + 14) << 16)
        if not (_u16(u8, obase + 10) & _P_OVERFLOW).all() or (opages * psize < _PAGE_HDR + dsize[big]).any():
            return None
        start[big] = obase + _PAGE_HDR
    if (start + dsize > size).any():
        return None
    out = np.zeros(len(node), dtype=SLOT_DTYPE)
    out["offset"] = start
    out["size"] = dsize
    return out


def page_size(buf: memoryview | bytes) -> int:
    """The LMDB page size a file's first meta page gives (4096 if it gives none)."""
    try:
        magic, _v, psize = _META.unpack_from(buf, _PAGE_HDR)[:3]
    except struct.error:
        return 4096
    if magic != _LMDB_MAGIC or psize & (psize - 1) or not 512 <= psize <= 65536:
        return 4096
    return int(psize)


def frame_target(slots: np.ndarray | None) -> int:
    """Frame size for a shard's records: a record read fetches its whole frame, so a frame
    holds about RECORDS_PER_FRAME records (small records: FRAME_MIN, not 128 KiB per 1 KiB read),
    between FRAME_MIN and FRAME_TARGET."""
    if slots is None or not len(slots):
        return FRAME_TARGET
    mean = int(slots["size"].astype(np.int64).sum()) // len(slots)
    return max(FRAME_MIN, min(FRAME_TARGET, mean * RECORDS_PER_FRAME))


def frame_cuts(size: int, slots: np.ndarray | None, psize: int, target: int = FRAME_TARGET) -> list[tuple[int, int]]:
    """[start, end) of each frame: frames of up to `target` bytes that end where no value is
    cut (a value's start or end, or a page boundary no value crosses); a value larger than
    `target` is alone in its frame, exactly its bytes. Cutting at the values themselves, not
    only at pages, keeps a record read from fetching the page header and the unused rest of
    the value's last page (about 2 KiB of every 151 KB image read by record at 4 KiB pages)."""
    if size <= 0:
        return []
    npages = -(-size // psize)
    inside = np.zeros(npages + 2, dtype=np.int64)   # boundary k (at k * psize) lies inside a value
    if slots is not None and len(slots):
        a = slots["offset"].astype(np.int64)
        b = a + slots["size"].astype(np.int64)
        first = a // psize + 1
        last = (b - 1) // psize
        ok = (first <= last) & (b > a)
        np.add.at(inside, first[ok], 1)
        np.add.at(inside, last[ok] + 1, -1)
    crossed = np.cumsum(inside)[1:npages]          # boundaries 1 .. npages-1
    bounds = (np.nonzero(crossed == 0)[0] + 1) * psize
    if slots is not None and len(slots):
        ends = np.concatenate([a[b > a], b[b > a]])
        bounds = np.unique(np.concatenate([bounds, ends[(ends > 0) & (ends < size)]]))
    cuts: list[tuple[int, int]] = []
    start = prev = 0
    for end in [*bounds.tolist(), size]:
        if end - start > target and prev > start:
            cuts.append((start, prev))
            start = prev
        prev = end
    cuts.append((start, size))
    return cuts


# ---------------------------------------------------------------- the table


def encode_seek_table(total: int, frames: list[tuple[int, int, bytes]], slots: np.ndarray | None) -> bytes:
    """The skippable frame holding the table: frames as (compressed size, uncompressed size,
    digest of the compressed frame), slots as SLOT_DTYPE rows (or None)."""
    fr = np.zeros(len(frames), dtype=FRAME_DTYPE)
    if frames:
        fr["csize"] = [c for c, _u, _d in frames]
        fr["usize"] = [u for _c, u, _d in frames]
        fr["digest"] = [np.void(d[:DIGEST_BYTES]) for _c, _u, d in frames]
    sl = np.zeros(0, dtype=SLOT_DTYPE) if slots is None else np.ascontiguousarray(slots, dtype=SLOT_DTYPE)
    head = _HEAD.pack(TABLE_MAGIC, len(frames), len(sl), FLAG_SLOTS if slots is not None else 0, 0, total)
    body = head + fr.tobytes() + sl.tobytes()
    n = _SKIP.size + len(body) + _TRAIL.size
    return _SKIP.pack(SKIPPABLE_MAGIC, n - _SKIP.size) + body + _TRAIL.pack(n, TABLE_MAGIC)


def table_size_from_trailer(trailer: bytes) -> int | None:
    """The seek table's size from the last TRAILER bytes of a .zst, or None if it has none."""
    if len(trailer) != _TRAIL.size:
        return None
    n, magic = _TRAIL.unpack(trailer)
    return n if magic == TABLE_MAGIC and n >= MIN_TABLE else None


TRAILER = _TRAIL.size


def frame_digest(frame: bytes | memoryview) -> bytes:
    import hashlib

    return hashlib.sha256(frame).digest()[:DIGEST_BYTES]


@dataclass(frozen=True)
class SeekTable:
    """A decoded, consistent seek table (offsets are the running sums of the sizes)."""

    total: int                 # uncompressed bytes (the shard's size)
    c_off: np.ndarray          # int64[F + 1]: compressed offset of each frame, then the frames' end
    u_off: np.ndarray          # int64[F + 1]: uncompressed offset of each frame, then the total
    digests: np.ndarray        # V16[F]
    slot_off: np.ndarray | None  # int64[N], or None without a slot directory
    slot_size: np.ndarray | None

    @property
    def frames(self) -> int:
        return len(self.c_off) - 1

    def frames_of(self, start: int, end: int) -> range:
        """Indices of the frames holding uncompressed bytes [start, end) (end > start)."""
        lo = int(np.searchsorted(self.u_off, start, "right")) - 1
        hi = int(np.searchsorted(self.u_off, end, "left"))
        return range(max(lo, 0), min(hi, self.frames))


def decode_seek_table(blob: bytes | memoryview, *, zst_bytes: int, shard_bytes: int, records: int | None,
                      where: str) -> SeekTable:
    """The seek table of a .zst of `zst_bytes` bytes whose last len(blob) bytes are `blob`, for a
    shard of `shard_bytes` bytes and `records` slots; CorruptDatasetError naming `where` if it
    is not a consistent one."""

    def bad(what: str) -> CorruptDatasetError:
        return CorruptDatasetError(f"{where}: the seek table is damaged ({what}); push the dataset again")

    n = len(blob)
    if n < MIN_TABLE:
        raise bad(f"{n} bytes, shorter than its header")
    magic, length = _SKIP.unpack_from(blob, 0)
    if magic != SKIPPABLE_MAGIC or length != n - _SKIP.size:
        raise bad("not a skippable frame of its own length")
    tmagic, nframes, nslots, flags, _reserved, total = _HEAD.unpack_from(blob, _SKIP.size)
    if tmagic != TABLE_MAGIC or _TRAIL.unpack_from(blob, n - _TRAIL.size) != (n, TABLE_MAGIC):
        raise bad("bad magic")
    if flags & ~FLAG_SLOTS or (not flags & FLAG_SLOTS and nslots):
        raise bad(f"unknown flags {flags:#x}")
    if MIN_TABLE + nframes * FRAME_DTYPE.itemsize + nslots * SLOT_DTYPE.itemsize != n:
        raise bad(f"{nframes} frames and {nslots} slots do not fill its {n} bytes")
    if total != shard_bytes:
        raise bad(f"it describes {total} bytes, the shard has {shard_bytes}")
    if zst_bytes < n:
        raise bad("larger than the compressed copy")
    if nframes > total or (total and not nframes):
        raise bad(f"{nframes} frames for {total} bytes")
    at = _SKIP.size + _HEAD.size
    fr = np.frombuffer(blob, dtype=FRAME_DTYPE, count=nframes, offset=at)
    at += nframes * FRAME_DTYPE.itemsize
    csize = fr["csize"].astype(np.int64)
    usize = fr["usize"].astype(np.int64)
    if nframes and (int(csize.min()) < 1 or int(usize.min()) < 1):
        raise bad("a frame of size 0")
    c_off = np.zeros(nframes + 1, dtype=np.int64)
    u_off = np.zeros(nframes + 1, dtype=np.int64)
    np.cumsum(csize, out=c_off[1:])
    np.cumsum(usize, out=u_off[1:])
    if int(u_off[-1]) != total:
        raise bad(f"its frames hold {int(u_off[-1])} bytes, not {total}")
    if int(c_off[-1]) != zst_bytes - n:
        raise bad(f"its frames take {int(c_off[-1])} bytes, the copy has {zst_bytes - n} before the table")
    slot_off = slot_size = None
    if flags & FLAG_SLOTS:
        if records is not None and nslots != records:
            raise bad(f"{nslots} slots, the shard has {records} records")
        sl = np.frombuffer(blob, dtype=SLOT_DTYPE, count=nslots, offset=at)
        off = sl["offset"]
        size = sl["size"].astype(np.uint64)
        if nslots and bool(((off > np.uint64(total)) | (size > np.uint64(total) - np.minimum(off, np.uint64(total)))).any()):
            raise bad("a slot lies past the shard's end")
        slot_off = off.astype(np.int64)
        slot_size = size.astype(np.int64)
    return SeekTable(total, c_off, u_off, fr["digest"].copy(), slot_off, slot_size)
