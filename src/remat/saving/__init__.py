"""Saving and loading: the pair (PEFT's adapters + `checkpoint_config.json`) and the folder it
lives in. One job per file, data flowing down:

- `files`: atomic writes (with the umask's permissions), strict JSON reads, fingerprints.
- `locks`: file locks from `filelock` on descriptors remat opens itself (no symlink followed).
- `folder`: the folder transaction (staging, lock, commit, recovery) with the one save
  (`save_pair`) and the one load (`read_pair`); it knows files, not models.
- `stale_shards`: transformers' clean-up of an earlier save's weight shards, for a staged save.
- `peft_names`: PEFT's file names and folder layout, taken from PEFT.
- `pair_format`: what `checkpoint_config.json` holds (config, layers, architecture, the
  fingerprints of every file PEFT reads) and the checks a load makes before anything changes.
- `rollback`: what loading adapters may change on a model, recorded and put back.
- `peft_loading`: loading the checked adapters through PEFT.
- `overrides`: the model's own `save_pretrained` / `load_adapter` while it is wrapped.

`remat.persistence` joins them for the wrapper. This package imports nothing above it.
"""

from .files import read_json_object, sha256_file, write_file_atomically
from .folder import CONFIG_NAME, STAGING_PREFIX

__all__ = ["CONFIG_NAME", "STAGING_PREFIX", "read_json_object", "sha256_file", "write_file_atomically"]
