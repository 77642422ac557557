"""One rank of DDP / FSDP2 runs (gloo, CPU), started by tests/test_distributed.py.

argv: rank world_size port out_dir case [case ...], each case "every_n,offload,swap,wrap[,flags]" with
wrap one of "wrapper" (DDP(cm)), "model" (DDP(cm.model)) or "fsdp" (fully_shard per decoder
layer, then on the whole model); flags: "reentrant" (use_reentrant=True), "find_unused" (DDP's
find_unused_parameters=True).
For each case the rank trains its slice of the batch for one step and writes its gradients and
the per-layer recompute counts to out_dir/<case>-rank<r>.pt.
"""

import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import RecomputeCounter, add_lora, batch, decoder_layers, tiny_model

from remat import CheckpointConfig, CheckpointedModel


def run_case(rank: int, world: int, out_dir: str, case: str) -> None:
    every_n, offload, swap, wrap, *rest = case.split(",")
    torch.manual_seed(0)
    model = add_lora(tiny_model(attention_dropout=0.0), dropout=0.0)
    config = CheckpointConfig(
        every_n_layers=int(every_n),
        checkpoint_policy="offload" if offload == "1" else "recompute",
        swap_layers=int(swap),
        use_reentrant="reentrant" in rest,
    )
    if wrap == "fsdp" and int(swap):
        _refuse_swap_under_fsdp(rank, out_dir, case, model, config)
        return
    cm = CheckpointedModel(model, config)
    counter = RecomputeCounter(decoder_layers(model))
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        runner = cm
    else:
        unused = "find_unused" in rest
        runner = torch.nn.parallel.DistributedDataParallel(
            cm if wrap == "wrapper" else cm.model, find_unused_parameters=unused
        )
    data = batch(size=2 * world)
    mine = {k: v[rank * 2 : (rank + 1) * 2] for k, v in data.items()}
    runner(**mine).loss.backward()  # a first step: messages are said once, not once per step
    model.zero_grad()
    with _GatherCount() as gathers:
        runner(**mine).loss.backward()
    counter.counts = [c // 2 for c in counter.counts]
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    result = {"grads": grads, "counts": counter.counts, "logs": list(LOGS)}
    if wrap == "fsdp":  # every all-gather of the second step, by its input's size; a layer unit's size
        result["gathers"] = gathers.numels
        result["layer_numel"] = sum(p.to_local().numel() for p in decoder_layers(model)[0].parameters())
    torch.save(result, os.path.join(out_dir, f"{case}-rank{rank}.pt"))
    LOGS.clear()


def _refuse_swap_under_fsdp(rank, out_dir, case, model, config) -> None:
    """Block swap on FSDP2-sharded layers must be refused before anything moves."""
    from torch.distributed.fsdp import fully_shard

    from remat import BlockSwapError

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    try:
        CheckpointedModel(model, config)
        message = None
    except BlockSwapError as err:
        message = str(err)
    unchanged = all(torch.equal(before[n], p.to_local()) for n, p in model.named_parameters())
    torch.save({"refused": message, "unchanged": unchanged}, os.path.join(out_dir, f"{case}-rank{rank}.pt"))


class _GatherCount:
    """Counts the all-gathers FSDP2 issues (it calls `torch.distributed.all_gather_single` through the module,
    for each unit's flat shard), by the size of what each rank sends: the test's own instrument, undone on exit."""

    def __enter__(self):
        self.numels, self._original = [], dist.all_gather_single

        def counted(output_tensor, input_tensor, *args, **kwargs):
            self.numels.append(input_tensor.numel())
            return self._original(output_tensor, input_tensor, *args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_gather_single = self._original


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the whole (rank-averaged) gradient, also from FSDP2's sharded DTensor."""
    return grad.full_tensor().clone() if hasattr(grad, "full_tensor") else grad.clone()


LOGS: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGS.append(record.getMessage())


def main() -> None:
    logging.getLogger("remat").addHandler(_Collect())
    logging.getLogger("remat").setLevel(logging.INFO)
    rank, world, port, out_dir, *cases = sys.argv[1:]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    try:
        for case in cases:
            run_case(int(rank), int(world), out_dir, case)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
