"""Run, checkpoint and weight paths on a local disk or an object store (gs://, s3://, ...) through etils.epath,
the path library Orbax uses: local paths behave as plain files; a URI is never resolved against the working
directory (os.path.abspath("gs://b/run") would be "<cwd>/gs:/b/run").

Object stores replace whole objects and cannot append: `append_text` rewrites a remote object with the new text at
its end, which costs a transfer of the whole object per call.
"""

from __future__ import annotations

import os

from etils import epath


def is_local(path: str | os.PathLike) -> bool:
    """Whether `path` is on the local filesystem (no scheme://)."""
    return "://" not in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute; a URI unchanged."""
    return os.path.abspath(path) if is_local(path) else os.fspath(path)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replaces the file with `text` so that a reader sees the old contents or the new, never a part: a local file
    through a renamed temporary file; an object store writes an object whole by itself. Creates parent folders."""
    target = epath.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not is_local(path):
        target.write_text(text, encoding="utf-8")
        return
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Adds `text` at the end of the file (creating it and its parent folders)."""
    target = epath.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_local(path):
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
    else:
        target.write_text((target.read_text(encoding="utf-8") if target.exists() else "") + text, encoding="utf-8")
