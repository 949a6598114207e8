"""The disk cache (fagen/cache.py) and the run-time cubin cache on top of it (fagen/compiler.py)."""
import errno
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

import fagen.cache as cache_module
import fagen.compiler as compiler
from fagen.cache import (DIGEST_BYTES, LOCK_TIMEOUT_S, DiskCache, cache_dir, cache_location, digest, entry_digest,
                         lock_timeout, trusted_file)
from fagen.compiler import cached_cubin, cubin_key, nvcc_available
from fagen.sources import TEMPLATE_DIR, fingerprint

ROOT = Path(__file__).resolve().parent.parent


def test_digest_separates_its_parts():
    assert digest("ab", "c") != digest("a", "bc")
    assert digest("x") == digest(b"x")


def test_round_trip_and_atomic_layout(tmp_path):
    cache = DiskCache(tmp_path)
    assert cache.get("cubin", "ab" * 32) is None
    cache.put("cubin", "ab" * 32, b"payload")
    assert cache.get("cubin", "ab" * 32) == b"payload"
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["ab" * 32], "no temporary files left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entries_are_reported_once_removed_and_rebuilt(tmp_path, damage):
    cache = DiskCache(tmp_path)
    key = digest("entry")
    cache.put("plan", key, b"x" * 1000)
    path = cache.path("plan", key)
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:500], "flip": raw[:-1] + bytes([raw[-1] ^ 1]), "empty": b""}[damage])
    with pytest.warns(UserWarning, match="corrupt"):
        assert cache.get("plan", key) is None
    assert not path.exists()
    built = []
    assert cache.get_or_build("plan", key, lambda: built.append(1) or b"fresh") == b"fresh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("plan", key) == b"fresh"
    assert built == [1]


def test_unwritable_cache_warns_and_still_returns_the_build(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = DiskCache(blocker)   # every path under a file fails to be created
    with pytest.warns(UserWarning):
        assert cache.get_or_build("cubin", digest("k"), lambda: b"built") == b"built"


def test_cubin_key_follows_source_headers_and_arch():
    base = cubin_key("source", "sm_90", TEMPLATE_DIR)
    assert base == cubin_key("source", "sm_90", TEMPLATE_DIR)
    assert base != cubin_key("source ", "sm_90", TEMPLATE_DIR)
    assert base != cubin_key("source", "sm_80", TEMPLATE_DIR)


def test_fingerprint_is_stable_within_a_process():
    assert fingerprint() == fingerprint() and len(fingerprint()) == 64


_BUILD = r"""
import sys
from fagen.compiler import cached_cubin
from fagen.sources import TEMPLATE_DIR
data = cached_cubin(sys.argv[1], "sm_80", TEMPLATE_DIR)
print(len(data))
"""


@pytest.mark.skipif(not nvcc_available(), reason="nvcc is not on PATH")
def test_processes_compiling_the_same_source_at_once_all_succeed_with_one_entry(tmp_path):
    source = '#include "attention_common.cuh"\nextern "C" __global__ void probe_kernel(float* x) { x[0] = 1.f; }\n'
    env = dict(os.environ, FAGEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, source], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outputs]
    sizes = {int(out.strip()) for out, _ in outputs}
    assert len(sizes) == 1 and sizes.pop() > 0
    entries = [p for p in (tmp_path / "cubin").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert len(entries) == 1
    assert len(entries[0].read_bytes()) > DIGEST_BYTES


# ---- a cache that cannot be used costs speed, never the result ----------------------------------------
def recorded(call):
    """(call's result, the messages of the warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


def fake_compile(monkeypatch):
    """cached_cubin's compiler replaced: counts its calls, returns b"ELF:" + the source."""
    calls = []
    monkeypatch.setattr(compiler, "_compile_at_run_time",
                        lambda source, arch, include_dir: calls.append(source) or b"ELF:" + source.encode())
    return calls


def test_missing_home_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    for name in ("FAGEN_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    assert cache_location() == tmp_path / f"fagen-{os.getuid()}"
    calls = fake_compile(monkeypatch)
    assert cached_cubin("kernel one", "sm_80", TEMPLATE_DIR) == b"ELF:kernel one"
    assert stat.S_IMODE((tmp_path / f"fagen-{os.getuid()}").stat().st_mode) == 0o700
    assert cached_cubin("kernel one", "sm_80", TEMPLATE_DIR) == b"ELF:kernel one" and len(calls) == 1, "cached"


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    monkeypatch.delenv("FAGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_location() == tmp_path / ".cache" / "fagen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_location() == tmp_path / "xdg" / "fagen"


def test_a_home_that_cannot_hold_a_cache_warns_once_and_builds_in_memory(tmp_path, monkeypatch):
    for name in ("FAGEN_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "home").write_text("a file, not a folder")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "fagen", "cache_dir() itself never raises"
    calls = fake_compile(monkeypatch)
    built, messages = recorded(lambda: cached_cubin("kernel two", "sm_80", TEMPLATE_DIR))
    assert built == b"ELF:kernel two" and calls == ["kernel two"]
    assert len(messages) == 1 and "cannot be created" in messages[0] and "FAGEN_CACHE_DIR" in messages[0], messages
    again, messages = recorded(lambda: cached_cubin("kernel two", "sm_80", TEMPLATE_DIR))
    assert again == built and messages == [], "one warning per process, not one per kernel"


_EACCES = OSError(errno.EACCES, "Permission denied")


def _failing(real, error=_EACCES, only=None):
    def call(*args, **kwargs):
        if only is None or only(*args):
            raise error
        return real(*args, **kwargs)

    return call


# Each: what fails, and the words of the one warning it gives.
FAULTS = {
    "stat": (os, "stat", "cannot be read"),                   # the folder cannot be looked at
    "mkdir": (os, "mkdir", "cannot be created"),              # a read-only cache folder: no subfolder
    "mkstemp": (tempfile, "mkstemp", "could not store"),      # read-only entry folder
    "replace": (os, "replace", "could not store"),
    "fsync": (os, "fsync", "could not store"),
    "full disk": (os, "fsync", "could not store"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_os_error_is_one_warning_and_the_build_is_returned(tmp_path, monkeypatch, fault):
    module, name, words = FAULTS[fault]
    root = tmp_path / "cache"
    cache = DiskCache(root)
    (root / "cubin").mkdir(parents=True, mode=0o700)   # the root exists: a subfolder must be made
    error = OSError(errno.ENOSPC, "No space left on device") if fault == "full disk" else _EACCES
    monkeypatch.setattr(module, name, _failing(getattr(module, name), error))
    key = digest(fault)
    built, messages = recorded(lambda: cache.get_or_build("cubin", key, lambda: b"built"))
    monkeypatch.undo()
    assert built == b"built"
    assert len(messages) == 1 and words in messages[0], messages
    assert not [p for p in root.rglob("*.tmp")], "no temporary file is left behind"


def test_an_unreadable_entry_is_one_warning_and_rebuilt(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path)
    key = digest("unreadable")
    cache.put("plan", key, b"old")
    monkeypatch.setattr(os, "open", _failing(os.open, only=lambda path, *a: str(path) == str(cache.path("plan", key))))
    built, messages = recorded(lambda: cache.get_or_build("plan", key, lambda: b"new"))
    assert built == b"new"
    assert len(messages) == 1 and "cannot be read" in messages[0], messages


# ---- the trust model: folders and entries another user could write are refused ---------------------------
def plant(cache: DiskCache, kind: str, key: str, payload: bytes, mode: int = 0o600, old_format: bool = False) -> Path:
    """What another user would do: write a well-formed entry under the key a spec hashes to."""
    path = cache.path(kind, key)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    checksum = hashlib.sha256(payload).digest() if old_format else entry_digest(kind, key, payload)
    path.write_bytes(checksum + payload)
    os.chmod(path, mode)
    return path


def test_folders_are_made_0700_and_entries_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        cache = DiskCache(tmp_path / "a" / "cache")
        cache.put("cubin", "ab" * 32, b"payload")
        with cache.lock("plan", "cd" * 32) as lock:
            assert lock.held
    finally:
        os.umask(old)
    folders = [cache.root, cache.root / "cubin", cache.root / "cubin" / "ab", cache.root / "plan" / "cd"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {0o700}
    assert stat.S_IMODE(cache.path("cubin", "ab" * 32).stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_the_issues_poisoned_entry_is_refused(tmp_path, monkeypatch, mode):
    """Another local user writes sha256(evil) + evil (and for good measure a checksum of the current format)
    under the key a spec hashes to, in a file group or others can write: the next compile must not load it."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    calls = fake_compile(monkeypatch)
    cache = DiskCache()
    for old_format in (True, False):
        source = f"the kernel's source, {old_format}"
        key = cubin_key(source, "sm_80", TEMPLATE_DIR)
        path = plant(cache, "cubin", key, b"evil", mode=mode, old_format=old_format)
        loaded, messages = recorded(lambda: cached_cubin(source, "sm_80", TEMPLATE_DIR))
        assert loaded == b"ELF:" + source.encode(), "compiled, not the planted bytes"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes().endswith(loaded), \
            "the rebuilt entry replaced the planted one"
        assert len(messages) == 1 and "writable by" in messages[0] and str(path) in messages[0], messages
    assert len(calls) == 2


def test_an_entry_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path)
    key = digest("foreign")
    path = plant(cache, "cubin", key, b"evil")
    real_fstat = os.fstat
    planted = path.stat().st_ino

    def fstat(fd):   # the file as another user's: tests run as one user, so its owner is faked
        st = real_fstat(fd)
        if st.st_ino != planted:
            return st
        fields = list(st)
        fields[stat.ST_UID] = st.st_uid + 4242
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", fstat)
    found, messages = recorded(lambda: cache.get("cubin", key))
    assert found is None
    assert len(messages) == 1 and "owned by uid" in messages[0], messages


def test_a_cache_folder_owned_by_another_user_is_not_used_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    cache = DiskCache()
    source = "another kernel"
    key = cubin_key(source, "sm_80", TEMPLATE_DIR)
    plant(cache, "cubin", key, b"evil")   # a valid entry: only its owner is wrong
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 4242)   # we are someone else now
    calls = fake_compile(monkeypatch)
    for _ in range(2):
        loaded, messages = recorded(lambda: cached_cubin(source, "sm_80", TEMPLATE_DIR))
        assert loaded == b"ELF:another kernel"
        assert len(messages) == (0 if _ else 1), messages
        if not _:
            assert "owned by uid" in messages[0] and "chown" in messages[0] and "FAGEN_CACHE_DIR" in messages[0]
    assert len(calls) == 2, "no cache: built each time"
    assert cache.path("cubin", key).read_bytes().endswith(b"evil"), "a refused folder is not written either"


@pytest.mark.parametrize("where", ["root", "kind", "key"])
def test_a_group_or_world_writable_folder_is_refused(tmp_path, where):
    cache = DiskCache(tmp_path / "cache")
    key = digest("shared")
    path = plant(cache, "plan", key, b"payload")
    folder = {"root": cache.root, "kind": cache.root / "plan", "key": path.parent}[where]
    os.chmod(folder, 0o777)
    found, messages = recorded(lambda: cache.get("plan", key))
    assert found is None
    assert len(messages) == 1 and "writable by group and others" in messages[0] and "chmod -R go-w" in messages[0]
    assert str(folder) in messages[0]
    refused = "it is writable by group and others (mode 0777), so another user could plant kernels in it"
    assert cache.problem() == {"root": refused, "kind": f"its folder plan/ is refused: {refused}", "key": None}[where]
    os.chmod(folder, 0o700)
    assert cache.get("plan", key) == b"payload", "fixed as the warning says, the entry is used again"


def test_a_symlinked_entry_is_refused(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    key, other = digest("link"), digest("target")
    cache.put("cubin", other, b"payload")
    path = cache.path("cubin", key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(cache.path("cubin", other))
    found, messages = recorded(lambda: cache.get("cubin", key))
    assert found is None and len(messages) == 1 and "symbolic link" in messages[0]


def test_an_entry_copied_to_another_key_fails_its_checksum(tmp_path):
    cache = DiskCache(tmp_path)
    one, two = digest("one"), digest("two")
    cache.put("cubin", one, b"kernel one")
    target = cache.path("cubin", two)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(cache.path("cubin", one).read_bytes())
    with pytest.warns(UserWarning, match="corrupt"):
        assert cache.get("cubin", two) is None
    assert cache.get("cubin", one) == b"kernel one"


def test_an_entry_of_an_older_fagen_is_a_quiet_miss(tmp_path):
    cache = DiskCache(tmp_path)
    key = digest("old")
    plant(cache, "plan", key, b"old", old_format=True)
    built, messages = recorded(lambda: cache.get_or_build("plan", key, lambda: b"new"))
    assert built == b"new" and messages == []
    assert cache.get("plan", key) == b"new"


def test_trusted_file(tmp_path):
    path = tmp_path / "autotune.json"
    assert trusted_file(path) is None, "absent: nothing to trust"
    path.write_text("{}")
    os.chmod(path, 0o644)
    assert trusted_file(path) is None
    os.chmod(path, 0o664)
    assert "writable by group" in trusted_file(path)


# ---- locks: a stuck holder is waited for a bounded time ------------------------------------------------
def test_the_default_lock_timeout_is_at_most_a_minute(monkeypatch):
    monkeypatch.delenv("FAGEN_LOCK_TIMEOUT", raising=False)
    assert 10 <= lock_timeout() == LOCK_TIMEOUT_S <= 60
    monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "2.5")
    assert lock_timeout() == 2.5
    monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "soon")
    with pytest.warns(UserWarning, match="FAGEN_LOCK_TIMEOUT"):
        assert lock_timeout() == LOCK_TIMEOUT_S


_HOLD = r"""
import sys, time
from filelock import FileLock
locks = [FileLock(path) for path in sys.argv[1:]]
for lock in locks:
    lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_stuck_lock_holder_is_given_up_on_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "_gave_up_at", None)   # restored after the test: no shorter waits leak out
    cache = DiskCache(tmp_path)
    key = digest("stuck")
    cache.path("plan", key).parent.mkdir(parents=True, mode=0o700)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(cache.path("plan", key)) + ".lock"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "0.5")
        start = time.monotonic()
        built, messages = recorded(lambda: cache.get_or_build("plan", key, lambda: b"built anyway"))
        assert built == b"built anyway" and time.monotonic() - start < 10
        assert len(messages) == 1 and "may be stuck" in messages[0] and "FAGEN_LOCK_TIMEOUT" in messages[0]
        assert cache.get("plan", key) == b"built anyway", "stored even without the lock (writes are atomic)"
        with pytest.warns(UserWarning, match="may be stuck"):
            with cache.lock("plan", key) as lock:   # the runtime's form (fagen/build.py artifact) never raises
                assert not lock.held
    finally:
        holder.kill()
        holder.wait()
    with cache.lock("plan", key) as lock:
        assert lock.held, "a holder that died released its lock with its process"


# ---- fagen cache's operations -------------------------------------------------------------------------
def test_entries_and_clear_touch_only_fagens_files(tmp_path):
    cache = DiskCache(tmp_path)
    cache.put("cubin", "ab" * 32, b"1" * 10)
    cache.put("plan", "cd" * 32, b"2" * 20)
    (tmp_path / "autotune.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "cubin" / "ab" / "README").write_text("not a key")
    with cache.lock("cubin", "ab" * 32):
        pass
    listed = {(e.kind, e.key, e.size) for e in cache.entries()}
    assert listed == {("cubin", "ab" * 32, 10 + DIGEST_BYTES), ("plan", "cd" * 32, 20 + DIGEST_BYTES),
                      ("autotune", "autotune.json", 2)}
    assert [e.kind for e in cache.entries("plan")] == ["plan"]
    assert cache.clear("plan")[:2] == (1, 20 + DIGEST_BYTES) and not (tmp_path / "plan").exists()
    assert cache.clear()[:2] == (2, 10 + DIGEST_BYTES + 2)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["README", "ab", "cubin", "notes.txt"]


def test_after_one_stuck_lock_the_others_it_holds_cost_seconds_not_a_timeout_each(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "_gave_up_at", None)
    monkeypatch.setattr(cache_module, "STUCK_WAIT_S", 0.3)
    cache = DiskCache(tmp_path)
    plan, cubin = digest("plan"), digest("cubin")
    paths = [cache.path("plan", plan), cache.path("cubin", cubin)]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, *(str(p) + ".lock" for p in paths)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "0.5")
        with pytest.warns(UserWarning, match="may be stuck"):
            with cache.lock("plan", plan) as lock:
                assert not lock.held
        monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "30")
        start = time.monotonic()
        with pytest.warns(UserWarning, match="may be stuck"):
            assert cache.get_or_build("cubin", cubin, lambda: b"built") == b"built"
        assert time.monotonic() - start < 5, "capped at STUCK_WAIT_S, not the 30 s timeout"
    finally:
        holder.kill()
        holder.wait()


_LIVE_HOLD = """
import sys, time
import fagen.cache as cache
cache.HEARTBEAT_S = 0.2
store = cache.DiskCache(sys.argv[1])
with store.lock("plan", sys.argv[2]) as lock:
    assert lock.held
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
    store.put("plan", sys.argv[2], b"built by the holder")
"""


def test_a_live_holder_is_waited_for_past_the_timeout(tmp_path, monkeypatch):
    """A slow build (its holder's heartbeat keeps the lock file fresh) is not mistaken for a stuck one."""
    import subprocess
    import warnings

    cache, key = DiskCache(tmp_path), "ef" * 32
    monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "1")
    holder = subprocess.Popen([sys.executable, "-c", _LIVE_HOLD, str(tmp_path), key, "3"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no "shows no sign of life" warning
            payload = cache.get_or_build("plan", key, lambda: b"built by the waiter")
        assert payload == b"built by the holder" and time.monotonic() - start > 1.5
    finally:
        holder.wait(timeout=30)


_FORK_HOLD = """
import os, sys, time
import fagen.cache as cache
cache.HEARTBEAT_S = 0.2
store = cache.DiskCache(sys.argv[1])
with store.lock("plan", "00" * 32):   # the parent's heartbeat thread starts here, and does not survive a fork
    pass
pid = os.fork()
if pid == 0:
    with store.lock("plan", sys.argv[2]) as lock:
        assert lock.held
        print("held", flush=True)
        time.sleep(float(sys.argv[3]))
        store.put("plan", sys.argv[2], b"built by the child")
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_childs_lock_beats_too(tmp_path, monkeypatch):
    """The heartbeat starts afresh in a forked child (multiprocessing's default on Linux)."""
    cache, key = DiskCache(tmp_path), "fe" * 32
    monkeypatch.setenv("FAGEN_LOCK_TIMEOUT", "1")
    holder = subprocess.Popen([sys.executable, "-c", _FORK_HOLD, str(tmp_path), key, "3"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cache.get_or_build("plan", key, lambda: b"built by the waiter") == b"built by the child"
    finally:
        holder.wait(timeout=30)


def test_a_cache_folder_that_is_a_dangling_link_is_refused_with_a_warning(tmp_path):
    root = tmp_path / "cache"
    root.symlink_to(tmp_path / "gone")
    cache = DiskCache(root)
    with pytest.warns(UserWarning, match="link to a folder that does not exist"):
        assert cache.get_or_build("plan", "ab" * 32, lambda: b"built") == b"built"


def test_problem_reports_an_entry_folder_another_user_could_write(tmp_path):
    cache = DiskCache(tmp_path)
    cache.put("cubin", "ab" * 32, b"x")
    assert cache.problem() is None
    (tmp_path / "cubin").chmod(0o777)
    assert "cubin/" in cache.problem() and "writable" in cache.problem()


def test_fingerprint_reads_every_plan_making_module():
    """The fingerprint that keys cached plans covers each module _PLAN_MODULES names (a folder: its .py files), so
    that a module moved or renamed fails here, not on a GPU's first compile."""
    from pathlib import Path

    from fagen import sources

    here = Path(sources.__file__).resolve().parent
    for name in sources._PLAN_MODULES:
        paths = list((here / name).glob("*.py")) if name.endswith("/") else [here / name]
        assert paths and all(p.is_file() for p in paths), name
