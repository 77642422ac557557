"""torch.compile traces a checkpointed layer whole, as it traces torch's own checkpoint: the layer's
ops land in the compiled graph and backward recomputes them there. Judged by what the compiled
graphs hold and what they save for backward, against transformers' own checkpointing compiled the
same way, and by gradients against an uncompiled run without checkpointing. The backend is AOT
autograd without code generation (inductor takes minutes on a CPU and reorders fp32 sums)."""

from pathlib import Path

import pytest
import torch
from conftest import add_lora, assert_same_grads, batch, step_grads, tiny_model
from test_remote_code import blocks, load_remote
from torch._dynamo.backends.common import aot_autograd

from remat import CheckpointConfig, CheckpointedModel
from remat.testing import SimulatedTransport


class _CountingBackend:
    """AOT autograd that runs its graphs eagerly, counting the matmuls in the forward and backward graphs."""

    def __init__(self):
        self.matmuls = {"forward": 0, "backward": 0}
        self.backend = aot_autograd(fw_compiler=self._counter("forward"), bw_compiler=self._counter("backward"))

    def _counter(self, kind):
        def compiler(graph_module, example_inputs):
            self.matmuls[kind] += sum(
                1 for n in graph_module.graph.nodes if n.op == "call_function" and "mm" in str(n.target)
            )
            return graph_module.forward

        return compiler


def _compiled_step(call):
    """One compiled training step: the bytes its forward saved for backward, and the graphs' matmuls."""
    torch._dynamo.reset()
    counting = _CountingBackend()
    compiled = torch.compile(call, backend=counting.backend)
    saved = [0]

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled(**batch()).loss
    loss.backward()
    torch._dynamo.reset()
    return saved[0], counting.matmuls


def _lora():
    return add_lora(tiny_model(num_hidden_layers=2), dropout=0.0)


def _trainable(model):
    return model, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def test_compiled_checkpointed_layers_are_in_the_graph_and_save_what_native_checkpointing_saves():
    plain_saved, plain_matmuls = _compiled_step(_lora())
    native = _lora()
    native.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    native_saved, native_matmuls = _compiled_step(native)
    recompute_saved, recompute_matmuls = _compiled_step(CheckpointedModel(_lora(), CheckpointConfig()))
    selective = CheckpointConfig(layer_policies=dict.fromkeys(range(2), "selective"))
    selective_saved, selective_matmuls = _compiled_step(CheckpointedModel(_lora(), selective))

    # every layer's matmuls are compiled (remat's shim used to break the graph: the layers ran eagerly)
    assert recompute_matmuls["forward"] == selective_matmuls["forward"] == plain_matmuls["forward"] > 2 * 7
    # backward recomputes in the compiled graph, selective fewer matmuls (it keeps the projections)
    assert plain_matmuls["backward"] < selective_matmuls["backward"] < recompute_matmuls["backward"]
    assert recompute_saved == native_saved < selective_saved < plain_saved


@pytest.mark.parametrize(
    "policy, reentrant",
    [("recompute", False), ("recompute", True), ("selective", False), ("offload", False), ("offload", True)],
)
def test_compiled_checkpointing_is_exact_and_counts_an_moe_routers_tokens_once(tmp_path: Path, policy, reentrant):
    """A remote-code MoE whose router counts tokens in a buffer and calls in an int (Dynamo cannot
    trace such a layer whole and runs it as before): gradients exact, counters as without
    checkpointing."""
    plain = load_remote(tmp_path, num_experts=4, dropout=0.0)
    _, expected = step_grads(plain, list(plain.named_parameters()), batch())
    tokens = [b.mlp.tokens_per_expert.clone() for b in blocks(plain)]
    model = load_remote(tmp_path, num_experts=4, dropout=0.0)
    config = CheckpointConfig(
        layer_policies=dict.fromkeys(range(4), policy), use_reentrant=reentrant, offload_min_bytes=0
    )
    cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
    torch._dynamo.reset()
    compiled = torch.compile(cm, backend="aot_eager")
    try:
        for _ in range(2):
            assert_same_grads(expected, step_grads(compiled, list(model.named_parameters()), batch())[1])
    finally:
        torch._dynamo.reset()
    for block, counted in zip(blocks(model), tokens, strict=True):
        assert torch.equal(block.mlp.tokens_per_expert, 2 * counted) and block.mlp.calls == 2


def test_compiled_offload_moves_what_it_moves_uncompiled_with_exact_gradients():
    config = CheckpointConfig(layer_policies={0: "offload", 1: "recompute"}, offload_min_bytes=0)
    _, expected = step_grads(*_trainable(_lora()), batch())
    moved = []
    for compile_it in (False, True):
        model, named = _trainable(_lora())
        cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
        torch._dynamo.reset()
        call = torch.compile(cm, backend="aot_eager") if compile_it else cm
        try:
            for _ in range(2):
                assert_same_grads(expected, step_grads(call, named, batch())[1])
        finally:
            torch._dynamo.reset()
        moved.append(
            {i: (s.offloaded_bytes, s.copies_to_host, s.copies_to_device) for i, s in cm.offload_stats.items()}
        )
    assert moved[0] == moved[1] and all(v[1:] == (2, 2) for v in moved[0].values())


def test_a_budget_under_compile_measures_plans_and_trains_exactly():
    """The budget's first step measured and planned inside the model's forward pre-hook, which dynamo traced: the
    first step of `torch.compile(cm)` (and Trainer's torch_compile=True) failed with 'weak object has gone away'.
    It runs eagerly; each bucket gets its own map, and gradients equal an uncompiled run without checkpointing."""
    profile = CheckpointedModel(_lora()).profile(batch(size=2, seq=16), repeats=1, progress=False)
    budget = max(p.predicted_device_bytes for p in profile.frontier(tokens=32))  # all "none" fits 32 tokens, not 128
    plain, model = _lora(), _lora()
    cm = CheckpointedModel(model, CheckpointConfig(budget=budget, budget_scope="activations"))
    torch._dynamo.reset()
    compiled = torch.compile(cm, backend="aot_eager")
    try:
        for seq in (8, 64):
            data = batch(size=2, seq=seq)
            _, expected = step_grads(*_trainable(plain), data)
            assert_same_grads(expected, step_grads(compiled, _trainable(model)[1], data)[1])
    finally:
        torch._dynamo.reset()
    policies = {r.bucket_tokens: r.policies for r in cm.budget_receipts}
    assert len(policies) == 2 and "recompute" in policies[max(policies)] and set(policies[min(policies)]) == {"none"}


def test_the_chunked_head_under_compile_with_dynamic_shapes_trains_exactly():
    """`torch.compile(cm, dynamic=True)` (lengths that change each step, as in RL loops) failed the first training
    forward with labels: dynamo traced the head row's bookkeeping and could not compare it. (One layer, one step:
    a compile with dynamic shapes takes seconds per layer.)"""
    plain, model = (add_lora(tiny_model(num_hidden_layers=1), dropout=0.0) for _ in range(2))
    cm = CheckpointedModel(model, CheckpointConfig(head="chunked", head_chunk_tokens=32))
    torch._dynamo.reset()
    compiled = torch.compile(cm, backend="aot_eager", dynamic=True)
    try:
        data = batch(size=2, seq=10)
        loss, expected = step_grads(*_trainable(plain), data)
        got_loss, got = step_grads(compiled, _trainable(model)[1], data)
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=0)
        assert_same_grads(expected, got)
    finally:
        torch._dynamo.reset()
    assert cm.checkpoint_map.head.label == "chunked(32)"


def test_a_compiled_wrapper_compiles_once_not_at_every_step():
    """Offload's count of forwards, bumped in the forward pre-hook, was read by dynamo as a guard: `torch.compile(cm)`
    compiled again at every step, and fell back to eager at torch's recompile limit (8)."""
    cm = CheckpointedModel(_lora(), CheckpointConfig())
    compiled_graphs = []

    def backend(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(cm, backend=backend)
    try:
        counts = []
        for step in range(4):
            # (use_cache=False as trainers pass it: without, transformers' warning breaks the graph before the hook)
            compiled(**batch(seed=step), use_cache=False).loss.backward()
            counts.append(len(compiled_graphs))
    finally:
        torch._dynamo.reset()
    assert counts[0] >= 1 and counts == counts[:1] * 4, counts


def test_compiled_offload_of_several_layers_trains_exactly_when_the_length_changes():
    """With two offloaded layers, the second's start sends the first's input to the host: traced by dynamo with dynamic
    shapes (a second length under the default `dynamic=None`, Trainer's torch_compile=True), `nbytes` of a symbolic
    shape failed the step. The copy runs eagerly; what moves is what moves uncompiled."""
    config = CheckpointConfig(checkpoint_policy="offload", offload_min_bytes=0)
    moved = []
    for compile_it in (False, True):
        plain, (model, named) = _lora(), _trainable(_lora())
        cm = CheckpointedModel(model, config, offload_transport=SimulatedTransport())
        torch._dynamo.reset()
        call = torch.compile(cm, backend="aot_eager") if compile_it else cm
        try:
            for seq in (12, 20):
                data = batch(size=2, seq=seq)
                assert_same_grads(step_grads(*_trainable(plain), data)[1], step_grads(call, named, data)[1])
        finally:
            torch._dynamo.reset()
        moved.append({i: (s.copies_to_host, s.copies_to_device) for i, s in cm.offload_stats.items()})
    assert moved[0] == moved[1] and sum(host for host, _ in moved[1].values()) >= 2, moved
