"""Small local files written whole or not at all.

Every file a run writes outside its checkpoints (the run record, metrics.json, --metrics-out,
predictions, a replica's last word to its launcher) goes through `atomic_write`: a reader, or a
run killed while writing, sees the old file or the new one, never half of one. Checkpoints are
folders and get the same guarantee from a rename of the whole folder (storage.py). A Cloud
Storage object needs neither: an upload is whole or nothing.

This module imports nothing of the package's (errors.py, the lowest module, uses it).
"""

import os
import uuid
from pathlib import Path


def atomic_write(path, content, fsync=True):
    """Writes `path`: `content` is a str (written as UTF-8, newlines as given) or a function
    that writes into the open text file. It goes into a temporary file in the same folder, then
    `os.replace` puts it in place in one step. Missing parent folders are made. With `fsync`, the
    data reaches the disk before the rename (so a power cut cannot leave an empty file). Returns
    the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # hidden, and unique per writer: two writers of one path never share a temporary file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", newline="", encoding="utf-8") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
