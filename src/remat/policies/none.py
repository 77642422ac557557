""" "none": the layer keeps its activations for backward. Fastest; holds the most."""

from .base import Policy

NONE = Policy(
    name="none",
    checkpointed=False,
    input_on_host=False,
)
