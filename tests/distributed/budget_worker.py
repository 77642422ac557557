"""One rank of a DDP run with a budget in the config (gloo, CPU), started by tests/test_budget_distributed.py.

argv: rank world_size port out_file. The ranks' sequence lengths differ at every step (rank 0 short, rank 1
long); the last step is too long for the budget on rank 1 only. Writes, per step, the bucket of the plan the
rank ran (from its receipts) or "refused", as JSON. Then a T5 whose ranks profiled targets of other ratios (of one
kind): a step's targets count at each rank's own ratio, and every rank plans the largest (the last entry).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import add_lora, batch, tiny_model

from remat import CheckpointConfig, CheckpointedModel
from remat.errors import ConfigError

LENGTHS = {0: [8, 4, 16], 1: [32, 64, 512]}  # per rank; a 2 x 512-token step fits no plan under the budget


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = add_lora(tiny_model(num_hidden_layers=4, attention_dropout=0.0), dropout=0.0)
    cm = CheckpointedModel(model, CheckpointConfig(budget="2MiB", budget_scope="activations"))
    runner = torch.nn.parallel.DistributedDataParallel(cm)
    ran = []
    for step, seq in enumerate(LENGTHS[rank]):
        try:
            runner(**batch(seed=10 * rank + step, size=2, seq=seq)).loss.backward()
        except ConfigError as err:
            ran.append(["refused", str(err)[:120]])
            continue
        ran.append([controller_bucket(cm), "ran"])
    from test_budget import _seq2seq, _t5

    t5 = CheckpointedModel(_t5(), CheckpointConfig(budget="64MiB", budget_scope="activations"))
    t5(**_seq2seq(16, (12, 16)[rank])).loss.backward()  # profiles: 24 and 32 target tokens for 32 of the source
    t5(**_seq2seq(16, (22, 20)[rank])).loss.backward()  # 44 targets agreed: 59 tokens at rank 0's ratio, 44 at 1's
    ran.append([controller_bucket(t5), "ran"])
    with open(out, "w") as handle:
        json.dump(ran, handle)
    dist.barrier()
    dist.destroy_process_group()


def controller_bucket(cm) -> int:
    from remat.model import controller_of

    return controller_of(cm).budget.last_bucket


if __name__ == "__main__":
    main()
