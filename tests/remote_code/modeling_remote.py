"""A small decoder written the way remote-code models on the Hub are: plain nn.Module blocks
(no GradientCheckpointingLayer), a model-level `gradient_checkpointing` flag, optional MoE
blocks with router counters. Tests copy this file into a folder and load it with
`trust_remote_code=True`.

`RemoteForCausalLM` uses the "flag + _gradient_checkpointing_func" pattern; `RemoteOldForCausalLM`
uses the pre-4.35 format: `_set_gradient_checkpointing(module, value)`, a direct call of
torch's checkpoint in the loop, and no `_no_split_modules` (its blocks are found by structure).
`RemoteCachedForCausalLM` is GPT-2's pre-4.35 loop: blocks return `(hidden, present)` with `use_cache`, which
the loop turns off only when its own flag is on.
"""

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput, CausalLMOutputWithPast


class RemoteConfig(PretrainedConfig):
    model_type = "remat_remote"

    def __init__(self, vocab_size=96, hidden_size=32, num_layers=4, dropout=0.1, num_experts=0, use_cache=True, **kw):
        self.vocab_size = vocab_size
        self.use_cache = use_cache
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout = dropout
        self.num_experts = num_experts
        super().__init__(**kw)


class RemoteAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.q_proj, self.k_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.v_proj, self.o_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, mask):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scores = q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :].bool(), float("-inf"))
        return self.o_proj(self.dropout(scores.softmax(-1)) @ v)


class RemoteMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size)
        self.down_proj = nn.Linear(2 * config.hidden_size, config.hidden_size)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class RemoteMoE(nn.Module):
    """Top-2 routing with a token counter buffer and a call counter, as some MoE blocks keep."""

    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([RemoteMLP(config) for _ in range(config.num_experts)])
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.long))
        self.calls = 0

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = chosen == e
            self.tokens_per_expert[e] += int(hit.sum())
            w = (weights * hit).sum(-1, keepdim=True)
            out = out + w * expert(x)
        self.calls += 1
        return out


class RemoteBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.attn = RemoteAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.mlp = RemoteMoE(config) if config.num_experts else RemoteMLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden_states, attention_mask=None, use_cache=False, layer_past=None):
        if layer_past is not None:
            raise RuntimeError("this test model has no cache")
        hidden_states = hidden_states + self.dropout(self.attn(self.ln_1(hidden_states), attention_mask))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


def build_stack(model, config):
    model.embed = nn.Embedding(config.vocab_size, config.hidden_size)
    model.blocks = nn.ModuleList([RemoteBlock(config) for _ in range(config.num_layers)])
    model.norm = nn.LayerNorm(config.hidden_size)
    model.gradient_checkpointing = False


def run_stack(model, input_ids, attention_mask, checkpointed):
    """The decoder loop; `checkpointed(block, hidden, mask)` is the model's checkpoint call."""
    hidden = model.embed(input_ids)
    for block in model.blocks:
        if model.gradient_checkpointing and model.training:
            hidden = checkpointed(block, hidden, attention_mask)
        else:
            hidden = block(hidden, attention_mask)
    return model.norm(hidden)


def build_causal_lm(lm, config, model_class):
    lm.model = model_class(config)
    lm.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm.post_init()


class RemotePreTrainedModel(PreTrainedModel):
    config_class = RemoteConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RemoteBlock"]  # noqa: RUF012 (written as Hub code writes it)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.05)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()


class RemoteModel(RemotePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_stack(self, config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        return run_stack(
            self, input_ids, attention_mask, lambda b, h, m: self._gradient_checkpointing_func(b.__call__, h, m)
        )


class RemoteForCausalLM(RemotePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_causal_lm(self, config, RemoteModel)

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


class RemoteOldPreTrainedModel(RemotePreTrainedModel):
    _no_split_modules = None  # found by the repeated-block structure instead

    def _set_gradient_checkpointing(self, module, value=False):
        if isinstance(module, RemoteOldModel):
            module.gradient_checkpointing = value


class RemoteOldModel(RemoteOldPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_stack(self, config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None):
        # pre-4.35 Hub code: torch's checkpoint called directly in the loop
        return run_stack(
            self,
            input_ids,
            attention_mask,
            lambda b, h, m: torch.utils.checkpoint.checkpoint(b, h, m, use_reentrant=False),
        )


class RemoteOldForCausalLM(RemoteOldPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_causal_lm(self, config, RemoteOldModel)

    forward = RemoteForCausalLM.forward


class RemoteCachedBlock(RemoteBlock):
    def forward(self, hidden_states, attention_mask=None, use_cache=False, layer_past=None):
        hidden_states = super().forward(hidden_states, attention_mask)
        return (hidden_states, hidden_states.detach()) if use_cache else (hidden_states,)


class RemoteCachedModel(RemoteOldPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_stack(self, config)
        self.blocks = nn.ModuleList([RemoteCachedBlock(config) for _ in range(config.num_layers)])
        self.post_init()

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        hidden, presents = self.embed(input_ids), ()
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                out = torch.utils.checkpoint.checkpoint(block, hidden, attention_mask, use_reentrant=False)
            else:
                out = block(hidden, attention_mask, use_cache=use_cache)
            hidden = out[0]
            if use_cache:
                presents = (*presents, out[1])
        return self.norm(hidden), presents


class RemoteCachedForCausalLM(RemoteOldPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        build_causal_lm(self, config, RemoteCachedModel)

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, **kwargs):
        hidden, presents = self.model(input_ids, attention_mask, use_cache=use_cache)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=presents)
