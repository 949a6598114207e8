"""The on-disk cache that compiled kernels and solved plans live in, built so that it cannot hurt.

- Every entry is one file: a 32-byte SHA-256 of the payload, then the payload. A truncated or
  corrupted file fails the check, is reported once, removed and rebuilt; it never crashes a load.
- Writes are atomic: the bytes go to a temporary file in the same folder, then `os.replace`, so a
  reader sees the old entry or the new one, never half of one.
- Building an entry holds a `filelock` lock on it, so several processes asking for the same kernel
  at once compile it once; the others wait, then read it.
- A cache that cannot be written (read-only, full disk) costs speed, not the result: the entry is
  built in memory and a warning says why it was not stored.

Location: $FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen, else ~/.cache/fagen.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

CACHE_ENV = "FAGEN_CACHE_DIR"
AUTOTUNE_FILE = "autotune.json"   # fagen/tuning.py reads and writes it; its state is part of the run-time plan key
DIGEST_BYTES = 32
LOCK_TIMEOUT_S = 900.0  # longer than any compile; a holder that died releases its lock with its process


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),
                                                     "fagen")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def digest(*parts: bytes | str) -> str:
    """A key from the parts, each length-prefixed so that ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class DiskCache:
    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_dir()

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def get(self, kind: str, key: str) -> Optional[bytes]:
        """The payload, or None when absent or corrupt (a corrupt entry is reported and removed)."""
        path = self.path(kind, key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            warnings.warn(f"fagen: cannot read cache entry {path} ({err}); rebuilding it", stacklevel=3)
            return None
        payload = raw[DIGEST_BYTES:]
        if len(raw) < DIGEST_BYTES or hashlib.sha256(payload).digest() != raw[:DIGEST_BYTES]:
            warnings.warn(f"fagen: cache entry {path} is corrupt ({len(raw)} bytes, checksum mismatch); "
                          "removing it and rebuilding", stacklevel=3)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        return payload

    def put(self, kind: str, key: str, payload: bytes) -> None:
        path = self.path(kind, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(hashlib.sha256(payload).digest())
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as err:
            warnings.warn(f"fagen: could not store cache entry {path} ({err}); it will be rebuilt next time",
                          stacklevel=3)

    def lock(self, kind: str, key: str):
        from filelock import FileLock

        path = self.path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)

    def get_or_build(self, kind: str, key: str, build: Callable[[], bytes]) -> bytes:
        """The cached payload, or `build()` stored under a lock (built once across processes)."""
        payload = self.get(kind, key)
        if payload is not None:
            return payload
        try:
            lock = self.lock(kind, key)
            lock.acquire()
        except OSError as err:  # an unwritable cache folder: build without sharing
            warnings.warn(f"fagen: cannot lock cache entry {self.path(kind, key)} ({err}); building without the cache",
                          stacklevel=2)
            return build()
        try:
            payload = self.get(kind, key)  # another process may have built it while we waited
            if payload is None:
                payload = build()
                self.put(kind, key, payload)
            return payload
        finally:
            lock.release()
