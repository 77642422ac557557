"""The clean-up transformers' `save_pretrained` makes in the folder it saves into, for a save
that writes into a staging folder instead.

Before writing, transformers removes from its save folder the weight shards of an earlier save
that the new one does not rewrite (`model-00003-of-00003.safetensors` when the new save has two
shards, every shard when it has one file). Staged, it would look at an empty folder: the old
shards would stay beside the new index. So transformers decides on stand-ins: before the
model's save, each file at the top of the target that is named like a shard gets an empty
stand-in of the same name in the staging folder; after it, the stand-ins transformers removed
name the files to remove from the target, once the new save is committed (under the same lock,
`remat.saving.folder.save_pair`'s `remove`). A stand-in transformers left is removed before the
commit (a shard it wrote over one is never empty: it is committed). So the folder ends as
transformers' own save would leave it, whatever its version's rule, and a user's other files
stay.
"""

from __future__ import annotations

import contextlib
import os
import re

from .files import CLOEXEC, NOFOLLOW
from .folder import STAGING_PREFIX

_SHARD_LIKE = re.compile(r"-\d{5}-of-\d{5}")
"""A shard's numbering, as transformers writes it (`-00001-of-00002`): the files worth a stand-in
(transformers' own rule, which decides, only ever removes such files)."""


class StaleShards:
    """The shard-like files at the top of `target` and, after the model's save, those of them
    transformers removed."""

    def __init__(self, target: str):
        self.target = target
        self.candidates = _shard_like_files(target)
        self.removed: list[str] = []

    def place(self, staging: str) -> None:
        """An empty stand-in in `staging` for each candidate."""
        for name in self.candidates:
            fd = os.open(os.path.join(staging, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
            os.close(fd)

    def collect(self, staging: str) -> None:
        """Note the stand-ins transformers removed; remove those it left (not part of the save)."""
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
