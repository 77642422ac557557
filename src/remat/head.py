"""The head row of the map: the causal LM's loss in chunks of counted tokens, never the full logits.

On the runs remat is for (LoRA on a 32k-256k vocabulary) the logits and the loss are the step's
largest activation: batch x tokens x vocabulary, upcast, and its gradient. With `head="chunked"`, a
training forward with labels and gradients on runs the model without its labels; a pre-hook on the
output embedding keeps the hidden states it is handed and hands it none of them (so the model's own
head and post-ops run on zero tokens), and the loss is computed here, as the model would:
- only the positions whose shifted label counts, in chunks of `head_chunk_tokens`;
- each chunk through the head as a module (a LoRA'd or quantized head works), then the family's
  post-ops in the model's dtype (Gemma 2 and 3's final softcapping, Cohere's scale, Granite's divisor), then upcast;
- each chunk under torch's checkpoint: its logits live only inside it, in forward and backward;
  a frozen head's weight gets no gradient from autograd, so no vocabulary x hidden buffer;
- the sum of the chunks divided as transformers' causal-LM loss divides it: by the counted tokens,
  or by `num_items_in_batch` when Trainer passes it; a MoE model's auxiliary loss added as it adds it.
Hooks on the instances, never the model's `forward` (TRL patches that one on the instance, and
undoing ours would undo theirs). Evaluation, generation and forwards without labels or gradients
run the model's own head; so does a forward TRL asks for its own fused head (`fused_lm_head=True`),
a model whose forward Liger Kernel replaced (its fused linear cross-entropy never makes the logits),
and one whose forward or loss function is not transformers' (a subclass's, a `model.loss_function` set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from .errors import ConfigError, StateError
from .plan import HeadPlan

logger = logging.getLogger("remat")

DEFAULT_CHUNK_TOKENS = 1024
IGNORE_INDEX = -100
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")  # what transformers' causal-LM loss takes

# Families whose forward is: the head on the last hidden states, the post-ops below, transformers'
# causal-LM loss (plus `router_aux_loss_coef` x `aux_loss`): each checked against the model's own
# loss and gradients in tests/test_head.py. Any other family keeps its own head, and its row says so.
FAMILIES = (
    *("cohere", "deepseek_v3", "gemma", "gemma2", "gemma3_text", "glm4", "gpt_oss", "granite", "granitemoe"),
    *("llama", "mistral", "mixtral", "olmo2", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"),
    "starcoder2",
)
SOFTCAPPED = ("gemma2", "gemma3_text")  # logits = tanh(logits / cap) * cap, cap = config.final_logit_softcapping
DIVIDED = ("granite", "granitemoe")  # logits = logits / config.logits_scaling


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


_NOT_CAUSAL = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def every_label_counted(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with every ignored label replaced by a counted one, for a profile: the chunked head holds and computes
    per counted token, so a first step with few (a completion-only mask) or none priced it for every later step at
    that fraction (a budget's step with every label counted went 1.24x over; an explicit profile's plans 2x under at
    its own length). Each token counted is the most any step of its length holds; the plain head holds the same."""
    ignored = batch.get("ignore_index", IGNORE_INDEX)
    counted = lambda labels: torch.where(labels == ignored, 0, labels) if isinstance(labels, torch.Tensor) else labels
    return {**batch, **{k: counted(batch[k]) for k in ("labels", "shift_labels") if k in batch}}


def _own_loss_why(base: nn.Module) -> str | None:
    """Why `base` computes a loss remat does not reproduce (None: transformers' causal-LM loss, as `FAMILIES` run
    it). Read at every chunked forward too: a loss function or Liger can come after wrapping."""
    bound = getattr(getattr(base, "forward", None), "__func__", None)  # Liger patches the instance or the class
    if any(str(getattr(f, "__module__", None)).startswith("liger_kernel") for f in (bound, type(base).forward)):
        return "Liger Kernel replaced the forward: its fused linear cross-entropy computes the loss"
    family = getattr(getattr(base, "config", None), "model_type", None)
    if family not in FAMILIES and type(base).__name__.endswith(_NOT_CAUSAL):
        return (  # a masked LM, a classifier: not a family remat lacks, another loss (the families invited "add bert")
            f"{type(base).__name__} is not a causal language model: its loss is not the next-token loss the chunks "
            "compute, so its own head runs"
        )
    if family not in FAMILIES:
        return (
            f"remat reproduces the loss of {', '.join(FAMILIES)} exactly; {type(base).__name__} "
            f"({family!r}) is not one of them, so its own head runs"
        )
    owner = getattr(type(base).forward, "__module__", "")
    if not owner.startswith("transformers.models."):
        return (
            f"{type(base).__name__}.forward is {owner}'s, not transformers': its loss may differ, so its own head runs"
        )
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING

    causal = LOSS_MAPPING["ForCausalLM"]
    loss = getattr(base, "_loss_function", None) or LOSS_MAPPING.get(getattr(base, "loss_type", None), causal)
    if type(base).loss_function is not PreTrainedModel.loss_function or loss is not causal:
        return f"{type(base).__name__}'s loss_function is not transformers' causal-LM loss, so its own head runs"
    return None


def plan_head(head: str, chunk_tokens: int | None, model: nn.Module) -> HeadPlan:
    """The head row for a config's `head` and `head_chunk_tokens` on `model`."""
    base = causal_lm(model)
    get_output = getattr(base, "get_output_embeddings", None)
    module = get_output() if callable(get_output) else None
    name = next((n for n, m in model.named_modules() if m is module), "")
    if head == "plain":
        return HeadPlan(name, "plain", None, 'head="plain": the model\'s own head and loss')
    if module is None:
        return HeadPlan(name, "plain", None, f"{type(base).__name__} has no output embedding: nothing to chunk")
    if (why := _own_loss_why(base)) is not None:
        return HeadPlan(name, "plain", None, why)
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return HeadPlan(name, "plain", None, "prompt learning adds virtual tokens to the labels: its own head runs")
    from peft.tuners.tuners_utils import BaseTuner

    # A tuner whose forward is not PEFT's plain pass-through: AdaLoRA adds its orthogonal regularization to
    # `outputs.loss`, which the chunked head's loss bypassed (silently another loss).
    tuner = type(getattr(model, "base_model", None))
    if issubclass(tuner, BaseTuner) and tuner.forward is not BaseTuner.forward:
        why = f"PEFT's {tuner.__name__} has a forward of its own, which may change the loss"
        return HeadPlan(name, "plain", None, why)
    if chunk_tokens is None:
        why = f"head_chunk_tokens=None: remat's {DEFAULT_CHUNK_TOKENS}"
        return HeadPlan(name, "chunked", DEFAULT_CHUNK_TOKENS, why)
    return HeadPlan(name, "chunked", chunk_tokens, f"head_chunk_tokens={chunk_tokens}")


@dataclasses.dataclass(frozen=True)
class PostOps:
    """What the family does to the head's output before its loss, in the model's dtype (a class, not a
    closure: a wrapper with the chunked head pickles)."""

    scale: float | None = None
    divisor: float | None = None
    cap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:  # divided, as the family does (a product by its inverse rounds otherwise)
            logits = logits / self.divisor
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def _refuse_labels(labels: torch.Tensor, positions: torch.Tensor) -> None:
    raise ConfigError(
        f"head='chunked': the labels ({tuple(labels.shape)}, {labels.dtype}) must be token ids, one per position of "
        f"the inputs ({tuple(positions.shape)}), as the model's own loss takes them"
    )


def chunked_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    chunk_tokens: int,
    post: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """transformers' causal-LM loss of `head(hidden)` without its full logits: the counted positions in
    chunks of `chunk_tokens`, each recomputed in backward; a head that may draw random numbers (an adapter, a
    dropout) with its forward's RNG state, to draw the same (only then: 5 KB a chunk). `hidden`: (..., tokens, dim)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if shift_labels.shape != hidden.shape[:-1] or shift_labels.is_floating_point():  # else torch fails mid-chunk
        _refuse_labels(shift_labels, hidden[..., 0])
    counted = shift_labels != ignore_index
    states, targets = hidden[counted], shift_labels[counted]

    def chunk_sum(states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = post(head(states)).float()
        return F.cross_entropy(logits, targets, reduction="sum")

    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    random = _may_draw(head)  # then each chunk keeps its RNG state
    # No counted token (a fully masked micro-batch): one chunk on no tokens, so the loss (0/0 = nan,
    # or 0 over num_items_in_batch, as the model's own) stays in the graph and every parameter the
    # head and the model reach gets the model's own gradient, zeros; otherwise the same chunks.
    for start in range(0, max(targets.numel(), 1), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        total = total + checkpoint(
            chunk_sum, states[part], targets[part], use_reentrant=False, preserve_rng_state=random
        )
    if num_items_in_batch is None:
        return total / counted.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _may_draw(head: nn.Module) -> bool:
    """An adapter on the head may draw random numbers (LoRA's dropout, LoHa's module dropout, OFT's multiplicative
    one): a head with a trainable parameter or a dropout, in training."""
    dropout = nn.modules.dropout._DropoutNd
    return head.training and (
        any(p.requires_grad for p in head.parameters())
        or any(isinstance(m, dropout) and m.p > 0 for m in head.modules())
    )


def _rng_state(device: torch.device) -> torch.Tensor:
    """The generator state a dropout on `device` draws from."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


class _Call:
    """One chunked forward in flight: its labels and loss arguments, the model's head and settings as this forward
    reads them (an embedding resized, an adapter added, a setting changed since wrapping), the hidden states."""

    def __init__(self, kwargs: dict[str, Any], base: nn.Module):
        self.labels = kwargs.pop("labels")
        self.loss_kwargs = {key: kwargs.pop(key) for key in LOSS_KWARGS if key in kwargs}
        self.head: nn.Module = base.get_output_embeddings()
        config, family = base.config, base.config.model_type
        self.post = PostOps(
            scale=getattr(config, "logit_scale", None) if family == "cohere" else None,
            divisor=getattr(config, "logits_scaling", None) if family in DIVIDED else None,
            cap=getattr(config, "final_logit_softcapping", None) if family in SOFTCAPPED else None,
        )
        self.aux_coef = getattr(base, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
        self.hidden: torch.Tensor | None = None
        self.autocast: dict[str, Any] = {}  # the autocast the head was called under (accelerate's is inside forward)
        self.entered = False  # the decoder's forward began (a second beginning: this forward was interrupted)
        # the decoder (`base.model`), which the causal LM calls as a module: PEFT 0.17-0.18's tuner calls the causal
        # LM's `forward` itself, past its hooks
        decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
        entered = decoder if isinstance(decoder, nn.Module) else base
        self.handles = [
            self.head.register_forward_pre_hook(self.capture, prepend=True),  # the hidden states before your hooks
            entered.register_forward_pre_hook(self.enter),
        ]

    def enter(self, decoder: nn.Module, args: tuple[Any, ...]) -> None:
        """The decoder's pre-hook. A Ctrl-C skips the hook that ends a call (torch runs `always_call` hooks on an
        Exception only): the next forward that reaches the causal LM without the wrapper's model (PEFT's generate)
        found this call's head hook, which handed the head no tokens. Met a second time, the call ends itself."""
        if self.entered:
            self.remove()
        self.entered = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def capture(self, head: nn.Module, args: tuple[Any, ...]) -> Any:
        """The head's pre-hook: keeps the hidden states (the first call's) and hands the head none of them."""
        if self.hidden is not None:
            return None
        self.hidden = args[0]
        kind = args[0].device.type
        self.autocast = {
            "device_type": kind,
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
        }
        return (args[0][..., :0, :], *args[1:])  # the head's own call runs on no tokens


class ChunkedHead:
    """The hooks that run `plan`'s chunked loss on `model` (the wrapper's model, PEFT or not), removed by `remove()`."""

    def __init__(self, model: nn.Module, plan: HeadPlan, ran: Callable[[str | None], None]):
        self.plan, self.ran = plan, ran  # ran(None): a training forward ran chunked; ran(why): it ran plain
        self.call: _Call | None = None  # the forward in flight (a model's forward does not run inside itself)
        self.plain_because: set[str] = set()
        self.said_random = False  # said that the head draws random numbers
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.remove_call()

    def _plain(self, why: str) -> None:
        """This forward runs the model's own head (said once per reason); `_before` returns its None: no change."""
        if why not in self.plain_because:
            self.plain_because.add(why)
            logger.info("head: %s: the model's own head ran", why)
        self.ran(why)

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.remove_call()
        if self.plan.policy != "chunked" or not (module.training and torch.is_grad_enabled()):
            return None  # a plain plan (a budget's, or a config's since these hooks were made): the model's own head
        if kwargs.get("labels") is None:
            return self._plain("a training forward without labels (its caller computes the loss from the logits)")
        if kwargs.get("fused_lm_head"):
            return self._plain("TRL's fused LM head computes the loss (fused_lm_head=True)")
        if (why := _own_loss_why(base := causal_lm(module))) is not None:
            return self._plain(why)
        keep = kwargs.get("logits_to_keep")
        if kwargs.get("return_dict") is False or isinstance(keep, torch.Tensor) or keep not in (None, 0):
            return self._plain("the caller asked for return_dict=False or logits_to_keep")
        labels, ids = kwargs["labels"], kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and (labels.shape != ids.shape or labels.is_floating_point()):
            _refuse_labels(labels, ids)  # before any layer runs (after, a forward refused would still owe its backward)
        self.ran(None)
        kwargs = dict(kwargs)
        self.call = _Call(kwargs, base)
        return args, kwargs

    def remove_call(self) -> None:
        if self.call is not None:
            self.call.remove()
            self.call = None

    def _after(self, module: nn.Module, args: Any, *rest: Any) -> Any:
        """`rest`: (kwargs, output); (None,) when the forward raised (torch then passes no kwargs)."""
        call, output = self.call, rest[-1]
        self.remove_call()
        if call is None or output is None:
            return None
        if call.hidden is None:
            raise StateError(
                f"head: {type(module).__name__} never called its output embedding, so remat has no hidden states to "
                'compute the chunked loss from; use CheckpointConfig(head="plain")'
            )
        # in the autocast the model's own head would have run in: accelerate's mixed precision (Trainer's bf16=True)
        # wraps the model's forward, which has returned by now
        usable = torch.amp.is_autocast_available(call.autocast["device_type"])  # (not on a backend without AMP)
        device = call.hidden.device
        drew = _rng_state(device) if not self.said_random and _may_draw(call.head) else None
        with torch.autocast(**call.autocast) if usable else contextlib.nullcontext():
            chunk_tokens = self.plan.chunk_tokens or DEFAULT_CHUNK_TOKENS
            loss = chunked_loss(call.head, call.hidden, call.labels, chunk_tokens, call.post, **call.loss_kwargs)
        if drew is not None and not torch.equal(drew, _rng_state(device)):
            self.said_random = True
            logger.info(
                "head: the head draws random numbers (a dropout of an adapter on lm_head): the chunked head draws them "
                "for the counted tokens, chunk by chunk, so a seeded run draws other ones than the plain head (the "
                "same distribution; gradients exact for the loss it returns)"
            )
        aux = output.get("aux_loss")  # a ModelOutput: a caller asking for tuples ran the model's own head
        if aux is not None and call.aux_coef:
            loss = loss + call.aux_coef * aux.to(loss.device)
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=loss, **fields)
