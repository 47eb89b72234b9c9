"""Whether a file in rayguide's cache is this user's alone, in the lowest layer so every
tier that loads from the cache can ask: the grammar disk tier (grammar_cache/disk.py) and
the worker's kernels and converted models. What rayguide loads from its cache runs in or
steers its processes: anyone who could write there could replace it."""

from __future__ import annotations

import os
from pathlib import Path


def check_private(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Raises PermissionError unless ``path`` and every folder from ``root`` down to it are
    owned by this user and writable by no one else (a path outside ``root``: the path
    itself). A missing path passes (there is nothing to load)."""
    root, path = Path(root), Path(path)
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        chain = [path]
    else:
        chain = [root] + [root.joinpath(*parts[:i + 1]) for i in range(len(parts))]
    for item in chain:
        try:
            st = item.stat()
        except FileNotFoundError:
            return
        if st.st_uid != os.getuid():
            problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
        elif st.st_mode & 0o022:
            problem = f"is writable by its group or others (mode {st.st_mode & 0o777:o})"
        else:
            continue
        raise PermissionError(
            f"{item} {problem}: rayguide loads kernels, models and grammars from its cache "
            f"({root}) only when they are this user's alone. Fix it (`chmod go-w {item}` "
            "or `chown`), or set RAYGUIDE_CACHE_DIR to a private folder")


def make_private_dirs(folder: str | os.PathLike, root: str | os.PathLike) -> None:
    """Creates ``folder`` and the missing folders from ``root`` down to it with mode 0755
    whatever the umask (``mkdir -p`` gives a umask-002 user group-writable folders, which
    ``check_private`` then refuses)."""
    root, folder = Path(root), Path(folder)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        parts = folder.relative_to(root).parts
    except ValueError:
        root, parts = folder, ()
    for item in [root] + [root.joinpath(*parts[:i + 1]) for i in range(len(parts))]:
        try:
            item.mkdir(mode=0o755)
            item.chmod(0o755)  # mkdir's mode is masked by the umask
        except FileExistsError:
            pass
