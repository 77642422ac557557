"""Checkpoint policies, one small unit each: how a layer's call runs and what it holds.

A policy (`Policy`) says whether the layer is checkpointed, where its input waits for backward,
what torch's checkpoint needs to run it, and what it costs in the terms the planner measures.
The map (`remat.plan`) gives each layer one policy by name; the installed shim
(`remat.recompute.LayerCheckpoint`) runs the layer the way its policy says.

Adding a policy is one file in this package plus its line in `REGISTRY` below. This package is
light on purpose (no torch at import): `remat.config` and `remat.plan` use it.
"""

from __future__ import annotations

from .base import Cost, LayerProfile, Policy
from .none import NONE
from .recompute import OFFLOAD, RECOMPUTE
from .selective import SELECTIVE

REGISTRY: dict[str, Policy] = {policy.name: policy for policy in (NONE, RECOMPUTE, OFFLOAD, SELECTIVE)}
NAMES = tuple(REGISTRY)
CHECKPOINTED = tuple(name for name, policy in REGISTRY.items() if policy.checkpointed)
CHECKPOINT_POLICIES = ("recompute", "offload", "selective")
"""What `CheckpointConfig.checkpoint_policy` may choose for every checkpointed layer."""


def policy(name: str) -> Policy:
    return REGISTRY[name]


__all__ = ["CHECKPOINTED", "CHECKPOINT_POLICIES", "NAMES", "REGISTRY", "Cost", "LayerProfile", "Policy", "policy"]
