"""What a profile that chooses the head costs, and whether any plan it offers is under-priced: benchmarks/head.py's
model (2 layers, hidden 256, vocabulary 32,768, LoRA r=16, 2 x 512 tokens), profiled with head="chunked" and no
chunk, AdamW; then every plan of the step frontier is applied and its step peak measured by MemTracker
(`remat.testing.measure_step_peak`). Compare two versions by running it from each checkout, alternated."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from head import PRESET, build, make_batch

from remat import CheckpointConfig, CheckpointedModel
from remat.testing import measure_step_peak


def main() -> None:
    batch = make_batch(PRESET, "cpu")
    cm = CheckpointedModel(build(PRESET, "cpu", torch.float32), CheckpointConfig(head="chunked"))
    optimizer = torch.optim.AdamW([q for q in cm.parameters() if q.requires_grad])
    wall, cpu = time.perf_counter(), time.process_time()
    profile = cm.profile(batch, optimizer=optimizer, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    worst, plans = 0, profile.frontier(scope="step")
    for option in plans:
        planned = profile.plan(option.predicted_peak_bytes, scope="step")
        cm.enable(planned)
        worst = max(worst, measure_step_peak(cm, batch, optimizer) - planned.predicted_peak_bytes)
        optimizer.zero_grad(set_to_none=True)
    print(f"profile {wall:.1f} s wall, {cpu:.1f} s CPU; {len(plans)} plans; most over its prediction: {worst} B")


if __name__ == "__main__":
    main()
