"""An on-disk cache of measured profiles, so a second planning run of the same model is fast.

One JSON file per (graph fingerprint, device identity) in the cache directory, named
`<fingerprint>-<hash of the device identity>.json`:

    {"format": "rannc-profile-cache", "version": 1, "fingerprint": "...", "device": "...",
     "entries": {"<block hash>@<batch>": [fwd_s, bwd_s, kept_bytes, work_bytes], ...}}

The block hash names the set of atomic components measured together (`block_key`), so a
different coarsening reuses whatever blocks it shares with an earlier one. Writes merge with
what is on disk (several ranks or runs may share a directory) and land atomically through
`os.replace`, so a reader never sees half a file. A file that is corrupt, of another format or
version, or written for another graph or device is ignored with a log line and never raises;
so is a malformed entry. Only finite measurements are stored: an out-of-memory result depends
on what else held device memory at the time, so it is measured again next run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "rannc-profile-cache"
VERSION = 1

Entry = tuple[float, float, float, float]  # forward s, backward s, kept bytes, work bytes


def block_key(components: Iterable[int]) -> str:
    """A short stable hash of a block's membership (its atomic component indices)."""
    text = ",".join(str(c) for c in sorted(components))
    return hashlib.sha1(text.encode()).hexdigest()[:20]


class ProfileCache:
    """Measured entries of one graph on one device, backed by one JSON file in `directory`."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str, device: str) -> None:
        self.directory = os.fspath(directory)
        self.fingerprint = fingerprint
        self.device = device
        dev_hash = hashlib.sha1(device.encode()).hexdigest()[:12]
        self.path = os.path.join(self.directory, f"{fingerprint}-{dev_hash}.json")
        self._entries: dict[str, Entry] = self._read()
        self._dirty = False

    @staticmethod
    def key(block: str, batch: int) -> str:
        return f"{block}@{int(batch)}"

    def get(self, block: str, batch: int) -> Entry | None:
        return self._entries.get(self.key(block, batch))

    def put(self, block: str, batch: int, entry: Entry) -> None:
        if all(math.isfinite(x) for x in entry):
            self._entries[self.key(block, batch)] = tuple(float(x) for x in entry)  # type: ignore[assignment]
            self._dirty = True

    def __len__(self) -> int:
        return len(self._entries)

    # -- disk ----------------------------------------------------------------------------------
    def _read(self, quiet: bool = False) -> dict[str, Entry]:
        """The valid entries on disk; `quiet` when the first read already reported a bad file."""
        warn = log.debug if quiet else log.warning
        if not os.path.exists(self.path):
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            warn("rannc: ignoring unreadable profile cache file %s: %s", self.path, e)
            return {}
        why = self._foreign(data)
        if why:
            warn("rannc: ignoring profile cache file %s: %s", self.path, why)
            return {}
        out: dict[str, Entry] = {}
        bad = 0
        for k, v in data["entries"].items():
            if (isinstance(k, str) and isinstance(v, list) and len(v) == 4
                    and all(isinstance(x, int | float) and not isinstance(x, bool)
                            and math.isfinite(x) and x >= 0 for x in v)):
                out[k] = (float(v[0]), float(v[1]), float(v[2]), float(v[3]))
            else:
                bad += 1
        if bad:
            warn("rannc: ignoring %d malformed entries in profile cache file %s", bad, self.path)
        return out

    def _foreign(self, data: Any) -> str:
        """Why `data` is not a cache for this graph and device ('' when it is)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return "not a rannc profile cache"
        if data.get("version") != VERSION:
            return f"cache version {data.get('version')!r}, expected {VERSION}"
        if data.get("fingerprint") != self.fingerprint:
            return f"written for graph {data.get('fingerprint')!r}, not {self.fingerprint!r}"
        if data.get("device") != self.device:
            return f"written for device {data.get('device')!r}, not {self.device!r}"
        if not isinstance(data.get("entries"), dict):
            return "no entries table"
        return ""

    def flush(self) -> None:
        """Merge with the file on disk (another process may have added entries) and replace it
        atomically. Failing to write only logs: the cache is an optimisation."""
        if not self._dirty:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            merged = {**self._read(quiet=True), **self._entries}
            data = {"format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
                    "device": self.device,
                    "entries": {k: list(v) for k, v in sorted(merged.items())}}
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=0)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._entries = merged
            self._dirty = False
        except OSError as e:
            log.warning("rannc: could not write profile cache file %s: %s", self.path, e)



__all__ = ["ProfileCache", "block_key"]
