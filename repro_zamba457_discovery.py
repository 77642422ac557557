"""transformers 4.57.6, Zamba: remat's map holds 'model.layers.2.mamba_decoder' instead of the hybrid layer
'model.layers.2', so the hybrid layers' shared attention block (and its `linear`) is never checkpointed: its
activations are kept whatever the map says; transformers' own checkpointing on 4.57 recomputes the whole hybrid layer."""
import os, sys; os.environ["TQDM_DISABLE"] = "1"; sys.path.insert(0, "/tmp/trial_ssm")
import torch, transformers, warnings; warnings.filterwarnings("ignore"); transformers.logging.set_verbosity_error()
from models import build, batch
from remat import CheckpointConfig, CheckpointedModel
print("transformers", transformers.__version__)
def attn_calls(m, run):
    n = [0]; h = m.model.layers[2].shared_transf.self_attn.q_proj.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    run(); h.remove(); return n[0]
m = build("zamba"); m.gradient_checkpointing_enable()
print("transformers' own gc: shared attention q_proj calls per step:", attn_calls(m, lambda: m(**batch()).loss.backward()), "(2 hybrid layers, each recomputed)")
cm = CheckpointedModel(build("zamba"), CheckpointConfig(every_n_layers=1))
print([p.name for p in cm.checkpoint_map])
print("remat every_n_layers=1: shared attention q_proj calls per step:", attn_calls(cm.model, lambda: cm(**batch()).loss.backward()))
