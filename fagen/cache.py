"""The on-disk cache that compiled kernels and solved plans live in, built so that it cannot hurt.

- Every entry is one file: a 32-byte SHA-256 over the entry's kind, key and payload, then the payload. A
  truncated or corrupted file fails the check, is reported once, removed and rebuilt; it never crashes a
  load. A valid entry copied or renamed to another key fails it too.
- Writes are atomic: the bytes go to a temporary file in the same folder, then `os.replace`, so a
  reader sees the old entry or the new one, never half of one.
- Building an entry holds a `filelock` lock on it, so several processes asking for the same kernel
  at once compile it once; the others wait, then read it. The holder touches its lock file every
  2 s while it builds; a waiter gives up on a holder that has been silent for $FAGEN_LOCK_TIMEOUT
  seconds (default 30), with a warning, and builds the entry itself: the holder is stuck (stopped, or
  not fagen), and a second build is safe because writes are atomic. A holder whose process runs is
  waited for at most 3 minutes (its build may hang while its heartbeat thread beats). For ten minutes after that, the
  process waits at most 5 s for any lock (a stuck holder may hold several).
- A cache that cannot be created, read or written (no home folder, read-only, full disk) costs speed,
  never the result: one warning says why, and the entry is built in memory.

Trust model. A cached cubin is machine code that `fagen.compile` loads and runs without compiling it;
the checksum guards against accidents, not tampering. Anyone who can write the cache can run code as
you, so the cache is used only where nobody else can write it (the rule of pip's and PyTorch
inductor's caches):

- the cache folder, the folders under it and each entry must be owned by you (st_uid == os.getuid())
  and not writable by group or others (mode & 0o022 == 0). Entries are checked on the opened file
  (fstat), so a file swapped in between the check and the read is checked too;
- fagen creates its folders 0700 and its entries 0600;
- a folder that fails the check is not used at all: one warning says why and how to fix it (chmod
  go-w or chown, or point FAGEN_CACHE_DIR at a private folder) and kernels are built in memory. An
  entry that fails it is ignored and rebuilt; the rebuilt entry replaces it;
- the folders above the cache folder are not checked: keep it under folders only you can write (your
  home; /tmp is fine, its sticky bit stops others from renaming what you own there).

Location: $FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen (an absolute XDG_CACHE_HOME), else
~/.cache/fagen, else (no home folder can be found) <tmp>/fagen-<uid>. docs/cache.md says the same for users.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

CACHE_ENV = "FAGEN_CACHE_DIR"
LOCK_TIMEOUT_ENV = "FAGEN_LOCK_TIMEOUT"
AUTOTUNE_FILE = "autotune.json"   # fagen/tuning.py reads and writes it; its state is part of the run-time plan key
DIGEST_BYTES = 32
#: How long a process waits for another that is building the same entry and shows no sign of life before
#: building it itself. A holder in this process family touches its lock file every HEARTBEAT_S while it builds,
#: so a slow compile (16 at once on a loaded machine can take minutes) is waited for; a stopped or foreign
#: holder that stays silent this long is given up on. A live holder is waited for at most LIVE_HOLDER_CAP_S.
LOCK_TIMEOUT_S = 30.0
HEARTBEAT_S = 2.0
LIVE_HOLDER_CAP_S = 180.0
#: After one wait timed out, the holder is likely stuck holding others too (the runtime builds a plan's cubins
#: under the plan's lock): for STUCK_WINDOW_S the process waits at most STUCK_WAIT_S for any lock, so one stuck
#: holder costs one timeout, not one per lock it holds.
STUCK_WAIT_S, STUCK_WINDOW_S = 5.0, 600.0
_gave_up_at: Optional[float] = None
KINDS = ("cubin", "plan")         # the entry folders under the cache folder (compiler.py, build.py)
FOLDER_MODE = 0o700
ENTRY_MODE = 0o600
_ENTRY_TAG = b"fagen-cache-entry-v2\0"
_NAME = re.compile(r"[0-9A-Za-z_-]+\Z")


# ---- where, and whether to trust it ------------------------------------------------------------------
def cache_location() -> Path:
    """Where the cache lives (see the module docstring); creates nothing, never raises."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "fagen"
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):   # no HOME and no passwd entry (a container's random uid)
        home = None
    if home is None or not home.is_absolute():
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        return Path(tempfile.gettempdir()) / f"fagen-{uid}"
    return home / ".cache" / "fagen"


def cache_dir() -> Path:
    """The cache folder, created (0700) where it can be; never raises. Whether it may be used is
    DiskCache's question (`DiskCache().problem()`)."""
    path = cache_location()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    except OSError:
        pass   # DiskCache warns when it first needs the folder
    return path


def untrusted(st: os.stat_result) -> Optional[str]:
    """Why a file or folder with this stat must not be trusted (another user could write it), or None."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by you (uid {uid})"
    if os.name != "nt" and st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def trusted_file(path: os.PathLike | str) -> Optional[str]:
    """Why `path` (an existing file in the cache folder, e.g. autotune.json) must not be trusted, or None.
    A missing file is None: there is nothing to trust."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return untrusted(st)


def lock_timeout() -> float:
    """$FAGEN_LOCK_TIMEOUT in seconds (0: do not wait), else LOCK_TIMEOUT_S."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not text:
        return LOCK_TIMEOUT_S
    try:
        value = float(text)
        if math.isnan(value) or value < 0:
            raise ValueError
    except ValueError:
        _warn_once(("lock-timeout", text), f"fagen: {LOCK_TIMEOUT_ENV}={text!r} is not a number of seconds >= 0; "
                                           f"using {LOCK_TIMEOUT_S:g}")
        return LOCK_TIMEOUT_S
    return value


def digest(*parts: bytes | str) -> str:
    """A key from the parts, each length-prefixed so that ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def entry_digest(kind: str, key: str, payload: bytes) -> bytes:
    """The checksum an entry starts with: over its kind and key as well, so a file at the wrong key fails it."""
    h = hashlib.sha256(_ENTRY_TAG)
    h.update(f"{kind}\0{key}\0".encode())
    h.update(payload)
    return h.digest()


_warned: set = set()


def _warn_once(what, message: str, stacklevel: int = 3) -> None:
    """One warning per problem per process: a refused folder is not repeated on every kernel."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(message, stacklevel=stacklevel + 1)


def fix_hint(path: Path, reason: str) -> str:
    quoted = f"'{path}'"
    if "owned by" in reason:
        fix = f"chown -R $(id -u) {quoted} (as its owner or root)"
    elif "writable by" in reason:
        fix = f"chmod -R go-w {quoted}"
    else:
        fix = f"make {quoted} a folder you can write"
    return f"fix: {fix}, or set {CACHE_ENV} to a private folder"


# ---- entries ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One file of the cache, as `DiskCache.entries` lists it."""

    kind: str          # "cubin", "plan" or "autotune"
    key: str           # the entry's key (its file name; "autotune.json" for the autotune results)
    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class _Read:
    payload: Optional[bytes] = None
    problem: Optional[str] = None     # why the entry cannot be used (corrupt, untrusted, unreadable)
    corrupt: bool = False             # the checksum failed (remove and rebuild)
    old_format: bool = False          # a checksum of an older fagen (sha256 of the payload alone): a plain miss


class _Folder:
    OK, ABSENT, REFUSED = "ok", "absent", "refused"


class DiskCache:
    """The cache under `root` (default: `cache_dir()`). No method raises OSError: a folder or entry that
    cannot be used is a warning and a miss, and `get_or_build` then builds in memory."""

    def __init__(self, root: Optional[os.PathLike | str] = None):
        self.root = Path(root) if root is not None else cache_dir()

    def path(self, kind: str, key: str) -> Path:
        if not (_NAME.match(kind) and _NAME.match(key)):
            raise ValueError(f"cache kind and key are names of letters, digits, '_' and '-', got {kind!r}, {key!r}")
        return self.root / kind / key[:2] / key

    # ---- folders ----
    def _folder(self, folder: Path, create: bool, *, warn: bool = True) -> tuple[str, Optional[str]]:
        """(OK | ABSENT | REFUSED, why refused) for one folder of the cache, made 0700 when `create`."""
        for attempt in (0, 1):
            try:
                st = os.stat(folder)
            except (FileNotFoundError, NotADirectoryError):   # (a file where a folder above it should be)
                if os.path.islink(folder):
                    return self._refuse(folder, "it is a link to a folder that does not exist", warn)
                if not create or attempt:
                    return _Folder.ABSENT, None
                try:
                    if folder == self.root:
                        folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
                    else:
                        os.mkdir(folder, FOLDER_MODE)
                except FileExistsError:
                    pass
                except OSError as err:
                    return self._refuse(folder, f"it cannot be created ({err.strerror or err})", warn)
                continue
            except OSError as err:
                return self._refuse(folder, f"it cannot be read ({err.strerror or err})", warn)
            if not stat.S_ISDIR(st.st_mode):
                return self._refuse(folder, "it is not a folder", warn)
            reason = untrusted(st)
            if reason:
                return self._refuse(folder, f"it is {reason}, so another user could plant kernels in it", warn)
            return _Folder.OK, None
        return _Folder.ABSENT, None

    def _refuse(self, folder: Path, reason: str, warn: bool) -> tuple[str, str]:
        if warn:
            _warn_once(("folder", str(folder), reason),
                       f"fagen: not using the kernel cache folder {folder}: {reason}; building in memory "
                       f"({fix_hint(self.root if folder == self.root else folder, reason)})", stacklevel=4)
        return _Folder.REFUSED, reason

    def _folders(self, kind: str, key: str, create: bool) -> str:
        """OK when the root, the kind's folder and the key's folder exist (made if `create`) and are trusted."""
        path = self.path(kind, key)
        for folder in (self.root, path.parent.parent, path.parent):
            state, _ = self._folder(folder, create)
            if state != _Folder.OK:
                return state
        return _Folder.OK

    def problem(self, create: bool = False) -> Optional[str]:
        """Why the cache folder cannot be used (cannot be made, not a folder, untrusted), or None (usable or
        not made yet). Warns nothing: for `fagen doctor` and `fagen cache`."""
        state, reason = self._folder(self.root, create, warn=False)
        if state == _Folder.REFUSED:
            return reason
        for kind in KINDS if state == _Folder.OK else ():   # the entry folders, where they exist: each is checked too
            state, reason = self._folder(self.root / kind, False, warn=False)
            if state == _Folder.REFUSED:
                return f"its folder {kind}/ is refused: {reason}"
        return None

    # ---- reading ----
    def _read(self, path: Path, kind: str, key: str) -> Optional[_Read]:
        """The entry at `path` checked (None: absent)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return _Read(problem="it is a symbolic link (fagen writes none)")
            return _Read(problem=f"it cannot be read ({err.strerror or err})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return _Read(problem="it is not a regular file")
            reason = untrusted(st)
            if reason:
                return _Read(problem=f"it is {reason}, so another user could have written it")
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as err:
            return _Read(problem=f"it cannot be read ({err.strerror or err})")
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
        raw = b"".join(chunks)
        payload, checksum = raw[DIGEST_BYTES:], raw[:DIGEST_BYTES]
        if len(raw) >= DIGEST_BYTES and checksum == entry_digest(kind, key, payload):
            return _Read(payload=payload)
        if len(raw) >= DIGEST_BYTES and checksum == hashlib.sha256(payload).digest():
            return _Read(problem="it was written by an older fagen", old_format=True)
        return _Read(problem=f"it is corrupt ({len(raw)} bytes, checksum mismatch)", corrupt=True)

    def get(self, kind: str, key: str) -> Optional[bytes]:
        """The payload, or None when absent, corrupt (reported once and removed) or not trusted (reported)."""
        if self._folders(kind, key, create=False) != _Folder.OK:
            return None
        path = self.path(kind, key)
        found = self._read(path, kind, key)
        if found is None or found.payload is not None:
            return None if found is None else found.payload
        if found.corrupt:
            warnings.warn(f"fagen: cache entry {path}: {found.problem}; removing it and rebuilding", stacklevel=2)
            _unlink(path)
        elif not found.old_format:
            _warn_once(("entry", str(path), found.problem),
                       f"fagen: ignoring cache entry {path}: {found.problem}; rebuilding it "
                       "(the rebuilt entry replaces it)", stacklevel=2)
        return None

    # ---- writing ----
    def put(self, kind: str, key: str, payload: bytes) -> None:
        """Store `payload` (atomically, 0600); a failure is one warning, never an exception."""
        if self._folders(kind, key, create=True) != _Folder.OK:
            return   # warned by _folders
        path = self.path(kind, key)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}-", suffix=".tmp")   # mode 0600
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(entry_digest(kind, key, payload))
                    handle.write(payload)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            except BaseException:
                _unlink(tmp)
                raise
        except OSError as err:
            _warn_once(("store", str(self.root), err.errno),
                       f"fagen: could not store cache entry {path} ({err.strerror or err}); it is used from memory "
                       "and rebuilt next time", stacklevel=2)

    def lock(self, kind: str, key: str) -> "CacheLock":
        """A lock on building one entry, for `with`: never raises; gives up with a warning after
        `lock_timeout()` seconds or where the folder cannot be locked, and the body then runs unlocked."""
        return CacheLock(self, kind, key)

    def get_or_build(self, kind: str, key: str, build: Callable[[], bytes]) -> bytes:
        """The cached payload, or `build()` stored under a lock (built once across processes)."""
        payload = self.get(kind, key)
        if payload is not None:
            return payload
        with self.lock(kind, key):
            payload = self.get(kind, key)  # another process may have built it while we waited
            if payload is None:
                payload = build()
                self.put(kind, key, payload)
            return payload

    # ---- what `fagen cache` shows and does ----
    def entries(self, kind: Optional[str] = None) -> Iterator[Entry]:
        """Every entry (lock and temporary files left out), and the autotune results as kind "autotune"."""
        for name in KINDS:
            if kind not in (None, name):
                continue
            for folder in _listdir(self.root / name):
                if not (len(folder.name) == 2 and folder.is_dir() and not folder.is_symlink()):
                    continue
                for path in _listdir(folder):
                    if path.name.startswith(folder.name) and _NAME.match(path.name):
                        entry = _entry(name, path.name, path)
                        if entry is not None:
                            yield entry
        if kind in (None, "autotune"):
            entry = _entry("autotune", AUTOTUNE_FILE, self.root / AUTOTUNE_FILE)
            if entry is not None:
                yield entry

    def check(self, entry: Entry) -> tuple[Optional[str], bool]:
        """(why `entry` would not be used, whether that is a fault): (None, False) for a good entry; a corrupt,
        untrusted or unreadable one is a fault, one of an older fagen's format only stale (a miss, rebuilt)."""
        if entry.kind == "autotune":
            problem = self._read_plain(entry.path)
            return problem, problem is not None
        for folder in (self.root, entry.path.parent.parent, entry.path.parent):
            state, reason = self._folder(folder, False, warn=False)
            if state == _Folder.REFUSED:
                return f"its folder {folder}: {reason}", True
        found = self._read(entry.path, entry.kind, entry.key)
        if found is None or found.problem is None:
            return None, False   # good, or removed meanwhile
        return found.problem, not found.old_format

    def _read_plain(self, path: Path) -> Optional[str]:
        reason = trusted_file(path)
        if reason:
            return f"it is {reason}" if not reason.startswith("cannot") else f"it {reason}"
        try:
            json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            return f"it is not readable JSON ({err})"
        return None

    def untrusted_folders(self) -> list[tuple[Path, str]]:
        """The cache's folders that fail the trust check (or cannot be read), with why."""
        refused = []
        folders = [self.root] + [self.root / name for name in KINDS]
        folders += [sub for name in KINDS for sub in _listdir(self.root / name) if sub.is_dir()]
        for folder in folders:
            state, reason = self._folder(folder, False, warn=False)
            if state == _Folder.REFUSED:
                refused.append((folder, reason))
        return refused

    def remove(self, entry: Entry) -> Optional[str]:
        """Delete one entry; the error's text where it could not be deleted."""
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            return err.strerror or str(err)
        return None

    def clear(self, kind: Optional[str] = None) -> tuple[int, int, list[str]]:
        """Remove every entry (of `kind`), with the lock and temporary files beside them; the folders go too
        when empty. Only files fagen names are touched (a FAGEN_CACHE_DIR pointed at a folder of other
        files loses none of them). (entries removed, their bytes, errors)."""
        removed = size = 0
        errors: list[str] = []
        for entry in list(self.entries(kind)):
            problem = self.remove(entry)
            if problem:
                errors.append(f"{entry.path}: {problem}")
            else:
                removed, size = removed + 1, size + entry.size
        for name in KINDS:
            if kind not in (None, name):
                continue
            top = self.root / name
            for folder in _listdir(top):
                if not (len(folder.name) == 2 and folder.is_dir() and not folder.is_symlink()):
                    continue
                for path in _listdir(folder):
                    if path.name.endswith((".lock", ".tmp")) and (path.name.startswith(".") or
                                                                 path.name.startswith(folder.name)):
                        _unlink(path)
                _rmdir(folder)
            _rmdir(top)
        return removed, size, errors


class CacheLock:
    """`DiskCache.lock`'s lock: `with` it; `.held` says whether it was taken."""

    def __init__(self, cache: DiskCache, kind: str, key: str):
        self.cache, self.kind, self.key = cache, kind, key
        self.held = False
        self._lock = None

    def acquire(self) -> bool:
        global _gave_up_at
        if self.cache._folders(self.kind, self.key, create=True) != _Folder.OK:
            return False   # warned by _folders: nothing to share, so nothing to lock
        path = self.cache.path(self.kind, self.key)
        timeout = lock_timeout()
        if _gave_up_at is not None and time.monotonic() - _gave_up_at < STUCK_WINDOW_S:
            timeout = min(timeout, STUCK_WAIT_S)
        try:
            from filelock import FileLock, Timeout
        except ImportError as err:   # a dependency, but a missing one must not stop a build
            _warn_once(("filelock", str(err)), f"fagen: cannot lock cache entries ({err}); building without a lock")
            return False
        lock_path = str(path) + ".lock"
        lock = FileLock(lock_path, timeout=min(HEARTBEAT_S, timeout), mode=ENTRY_MODE)
        start = time.monotonic()
        while True:
            try:
                lock.acquire()
                break
            except Timeout:
                waited = time.monotonic() - start
                if _silent_for(lock_path, waited) < timeout and waited < LIVE_HOLDER_CAP_S:
                    continue   # the holder is alive (its heartbeat is recent): a slow build, not a stuck one
                _gave_up_at = time.monotonic()
                warnings.warn(f"fagen: waited {waited:.3g} s for the lock on cache entry {path}: the process holding "
                              f"it may be stuck (no sign of life for that long); building it without the lock (the result is the same; "
                              f"{LOCK_TIMEOUT_ENV} sets the wait in seconds)", stacklevel=3)
                return False
            except OSError as err:
                _warn_once(("lock", str(path.parent), err.errno),
                           f"fagen: cannot lock cache entry {path} ({err.strerror or err}); building without the lock")
                return False
        self._lock, self.held = lock, True
        _heartbeat.add(lock_path)
        return True

    def release(self) -> None:
        if self._lock is not None:
            _heartbeat.discard(self._lock.lock_file)
            try:
                self._lock.release()
            except OSError:
                pass
            self._lock, self.held = None, False

    def __enter__(self) -> "CacheLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _silent_for(lock_path: str, waited: float) -> float:
    """Seconds since the lock's holder last touched it, counted from when this wait began at the earliest (a
    lock file's old mtime may be a previous holder's)."""
    try:
        return min(time.time() - os.stat(lock_path).st_mtime, waited)
    except OSError:
        return waited


class _Heartbeat:
    """Touches the lock files this process holds every HEARTBEAT_S, from one daemon thread, so that waiters
    can tell a slow build from a stuck holder (CacheLock.acquire)."""

    def __init__(self):
        self._held: dict[str, int] = {}
        self._guard = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def add(self, path: str) -> None:
        with self._guard:
            self._held[path] = self._held.get(path, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="fagen-cache-heartbeat", daemon=True)
                self._thread.start()
        _touch(path)

    def discard(self, path: str) -> None:
        with self._guard:
            count = self._held.pop(path, 0) - 1
            if count > 0:
                self._held[path] = count

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self._guard:
                paths = list(self._held)
            for path in paths:
                _touch(path)


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


_heartbeat = _Heartbeat()
# A forked child holds none of its parent's locks, and the parent's heartbeat thread did not come with it
os.register_at_fork(after_in_child=lambda: _heartbeat.__init__())


def _entry(kind: str, key: str, path: Path) -> Optional[Entry]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    return Entry(kind, key, path, st.st_size, st.st_mtime)


def _listdir(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
