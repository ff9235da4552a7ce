"""Run, checkpoint and weight paths on a local disk or an object store (gs://, s3://, ...) through etils.epath,
the path library Orbax uses: local paths behave as plain files; a URI is never resolved against the working
directory (os.path.abspath("gs://b/run") would be "<cwd>/gs:/b/run").

Object stores replace whole objects and cannot append: `append_text` rewrites a remote object with the new text at
its end, which costs a transfer of the whole object per call. Libraries that read and write local folders only
(transformers' and the safetensors folders of `save_pretrained`) go through `local_folder` and `local_copy`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

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


@contextlib.contextmanager
def local_folder(path: str | os.PathLike) -> Iterator[str]:
    """A local folder for writing the folder `path` with a library that writes local files only: `path` itself when
    local; else a temporary folder, copied to `path` when the block ends without an exception."""
    if is_local(path):
        yield os.fspath(path)
        return
    with tempfile.TemporaryDirectory(prefix="ipa_jax_upload_") as tmp:
        yield tmp
        copy_tree(tmp, path)


@contextlib.contextmanager
def local_copy(path: str | os.PathLike) -> Iterator[str]:
    """The folder `path` as a local folder, for a library that reads local files only: `path` itself when local;
    else a temporary copy, removed when the block ends."""
    if is_local(path):
        yield os.fspath(path)
        return
    with tempfile.TemporaryDirectory(prefix="ipa_jax_download_") as tmp:
        copy_tree(path, tmp)
        yield tmp


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies every file under the folder `src` to the same relative path under `dst` (either may be a URI)."""
    source = epath.Path(src)
    for folder, _, files in source.walk():
        target = epath.Path(dst) / os.path.relpath(os.fspath(folder), os.fspath(source))
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with (folder / name).open("rb") as reader, (target / name).open("wb") as writer:
                shutil.copyfileobj(reader, writer)
