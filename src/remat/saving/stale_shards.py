"""transformers' `save_pretrained` removes an earlier save's shards the new one does not rewrite;
staged, it would see an empty folder. So each shard-like file of the target gets an empty
stand-in in the staging folder; the stand-ins transformers removed name the files to remove from
the target once committed, and those it left are dropped. The folder ends as transformers' own
save would leave it, whatever its version's rule.
"""

from __future__ import annotations

import contextlib
import os
import re

from .files import CLOEXEC, NOFOLLOW
from .folder import STAGING_PREFIX

_SHARD_LIKE = re.compile(r"-\d{5}-of-\d{5}")  # transformers only ever removes such files


class StaleShards:
    def __init__(self, target: str):
        self.target = target
        self.candidates = _shard_like_files(target)
        self.removed: list[str] = []

    def place(self, staging: str) -> None:
        for name in self.candidates:
            fd = os.open(os.path.join(staging, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
            os.close(fd)

    def collect(self, staging: str) -> None:
        self.removed = []
        for name in self.candidates:
            path = os.path.join(staging, name)
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                self.removed.append(name)
                continue
            if info.st_size == 0 and os.path.isfile(path) and not os.path.islink(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _shard_like_files(target: str) -> list[str]:
    try:
        names = os.listdir(target)
    except FileNotFoundError:
        return []
    return sorted(
        n
        for n in names
        if _SHARD_LIKE.search(n) and not n.startswith(STAGING_PREFIX) and os.path.isfile(os.path.join(target, n))
    )
