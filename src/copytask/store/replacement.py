"""Replacing a complete run's results with new ones (`retrain=true`, or a run computed by other code)
without ever losing them, whatever stops the process, kill -9 included.

The new run trains in a staging folder beside the run's, `.<run>.new` (a dot folder: no listing of
runs sees it), while every reader (compare, report, results, a run's status) finds the old results
where they were. Once the new results are complete, the two folders trade places in one step
(`exchange`) and the old results are deleted. The run's lock covers both folders: only the process
that holds it touches either.

Which folder holds the new results is never a guess: they carry the file MARK from the moment their
staging folder is made until the old results are gone. After a kill, the next process to take the
run's lock calls `settle`, which finishes what was begun:

- `<run>` (old, complete) and `.<run>.new` marked: the replacement goes on (from its checkpoint, or,
  complete, straight to the swap); readers have the old results meanwhile.
- `<run>` marked (swapped in) and `.<run>.new` unmarked (the old results, maybe half deleted): the old
  results are deleted, then the mark.
- `<run>` marked and nothing beside it: the mark is removed.
- `.<run>.new` unmarked beside an unmarked `<run>` (killed before the mark was written): deleted.
- Where the file system cannot swap in one step (NFS, another OS), two renames do it: `<run>` to
  `.<run>.replaced`, then `.<run>.new` to `<run>`. Killed between them (no `<run>`), the swap is
  finished; after them, `.<run>.replaced` is deleted.
- `.<run>.new` marked beside no complete `<run>` (deleted by hand): nothing to replace, deleted; the run
  trains in `<run>`.
- `.<run>.replaced` beside an incomplete `<run>`: what copytask up to 4888ec2 left (its retraining
  trained in `<run>`, the old results set aside): the retraining moves to `.<run>.new` and the old
  results go back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path

from . import folders

MARK = "replacement"  # in the folder that holds the new results, from its making until the old results are gone
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
NOT_SUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # what renameat2 says where it cannot


def staging(folder: Path) -> Path:
    """Where the replacement of the run in `folder` trains: a dot folder beside it."""
    return folder.with_name(f".{folder.name}.new")


def set_aside(folder: Path) -> Path:
    """Where a swap of two renames puts the old results (and where copytask put them before)."""
    return folder.with_name(f".{folder.name}.replaced")


def marked(folder: Path) -> bool:
    """Whether `folder` holds the new results of a replacement."""
    return (folder / MARK).is_file()


def pending(folder: Path) -> bool:
    """Whether a replacement of the run in `folder` has begun and not yet taken its place."""
    return marked(staging(folder))


def begin(folder: Path) -> Path:
    """The staging folder of the run in `folder`'s replacement, marked: as a stopped replacement left
    it (it goes on from there), or new."""
    new = staging(folder)
    new.mkdir(exist_ok=True)
    if not marked(new):
        mark(new)
    return new


def mark(folder: Path) -> None:
    folders.atomic_write(folder / MARK, "the new results of a run: they replace its old ones once complete\n")


def failure_folder(folder: Path) -> Path:
    """Where a failed job of the run in `folder` is recorded: beside the replacement where complete
    results exist (they stay complete, not failed), else in `folder`."""
    return staging(folder) if folders.is_complete(folder) else folder


def swap(folder: Path) -> None:
    """Put the complete new results (the staging folder's) in `folder`'s place, in one step where the
    file system can, and delete the old ones."""
    if not exchange(folder, staging(folder)):  # killed between the renames, there is no <run> until `settle`
        folder.rename(set_aside(folder))
        staging(folder).rename(folder)
    settle(folder)


def settle(folder: Path) -> None:
    """Finish what a stopped replacement of the run in `folder` left half done (the states in this
    module's docstring): then `folder` holds the run's results (complete or not), no mark, and at most
    a marked staging folder waits beside it. Only under the run's lock."""
    new, old = staging(folder), set_aside(folder)
    if old.exists():
        if folder.exists() and not folders.is_complete(folder):  # copytask up to 4888ec2: the retraining in <run>
            mark(folder)
            folder.rename(new)
        if not folder.exists():  # the old results come back, or a complete replacement takes their place
            (new if marked(new) and folders.is_complete(new) else old).rename(folder)
        if old.exists():
            shutil.rmtree(old)
    if new.exists() and not marked(new):  # the old results, swapped out; or a staging folder killed before its mark
        shutil.rmtree(new)
    if marked(folder):  # swapped in, and the old results are gone
        (folder / MARK).unlink()
    if marked(new) and not folders.is_complete(folder):  # nothing to replace (<run> deleted by hand): trains in <run>
        shutil.rmtree(new)
    if folders.is_complete(folder):  # copytask up to 4888ec2 recorded a failed retraining here, beside the results
        (folder / folders.FAILED).unlink(missing_ok=True)


def exchange(first: Path, second: Path) -> bool:
    """Trade the names of directories `first` and `second` in one step: Linux's renameat2 with
    RENAME_EXCHANGE, through ctypes. False, with nothing changed, where this OS, its C library (glibc
    before 2.28) or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    if (error := ctypes.get_errno()) in NOT_SUPPORTED:
        return False
    raise OSError(error, os.strerror(error), str(first), None, str(second))
