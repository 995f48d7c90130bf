"""A small map kept on disk, for facts that take a process seconds to find and are fixed by their key.

Note [Facts remembered across processes]
Rationale: every process vkv starts (`vkv serve`, a replica, a tensor-parallel rank, a test's
child) used to find the same facts again: which class AutoTokenizer picks for a directory (2.3 s
of transformers' config machinery, of a ~7 s start on 2 Zen 1 cores) and the SHA-256 of the
bundled 93 MiB GGUF (0.23 s). Found once, they hold for as long as their inputs do.

Approach: a DiskMemo is one JSON object in $VKV_CACHE_DIR (string keys, string values). A key
names everything its value depends on (a file's identity, a directory's digest, a library's
version), so an entry is never stale: a changed input is another key, and an old entry is only
dead weight, dropped once the map holds more than MAX_ENTRIES.

Implementation: `get` reads the file each time (a few kilobytes); `put` reads it, adds the entry
and writes it whole through a temporary file and a rename. Two writers at once lose at most one
of their entries (found again next time), never the file. Anything at the path but a regular
file of JSON under MAX_BYTES reads as empty; a cache directory that cannot be written leaves the
memo empty and says so at debug level: a memo never stops a process, it only spares it work. Its
readers check what an entry says before they act on it (the file is only the user's cache).

Limitations: no locking and no expiry beyond MAX_ENTRIES; values must be small (the whole map is
rewritten by each put).
"""
from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger("vkv.models")

MAX_ENTRIES = 512
MAX_BYTES = 4 << 20  # a file larger than MAX_ENTRIES small entries can be: not a memo


class DiskMemo:
    def __init__(self, path: Path):
        self.path = path

    def get(self, key: str) -> str | None:
        value = self._read().get(key)
        return value if isinstance(value, str) else None

    def put(self, key: str, value: str) -> None:
        entries = self._read()
        entries.pop(key, None)
        entries[key] = value  # the newest last: the oldest go first
        entries = dict(list(entries.items())[-MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(entries, out)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.debug("vkv: cannot write %s (%s): nothing remembered", self.path, exc)

    def _read(self) -> dict:
        """The map, or {} for anything else at the path (missing, not a regular file (a FIFO would
        block the read), too large, not JSON, nested past the parser's depth)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
                    return {}
                entries = json.loads(f.read(MAX_BYTES + 1))
        except (OSError, ValueError, RecursionError):
            return {}
        return entries if isinstance(entries, dict) else {}
