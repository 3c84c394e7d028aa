"""One error root for kvdata, with specific subclasses.

Every message names the file, key or setting at fault and says what to do, so
the CLI can print it as a single line and library users can show it as is.
"""

from __future__ import annotations


class KVDataError(Exception):
    """Root of every error kvdata raises on purpose."""


class NotADatasetError(KVDataError):
    """The path exists but holds no kvdata dataset (or does not exist)."""


class FormatVersionError(KVDataError):
    """The dataset was written by a newer kvdata format than this code reads."""


class CorruptDatasetError(KVDataError):
    """A manifest, index or shard is damaged; the message says how to repair it."""


class MissingShardError(CorruptDatasetError):
    """A shard listed in the manifest is absent."""


class InvalidKeyError(KVDataError, ValueError):
    """A key is empty, not valid UTF-8, or too long."""


class InvalidValueError(KVDataError, ValueError):
    """A value cannot be stored (object dtype, unsupported type, ...)."""


class RecordTooLargeError(InvalidValueError):
    """A single record does not fit in one shard."""


class WriterLockedError(KVDataError):
    """Another process holds the dataset's writer lock."""


class ReadOnlyError(KVDataError):
    """A write was attempted on a store opened for reading."""


class CommitError(KVDataError):
    """A commit failed (disk full, I/O error); the previous generation is intact."""


class ConfigError(KVDataError, ValueError):
    """A setting (size string, option) is invalid."""


class ClosedError(KVDataError):
    """The store was closed or failed and must be reopened."""


# ---------------------------------------------------------------- tiers and homes


class RemoteError(KVDataError):
    """A home could not be read or written (network, permissions, missing object)."""


class ChecksumMismatchError(KVDataError):
    """A fetched shard does not match its manifest checksum; it is never served."""


class StagingAbortedError(KVDataError):
    """Staging was abandoned because the engine is closing."""


class TierFailedError(KVDataError):
    """A tier directory failed (vanished, read-only, full); it is skipped for a while."""


class NoRoomError(KVDataError):
    """A prefetch found its tier full of shards in use; it is not staged."""

    def __init__(self, tier: str) -> None:
        super().__init__(f"tier {tier!r} is full of shards in use; not prefetching")


# ---------------------------------------------------------------- daemon protocol


class ProtocolError(KVDataError):
    """A malformed frame or message."""


class DaemonError(KVDataError):
    """The daemon answered with an error (its message is in the text, its kind in `code`)."""

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class DaemonUnavailable(KVDataError):
    """No daemon answers on the socket."""


class BadRequest(KVDataError):
    """A request the daemon refuses (bad field, unknown dataset/shard)."""


class NotAllowed(BadRequest):
    """A request the trust model refuses (docs/SECURITY.md): a home not in the daemon's
    allow-list, a local path named by a client that must pass descriptors, another
    uid's dataset; the reader then stages in-process."""


class StaleManifest(BadRequest):
    """The client names a shard its daemon-side manifest no longer has: open again."""
