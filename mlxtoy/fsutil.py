"""Atomic file and folder writes: the one way mlxtoy puts anything on disk.

Every writer goes to a temp name next to the target (hidden, with the pid, unique), flushes
and fsyncs it, then renames it over the target in one step, so a reader (or a crash) sees the
old file or the new one, never half of one. Folders (checkpoints, HF and adapter exports) are
written the same way: a temp folder, fsynced, swapped in with renames.

No MLX import: the run-directory module and the TUI use this too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from typing import Iterator


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _usual_mode() -> int:
    # mkstemp creates 0600 (mkdtemp 0700); a finished file gets what `open` would give it
    return 0o666 & ~_umask()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def clean_stale(parent: str, basename: str) -> None:
    """Remove what killed writers of `basename` left in `parent` (their temp names carry
    their pid; a live writer's are kept)."""
    prefix = f".{basename}."
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and is_temp_name(name)):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _remove(os.path.join(parent, name))


@contextlib.contextmanager
def atomic_path(path: str, suffix: str | None = None) -> Iterator[str]:
    """Yield a temp file name beside `path`; on success it is fsynced and renamed to `path`.

    suffix: the temp name's ending (default: the target's extension), for writers such as
    `mx.save_safetensors` that insist on one. On any error the temp file is removed and the
    target is left as it was.
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if suffix is None:
        suffix = os.path.splitext(path)[1]
    clean_stale(parent, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.",
                               suffix=".tmp" + suffix, dir=parent)
    os.close(fd)
    try:
        yield tmp
        fsync_file(tmp)
        mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else _usual_mode()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_bytes_atomic(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def write_text_atomic(path: str, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_folder(path: str) -> Iterator[str]:
    """Yield a temp folder beside `path`; on success its files are fsynced and it replaces
    `path` (an existing folder is swapped out, then removed). On error nothing changes."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    clean_stale(parent, os.path.basename(path))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".tmp", dir=parent)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                fsync_file(os.path.join(root, name))
        fsync_dir(tmp)
        os.chmod(tmp, _usual_mode() | (0o111 & ~_umask()))
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".old", dir=parent)
            os.replace(path, os.path.join(old, "x"))
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def is_temp_name(name: str) -> bool:
    """A leftover of a killed writer (`atomic_path` / `atomic_folder`)."""
    return name.startswith(".") and (".tmp" in name or name.endswith(".old"))


def clean_temp(folder: str) -> int:
    """Remove leftovers of killed writers in `folder`; returns how many were removed."""
    n = 0
    if not os.path.isdir(folder):
        return 0
    for name in os.listdir(folder):
        if is_temp_name(name):
            _remove(os.path.join(folder, name))
            n += 1
    return n
