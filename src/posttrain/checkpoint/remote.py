"""Run directories on any fsspec file system (gs://, s3://, memory://, ...).

The run works in a local staging directory; each checkpoint is uploaded
once complete, file by file with its manifest last, so a remote checkpoint
without a manifest is an unfinished upload and is never used. Resuming
downloads the newest remote checkpoint whose files match its manifest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from posttrain.checkpoint.manifest import MANIFEST, STEP_DIR, verify
from posttrain.errors import ConfigError
from posttrain.text.redact import redact_url


def is_url(path: str | None) -> bool:
    return bool(path) and "://" in str(path)


class RemoteRunDir:
    def __init__(self, url: str, staging_root: Path):
        import fsspec

        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"cannot open run directory '{redact_url(url)}': {e} (install the fsspec package for "
                              "that scheme, e.g. gcsfs for gs://, s3fs for s3://)") from e
        self.url = url
        self.local = staging_root / hashlib.sha256(url.encode()).hexdigest()[:16]

    def remote(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def pull(self) -> Path:
        """A fresh local staging directory holding the remote metrics and
        config and the newest remote checkpoint that verifies."""
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
        for name in ("metrics.jsonl", "config.yaml"):
            if self.fs.exists(self.remote(name)):
                self.fs.get(self.remote(name), str(self.local / name))
        for step in sorted(self._remote_steps(), reverse=True):
            rel = f"checkpoints/global_step_{step}"
            target = self.local / rel
            if self._download(rel, target) and verify(target) is None:
                return self.local
            print(f"posttrain: warning: skipping {redact_url(self.url)}/{rel}: incomplete or corrupt",
                  file=sys.stderr)
            shutil.rmtree(target, ignore_errors=True)
        return self.local

    def _remote_steps(self) -> list[int]:
        steps = []
        for path in self.fs.glob(self.remote("checkpoints/global_step_*")):
            m = STEP_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return steps

    def _download(self, rel: str, target: Path) -> bool:
        manifest = self.remote(f"{rel}/{MANIFEST}")
        if not self.fs.exists(manifest):
            return False
        files = json.loads(self.fs.cat_file(manifest))["files"]
        for name in [*files, MANIFEST]:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(self.remote(f"{rel}/{name}"), str(target / name))
        return True

    def push_checkpoint(self, ckpt: Path) -> None:
        rel = f"checkpoints/{ckpt.name}"
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        for name in [*files, MANIFEST]:  # the manifest last: until it lands, the remote copy does not count
            self._put(ckpt / name, f"{rel}/{name}")
        self.push_files()

    def push_files(self) -> None:
        for name in ("metrics.jsonl", "config.yaml"):
            if (self.local / name).exists():
                self._put(self.local / name, name)

    def _put(self, local: Path, rel: str) -> None:
        target = self.remote(rel)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(str(local), target)

    def delete_checkpoint(self, ckpt: Path) -> None:
        # The manifest first: a half-deleted checkpoint must not look valid.
        rel = f"checkpoints/{ckpt.name}"
        if self.fs.exists(self.remote(f"{rel}/{MANIFEST}")):
            self.fs.rm(self.remote(f"{rel}/{MANIFEST}"))
        if self.fs.exists(self.remote(rel)):
            self.fs.rm(self.remote(rel), recursive=True)
