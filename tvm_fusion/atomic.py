"""Write a file so that a crash leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as :func:`atomic_write_bytes` does."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` as :func:`atomic_write_with` does."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    atomic_write_with(path, write)


def atomic_write_with(path: str | os.PathLike, write: Callable[[str], None],
                      suffix: str = ".tmp") -> None:
    """Have ``write(tmp)`` produce the file at a temporary path in ``path``'s folder, then
    ``os.replace`` it over ``path`` (atomic on POSIX and Windows within one file system) and
    fsync the folder so the rename itself survives a power cut. A reader sees the old content
    or the new, never a torn write. The file gets the permissions a plain ``open`` would give
    (mkstemp's 0600 would hide it from others). ``suffix``: for writers that go by the name's
    ending (TVM's ``export_library`` links a ``.so``)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix, dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be opened
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not support it; the rename is still atomic
        pass
    finally:
        os.close(fd)
