"""Where a run's files go: a local folder or a Cloud Storage prefix (`gs://bucket/prefix`).

Both keep checkpoints as folders `checkpoints/step-00000123/` and treat one as present only once
its `COMPLETE` marker exists. Locally a checkpoint is written into a hidden `.partial-*` folder and
renamed when whole, so a crash leaves the previous ones untouched; on Cloud Storage its objects are
uploaded first and the marker last (after every host's part, where each host uploads its own
shards).
"""

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from ..core.errors import UserError
from .files import atomic_write

MARKER = "COMPLETE"
SHARDS = "shards"  # a checkpoint's per-host shards (--strategy fsdp on XLA): shards/host-N/
_STEP = re.compile(r"step-(\d+)$")


def is_remote(url):
    """Whether `url` names Cloud Storage (gs://) rather than a local folder."""
    return str(url).startswith("gs://")


def open_store(url):
    return GCSStore(url) if is_remote(url) else LocalStore(url)


def nearest_existing(path):
    """`path`, or its nearest ancestor that exists (where a write to `path` would be decided)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checkpoint_name(step):
    return f"step-{step:08d}"


def complete_steps(store):
    """The steps of the store's complete checkpoints, in order."""
    return sorted(s for s, ok in store.checkpoints().items() if ok)


class LocalStore:
    def __init__(self, path):
        self.root = Path(path)
        self.url = str(path)

    def check_writable(self):
        """Whether the folder can be written (or made), without writing anything."""
        existing = nearest_existing(self.root)
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            return
        reason = "not a folder" if existing.exists() and not existing.is_dir() else "permission denied"
        where = "" if existing == self.root else f" ({existing}: {reason})"
        raise UserError(f"output folder {self.root} is not writable{where or ': ' + reason}")

    def make(self):
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"output folder {self.root} is not writable: {e.strerror}")

    def checkpoint_url(self, name):
        return str(self.root / "checkpoints" / name)

    def checkpoints(self):
        """{step: complete?} for every checkpoint folder (partial ones included)."""
        folder = self.root / "checkpoints"
        found = {}
        for d in folder.iterdir() if folder.is_dir() else ():
            m = _STEP.match(d.name)
            if m:
                found[int(m.group(1))] = (d / MARKER).is_file()
        return found

    def staging(self, name):
        """An empty folder to write checkpoint `name` into before `commit`."""
        folder = self.root / "checkpoints"
        for old in folder.glob(".partial-*"):  # left by a run killed while saving
            shutil.rmtree(old, ignore_errors=True)
        path = folder / f".partial-{name}"
        path.mkdir(parents=True)
        return path

    def part_staging(self, name):
        """Where a process other than the main one writes its part of checkpoint `name` (its
        shards): the main one's staging folder, made before (every process of a run with a local
        folder is on this host: gloo workers)."""
        return self.root / "checkpoints" / f".partial-{name}"

    def drop_part(self, staging):
        """Nothing to drop: the part was written into the checkpoint's own staging folder."""

    def commit(self, staging, name):
        final = self.root / "checkpoints" / name
        if final.exists():  # the same step saved again (e.g. a resumed run's first save)
            shutil.rmtree(final)
        staging.rename(final)  # atomic: the checkpoint appears whole or not at all

    def clear(self, name):
        """Nothing to clear: `staging` starts each save afresh."""

    def upload(self, staging, name):
        """Nothing to upload: every host of a run with a local folder is this one."""

    def fetch(self, name, part=None):
        return self.root / "checkpoints" / name

    def drop_fetched(self, name, part):
        """Nothing to drop: `fetch` copies nothing."""

    def delete(self, name):
        doomed = self.root / "checkpoints" / f".partial-deleted-{name}"
        (self.root / "checkpoints" / name).rename(doomed)  # gone at once, even if the removal is cut short
        shutil.rmtree(doomed, ignore_errors=True)

    def publish(self):
        """Nothing to do: files written into `local_folder()` are already in place."""

    def names(self):
        """The names at the top of the folder."""
        return [p.name for p in self.root.iterdir()] if self.root.is_dir() else []

    def read_text(self, name):
        path = self.root / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def write_text(self, name, text):
        atomic_write(self.root / name, text)

    def put_file(self, path, name):
        """Moves local file `path` to `name` (a relative path, `/`-separated) in the folder."""
        dest = self.root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, dest)

    def remove(self, names):
        for name in names:
            path = self.root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    def local_folder(self):
        """Where the run writes files that `publish` makes final (here: the folder itself)."""
        return self.root


class GCSStore:
    def __init__(self, url):
        bucket, _, prefix = url[len("gs://"):].partition("/")
        if not bucket:
            raise UserError(f"{url} names no bucket: use gs://BUCKET/PREFIX")
        self.url, self.bucket_name, self.prefix = url.rstrip("/"), bucket, prefix.strip("/")
        self._bucket = None
        self._tmp = None

    @property
    def bucket(self):
        if self._bucket is None:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage

            try:
                client = storage.Client()
            except DefaultCredentialsError:
                raise UserError(f"no Google Cloud credentials for {self.url}: run `gcloud auth application-default "
                                "login` or set GOOGLE_APPLICATION_CREDENTIALS")
            self._bucket = client.bucket(self.bucket_name)
        return self._bucket

    def _key(self, *parts):
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what, fn, *args, **kwargs):
        """Runs a Cloud Storage call, turning the errors a user can fix into one line."""
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import DefaultCredentialsError, RefreshError

        try:
            return fn(*args, **kwargs)
        except gexc.NotFound as e:
            if "bucket" in str(e).lower() or not self.bucket.exists():
                raise UserError(f"bucket gs://{self.bucket_name} does not exist")
            raise UserError(f"{what}: not found ({e.message})")
        except gexc.Forbidden as e:
            raise UserError(f"{what} was refused: {e.message}")
        except (DefaultCredentialsError, RefreshError) as e:
            raise UserError(f"no usable Google Cloud credentials for {self.url}: {e}")
        except gexc.GoogleAPICallError as e:
            raise UserError(f"{what} failed: {e.message}")

    def check_writable(self):
        if not self._call(f"reading gs://{self.bucket_name}", self.bucket.exists):
            raise UserError(f"bucket gs://{self.bucket_name} does not exist")
        # A probe per host and process: on a pod every host's parent checks at once, and one
        # host's delete must not remove (or find gone) another's probe.
        blob = self.bucket.blob(self._key(f".xla_train_write_test-{socket.gethostname()}-{os.getpid()}"))
        self._call(f"writing to {self.url}", blob.upload_from_string, b"")

        def delete():
            from google.api_core import exceptions as gexc

            try:
                blob.delete()
            except gexc.NotFound:
                pass  # gone already: the write worked, which is all the probe asks

        self._call(f"writing to {self.url}", delete)

    def make(self):
        """Nothing to make: a prefix exists once an object is under it."""

    def checkpoint_url(self, name):
        return f"{self.url}/checkpoints/{name}"

    def _blobs(self, *parts):
        prefix = self._key(*parts) + "/"
        return self._call(f"listing {self.url}", lambda: list(self.bucket.list_blobs(prefix=prefix)))

    def checkpoints(self):
        found: dict[int, bool] = {}
        base = self._key("checkpoints") + "/"
        for blob in self._blobs("checkpoints"):
            name, _, rest = blob.name[len(base):].partition("/")
            m = _STEP.match(name)
            if m:
                step = int(m.group(1))
                found[step] = found.get(step, False) or rest == MARKER
        return found

    def names(self):
        """The names at the top of the prefix."""
        base = self._key() + "/" if self.prefix else ""
        blobs = self._call(f"listing {self.url}", lambda: list(self.bucket.list_blobs(prefix=base)))
        return sorted({b.name[len(base):].split("/", 1)[0] for b in blobs if b.name[len(base):]})

    def read_text(self, name):
        blob = self.bucket.blob(self._key(name))
        if not self._call(f"reading {self.url}/{name}", blob.exists):
            return None
        return self._call(f"reading {self.url}/{name}", blob.download_as_bytes).decode("utf-8")

    def write_text(self, name, text):
        # no temporary object needed: an upload is whole or nothing
        blob = self.bucket.blob(self._key(name))
        self._call(f"writing {self.url}/{name}", blob.upload_from_string, text.encode("utf-8"))

    def put_file(self, path, name):
        """Uploads local file `path` as `name` (a relative path, `/`-separated) under the prefix."""
        blob = self.bucket.blob(self._key(name))
        self._call(f"writing {self.url}/{name}", blob.upload_from_filename, str(path))

    def remove(self, names):
        base = self._key() + "/" if self.prefix else ""
        for name in names:
            key = base + name
            for blob in self._call(f"listing {self.url}", lambda key=key: list(self.bucket.list_blobs(prefix=key))):
                if blob.name == key or blob.name.startswith(key + "/"):
                    self._call(f"deleting {blob.name}", blob.delete)

    def local_folder(self):
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="xla_train_"))
        return self._tmp

    def staging(self, name):
        path = self.local_folder() / "checkpoints" / f".partial-{name}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def part_staging(self, name):
        """A folder of this process's own for its part of checkpoint `name`, uploaded from it."""
        return self.staging(name)

    def drop_part(self, staging):
        shutil.rmtree(staging, ignore_errors=True)

    def clear(self, name):
        """Deletes what an earlier, interrupted save of checkpoint `name` uploaded (before any host
        uploads its part of this one)."""
        self.delete(name)

    def upload(self, staging, name):
        """Uploads the files of `staging` (a host's part of checkpoint `name`), the marker aside."""
        files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MARKER)
        for f in files:
            blob = self.bucket.blob(self._key("checkpoints", name, *f.relative_to(staging).parts))
            self._call(f"writing {self.checkpoint_url(name)}", blob.upload_from_filename, str(f))

    def commit(self, staging, name):
        """Uploads `staging`, the marker last: the checkpoint exists once it does. `clear` ran first."""
        self.upload(staging, name)
        blob = self.bucket.blob(self._key("checkpoints", name, MARKER))
        self._call(f"writing {self.checkpoint_url(name)}", blob.upload_from_filename, str(staging / MARKER))
        shutil.rmtree(staging, ignore_errors=True)

    def fetch(self, name, part=None):
        """A local copy of checkpoint `name`: of its subfolder `part` only, else of all but its
        hosts' shards (`shards/`, which each host fetches its own of)."""
        dest = self.local_folder() / "checkpoints" / name
        base = self._key("checkpoints", name) + "/"
        for blob in self._blobs("checkpoints", name, *([part] if part else [])):
            rel = blob.name[len(base):]
            if not part and rel.startswith(SHARDS + "/"):
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            self._call(f"reading {blob.name}", blob.download_to_filename, str(dest / rel))
        dest.mkdir(parents=True, exist_ok=True)
        return dest

    def drop_fetched(self, name, part):
        """Removes the local copy of `part` of checkpoint `name` that `fetch` made (a host's shards,
        once loaded)."""
        shutil.rmtree(self.local_folder() / "checkpoints" / name / part, ignore_errors=True)

    def delete(self, name):
        for blob in self._blobs("checkpoints", name):
            self._call(f"deleting {blob.name}", blob.delete)

    def publish(self):
        """Uploads what the run wrote into `local_folder()` (checkpoints are committed on their own)."""
        local = self.local_folder()
        for f in sorted(p for p in local.rglob("*") if p.is_file() and "checkpoints" not in p.relative_to(local).parts):
            self.put_file(f, f.relative_to(local).as_posix())
