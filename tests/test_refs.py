"""remat holds the model and its layers weakly (`remat.refs`): one freed while remat still uses it
is a RuntimeError that names it, also through a reference that was pickled dead."""

import pickle

import pytest
from torch import nn

from remat.layers import DiscoveredLayer
from remat.refs import Ref


def test_a_freed_layer_is_named_in_the_error():
    block = nn.Linear(2, 2)
    layer = DiscoveredLayer("model.layers.3", block)
    assert layer.module is block
    del block
    with pytest.raises(RuntimeError, match=r"remat: layer model\.layers\.3 of the wrapped model no longer exists"):
        _ = layer.module


def test_a_reference_pickled_dead_says_so_too():
    dead = pickle.loads(pickle.dumps(Ref(nn.Linear(2, 2))))  # the target is freed before the pickle
    assert dead() is None
    with pytest.raises(RuntimeError, match="remat: the model is gone"):
        dead.alive("the model is gone")
