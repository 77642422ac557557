"""A budget under DDP (two gloo processes): every rank plans the bucket of the longest rank's step, and a
step too long for one rank is refused by every rank before its forward (none is left waiting); an encoder-decoder's
targets, counted at each rank's own profile's ratio, are agreed as counted."""

import json
import socket
import subprocess
import sys
from pathlib import Path

from remat.budget import bucket_of

WORKER = Path(__file__).parent / "distributed" / "budget_worker.py"


def test_ranks_agree_on_the_bucket_and_refuse_a_step_too_long_for_one_of_them(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), "2", port, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, out in enumerate(outs)
    ]
    try:
        logs = [p.communicate(timeout=90)[0] for p in procs]  # a rank left in an all-reduce hangs: fail
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), logs
    ranks = [json.loads(out.read_text()) for out in outs]
    expected = [bucket_of(2 * 32), bucket_of(2 * 64)]  # rank 1's, the longer, for both
    assert [step[0] for step in ranks[0][:2]] == expected == [step[0] for step in ranks[1][:2]], ranks
    assert ranks[0][2][0] == ranks[1][2][0] == "refused", ranks
    assert "a step of 1024 tokens fits no map" in ranks[0][2][1]
    assert ranks[0][3] == ranks[1][3] == [bucket_of(59), "ran"], ranks  # targets at the largest rank's count
