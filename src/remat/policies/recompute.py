""" "recompute" and "offload": the layer keeps only its input and runs again in backward.

"offload" is the same recompute with the input waiting in host memory (`remat.offload` moves
it out after the next checkpointed layer starts, and back one layer ahead of backward).
"""

from .base import Policy

RECOMPUTE = Policy(
    name="recompute",
    checkpointed=True,
    input_on_host=False,
)

OFFLOAD = Policy(
    name="offload",
    checkpointed=True,
    input_on_host=True,
)
