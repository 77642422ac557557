"""Tiny models built from configs (no downloads) and the measuring tools the tests share.

Checkpointing is judged by behaviour: `RecomputeCounter` counts how often each layer's first
child starts during a step (2 means the layer was recomputed), and `step_grads` gives the
gradients of one training step to compare against a run without checkpointing.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys

# One intra-op thread, here and in every process a test starts (they inherit the environment): the
# tiny models' ops are too small to share among threads, and two threads spend several times the
# CPU on handing them over (six times on a busy 2-core machine), which only slows the suite.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed compiles a C++ op on first use into torch's extension cache, keyed by its sources' paths: one cache
# shared by the three environments (`make test`, `make compat`) rebuilt it at each switch (30 s alone, 60-90 s
# inside a suite). Each environment keeps its own.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import pytest
import torch
import transformers
from torch import nn

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# remat warns once per process when torch or transformers is a release it is not tested with. Said here, before any
# test, it is said once in the suite's output instead of inside whichever test builds the first wrapper (where it
# broke the tests that read their exact log lines, on an untested release only).
from remat.compat.tested_versions import warn_if_untested  # noqa: E402

warn_if_untested()

VOCAB = 96
SEQ = 12
BATCH = 2

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "attention_dropout": 0.1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


_ROUTED = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}  # aux loss on
_HEAD_FAMILIES = {
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
        ),
    ),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, final_logit_softcapping=2.0)),  # softcapped as Gemma 2
    "glm4": ("Glm4Config", dict(head_dim=8)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=8, num_local_experts=4, **_ROUTED)),
    "granite": ("GraniteConfig", dict(logits_scaling=3.0)),  # its logits divided
    # (router logits off: transformers 5.17's own forward fails with them, an int aux loss)
    "granitemoe": ("GraniteMoeConfig", dict(logits_scaling=3.0, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, **_ROUTED)),
    "olmo2": ("Olmo2Config", {}),
    "phi": ("PhiConfig", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1, **_ROUTED),
    ),
    "smollm3": ("SmolLM3Config", {}),
    "starcoder2": ("Starcoder2Config", {}),
}


def _config(arch: str, **overrides):
    c = dict(_COMMON)
    if arch == "llama":
        cfg = transformers.LlamaConfig
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config
        c["head_dim"] = 8
    elif arch == "mistral":
        cfg = transformers.MistralConfig
    elif arch == "phi3":
        cfg = transformers.Phi3Config
        c.update(resid_pdrop=0.1, embd_pdrop=0.0)
    elif arch == "gemma":
        cfg = transformers.GemmaConfig
        c["head_dim"] = 8
    elif arch == "gemma2":  # its final logit softcapping, small enough to matter (remat.head)
        cfg = transformers.Gemma2Config
        c.update(head_dim=8, final_logit_softcapping=2.0)
    elif arch == "cohere":  # its logit scale (remat.head)
        cfg = transformers.CohereConfig
        c["logit_scale"] = 0.5
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig
        c.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=1,
        )
    elif arch in _HEAD_FAMILIES:  # the other families the chunked head reproduces (tests/test_head.py)
        name, extra = _HEAD_FAMILIES[arch]
        cfg = getattr(transformers, name)
        c.update(extra)
    else:  # pragma: no cover - a typo in a test
        raise KeyError(arch)
    c.update(overrides)
    return cfg(**c)


ARCHS = ("llama", "qwen3", "mistral", "phi3", "gemma", "qwen2_moe")
HEAD_FAMILIES = tuple(_HEAD_FAMILIES)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = _config(arch, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.train()
    return model


LORA_TARGETS = ("q_proj", "v_proj", "down_proj")


def add_lora(model: nn.Module, dropout: float = 0.1, target_modules: tuple[str, ...] = LORA_TARGETS):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=list(target_modules))
    peft_model = get_peft_model(model, config)
    # Non-zero B so LoRA contributes to the output and its gradients exercise every path.
    torch.manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    peft_model.train()
    return peft_model


def marked_lora_cm(value: float, seed: int = 0):
    """A wrapped LoRA model whose every LoRA weight is `value`: a save recognisable by one number
    (read back with `lora_value`)."""
    from remat import CheckpointConfig, CheckpointedModel

    cm = CheckpointedModel(add_lora(tiny_model(seed=seed)), CheckpointConfig(every_n_layers=2))
    with torch.no_grad():
        for name, param in cm.model.named_parameters():
            if "lora_" in name:
                param.fill_(value)
    return cm


def lora_value(cm) -> float:
    """The one value every LoRA weight of `cm` holds (fails if they come from several saves)."""
    values = {round(float(p.detach().mean()), 4) for n, p in cm.model.named_parameters() if "lora_" in n}
    assert len(values) == 1, values
    return values.pop()


def free_port() -> int:
    """A TCP port nobody listens on now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(seed: int = 0, size: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (size, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def step_grads(call, named_params, data, seed: int = 123) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step, with the RNG seeded so dropout is reproducible."""
    for _, p in named_params:
        p.grad = None
    torch.manual_seed(seed)
    loss = call(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in named_params if p.grad is not None}


def assert_same_grads(expected: dict, actual: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert expected.keys() == actual.keys(), "a different set of parameters received gradients"
    assert expected, "no parameter received a gradient"
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class RecomputeCounter:
    """Counts how many times each layer's first child starts; 2 per step means recomputed."""

    def __init__(self, layers: list[nn.Module]):
        self.counts = [0] * len(layers)
        self._handles = []
        for i, layer in enumerate(layers):
            first_child = next(iter(layer.children()))
            self._handles.append(first_child.register_forward_pre_hook(self._bump(i)))

    def _bump(self, i: int):
        def hook(module, args):
            self.counts[i] += 1

        return hook

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)

    def recomputed(self) -> list[int]:
        return [i for i, c in enumerate(self.counts) if c == 2]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def hook_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Every hook dict of every module, by module name, to prove nothing was left behind."""
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    )
    return {n: tuple(tuple(getattr(m, h, {}).keys()) for h in names) for n, m in model.named_modules()}


def pytest_runtest_setup(item):
    """What is alive when a test starts is frozen out of the collector's sight, garbage collected first: a full
    collection walks every object of a process that imported torch and transformers (about 30 ms; remat's memory
    report collects once for each map a profile measures: 958 times, 35 of 100 s, in test_budget.py alone), and the
    test's own garbage is collected as before. remat's profile then keeps this freeze rather than making its own (the
    path of a process that froze nothing: test_profile_state.py)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # frozen objects are never freed: extensions that count their leaks at exit would name them


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()
    yield


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test starts from the environment the suite started with: accelerate writes a Trainer's settings into
    os.environ (TRL's GRPOConfig defaults to bf16: ACCELERATE_MIXED_PRECISION=bf16), and every later Trainer in
    that worker read them, so a fp32 comparison ran under bf16 autocast, depending on which tests ran before."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update(before)


@pytest.fixture
def remat_logs(caplog):
    caplog.set_level(logging.INFO, logger="remat")
    return caplog
