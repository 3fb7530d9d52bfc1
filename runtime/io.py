"""Atomic writes: a crash or a kill never leaves a half-written cache or export behind.

`atomic_dir` builds the new directory under a scratch name next to the final one, fsyncs it, then swaps it in:
- over an existing directory with one exchange rename (Linux renameat2 RENAME_EXCHANGE), so at every instant the
  final path holds either the old complete version or the new complete version;
- where the file system cannot exchange (not Linux, or no renameat2), with two renames, old aside then new in; a
  kill between them leaves the old version under `.old-<name>-<pid>`, which the next `atomic_dir` or `recover` on
  that path puts back.
Scratch names carry the writer's pid (`.tmp-<name>-<pid>-*`, `.old-<name>-<pid>`), so leftovers of dead processes
are told apart from a concurrent writer's work and cleaned up.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from torch import Tensor, nn

from runtime.errors import UserError, disk_full, disk_full_error

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def _renameat2():
    """libc's renameat2, or None where it does not exist."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = False
    return getattr(_libc, "renameat2", None) if _libc else None


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step. Returns False where the OS or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root`), so a rename never publishes data still in cache."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftover_pid(entry: str, prefix: str) -> int | None:
    """The writer pid in `<prefix><pid>` or `<prefix><pid>-<random>`, or None if `entry` is not one of ours."""
    if not entry.startswith(prefix):
        return None
    head = entry[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def recover(final: str | os.PathLike) -> None:
    """Clean up after writers of `final` that died: put back an old version a kill left aside (two-rename
    fallback only) and remove their scratch directories. A live writer's files are left alone."""
    final = Path(final).expanduser()
    if not final.parent.is_dir():
        return
    olds, tmps = [], []
    for entry in os.listdir(final.parent):
        for prefix, bucket in ((f".old-{final.name}-", olds), (f".tmp-{final.name}-", tmps)):
            pid = _leftover_pid(entry, prefix)
            if pid is not None and not _pid_alive(pid):
                bucket.append(final.parent / entry)
    for old in olds:
        if not final.exists():
            os.rename(old, final)  # the kill came between "old aside" and "new in": the old version is whole
            fsync_dir(final.parent)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in tmps:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch directory next to `final`; on success it replaces `final` atomically (see the module doc).

    If the body raises, `final` is untouched and the scratch directory is removed; after a kill, it is left under a
    `.tmp-` name that readers never look at and the next writer of `final` removes.
    """
    final = Path(final).expanduser()
    existed = final.exists()
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        recover(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-{os.getpid()}-", dir=final.parent))
    except OSError as e:
        if disk_full(e):
            raise _full(final, existed) from e
        raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the published directory gets the usual mode
    try:
        try:
            yield tmp
            usual_modes(tmp, umask)
            fsync_tree(tmp)
        except Exception as e:  # nothing is published yet: a full disk is the user's to fix, and `final` is as it was
            if disk_full(e) and not isinstance(e, UserError):
                raise _full(final, existed) from e
            raise
        if final.exists() and exchange(tmp, final):
            fsync_dir(final.parent)  # `final` is the new version now; `tmp` holds the old one
            shutil.rmtree(tmp, ignore_errors=True)
        elif final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def usual_modes(root: Path, umask: int) -> None:
    """Give every file under `root` the read and write bits a plain `open` gives under `umask` (0644 under umask 022):
    safetensors writes its files through a private temporary file (0600), which other users of a shared export or
    cache could not read."""
    usual = 0o666 & ~umask
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode | usual != mode:
                os.chmod(path, mode | usual)


def _full(final: Path, existed: bool) -> UserError:
    kept = (f"Nothing was replaced: {final} holds its previous version, whole." if existed else
            f"Nothing was written to {final}.")
    return disk_full_error(final.parent, f"writing {final}", kept)


def refuse_existing(paths: Iterable[str | os.PathLike], replace: bool = False, flag: str = "--force") -> None:
    """A path the user named may hold their own data: unless `replace`, refuse any that exists (the message names
    `flag`, the command's way to say `replace`). Commands call it before their work, so nothing is spent first."""
    for path in map(lambda p: Path(p).expanduser(), paths):
        if path.is_dir():
            raise UserError(f"{path} is a folder; name a file to write.")
        if path.exists() and not replace:
            raise UserError(f"{path} exists, and writing there would replace it. Name a new file, move it away "
                            f"first, or pass {flag} to replace it.")


def write_new_files(texts: dict[str | os.PathLike, str], replace: bool = False, flag: str = "--force") -> None:
    """Write each text to its file through a scratch file renamed into place (a kill leaves the old file or the new
    one, never half of one), after `refuse_existing` on all of them."""
    refuse_existing(texts, replace, flag)
    for path, text in ((Path(p).expanduser(), t) for p, t in texts.items()):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)


# -- shared by every family's export reader (models/families.py; its config keys: models/formats/config.py) ---------

def load_state(net: nn.Module, tensors: dict[str, Tensor], file: Path) -> None:
    """`net.load_state_dict(tensors, strict=True)`, a mismatch refused naming the weights `file`."""
    try:
        net.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise UserError(f"{file} does not match its config.json: {str(e).splitlines()[0]}") from e
