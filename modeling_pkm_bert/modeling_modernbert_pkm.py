"""PyTorch ModernBERT with product key memory layers (Kim & Jung 2020's +Init and ResM on ModernBERT, Ettin, mmBERT).

Remote code, as modeling_bert_pkm.py: it imports only torch, transformers' stable public API and its sibling files, and
owns its ModernBERT building blocks (copied from `transformers.models.modernbert.modeling_modernbert`, transformers
5.24): the rotary embedding (one inverse frequency per attention kind), the GeGLU MLP, the pre-norm layer, the final
norm, the prediction head and the `cls` / `mean` pooling. Weight names are transformers' (`model.embeddings.
tok_embeddings`, `model.layers.{i}.attn.Wqkv`, `.mlp_norm`, `.mlp.Wi`, `model.final_norm`, `head.dense`, `decoder`,
`classifier`), so that a ModernBERT checkpoint's body and heads load as they are; the memories add
`model.layers.{i}.memory.*` and `model.layers.{i}.ngram.*`.

The model runs ModernBERT's padded path (eager or sdpa attention on `(batch, seq)` with a 4-D mask per attention kind,
the local layers' sliding window in the mask); the flash-attn unpadded path is not taken, so that the remote code
needs no optional dependency and the memories see a padding mask: the query BatchNorm statistics skip padding, the
n-gram memories hash padding as padding, and a padded batch computes, for its real tokens, what each row computes
alone (rotary positions are relative, so left padding shifts nothing). The memory sits beside the MLP on the same
normalised input: `h + MLP(LN(h)) + PKM(LN(h))` (`pkm_mode="resm"`) or `h + PKM(LN(h))` (`"replace"`); with
`pkm_value_init="zeros"` it adds exactly zero, so a converted checkpoint starts as its source. The memory factories,
the attention masks, the input checks and the checked loading and saving are the shared module's
(`modeling_pkm_utils.py`: `PkmPreTrainedModel`), under ModernBERT's names. The sequence classification, token
classification and question answering heads are BertPkm's (checked `# Copied from` blocks) on ModernBERT's `head`,
`drop` and `classifier`; the masked LM and multiple choice heads are ModernBERT's, written here.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import GradientCheckpointingLayer
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import logging

# transformers before 5.24 copies only the direct relative imports of a loaded file: every file modeling_pkm_utils and
# the configurations need is imported here too
from .configuration_bert_pkm import PKM_CODE_VERSION  # noqa: F401
from .configuration_modernbert_pkm import ModernBertPkmConfig

# a ModernBertPkm folder holds every shipped file but RobertaPkm's (`hub.refresh.code_files_of`), BertPkm's included
from .modeling_bert_pkm import BertPkmPreTrainedModel  # noqa: F401
from .modeling_pkm_utils import (
    ATTENTION_FUNCTIONS,
    PkmPreTrainedModel,
    additive_mask,
    check_id_values,
    check_model_inputs,
    ngram_memory,
    number_of_choices,
    product_key_memory,
    real_tokens_of_4d_mask,
    sequence_classification_loss,
    shared_values_names,
    shared_values_ties,
    value_table,
)
from .ngram_memory import NgramMemory  # noqa: F401
from .product_key_memory import ProductKeyMemory  # noqa: F401  (a direct import: transformers < 5.24 copies only those)
from .product_key_memory_ops import is_exporting  # noqa: F401


logger = logging.get_logger(__name__)

LAYER_PATH = "layers."  # where the layers are in tensor names (`model.layers.{i}.`)


# Copied from transformers.models.modernbert.modeling_modernbert.ModernBertEmbeddings with ModernBert->ModernBertPkm
class ModernBertPkmEmbeddings(nn.Module):
    """
    Same as BertEmbeddings with a tiny tweak for positional embeddings indexing.
    """

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(
        self, input_ids: torch.LongTensor | None = None, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            hidden_states = self.drop(self.norm(inputs_embeds))
        else:
            hidden_states = self.drop(self.norm(self.tok_embeddings(input_ids)))
        return hidden_states


# Copied from transformers.models.modernbert.modeling_modernbert.ModernBertMLP with ModernBert->ModernBertPkm
class ModernBertPkmMLP(nn.Module):
    """Applies the GLU at the end of each ModernBERT layer.

    Compared to the default BERT architecture, this block replaces :class:`~transformers.model.bert.modeling_bert.BertIntermediate`
    and :class:`~transformers.model.bert.modeling_bert.SelfOutput` with a single module that has similar functionality.
    """

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__()
        self.config = config
        self.Wi = nn.Linear(config.hidden_size, int(config.intermediate_size) * 2, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(self.drop(self.act(input) * gate))


def default_inv_freq(config, layer_type: str, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies of the layers of kind `layer_type` (their own `rope_theta`; the config refuses other
    rope types than "default")."""
    base = config.rope_parameters[layer_type]["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


class ModernBertPkmRotaryEmbedding(nn.Module):
    """ModernBERT's rotary embedding (one inverse frequency per attention kind), ours: the default rope type only
    (transformers' RoPE registry and dynamic updates are internals)."""

    def __init__(self, config: ModernBertPkmConfig, device=None):
        super().__init__()
        self.config = config
        self.layer_types = sorted(set(config.layer_types))
        for layer_type in self.layer_types:
            inv_freq = default_inv_freq(config, layer_type, device)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids, layer_type):
        inv_freq = getattr(self, f"{layer_type}_inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


# Copied from transformers.models.modernbert.modeling_modernbert.eager_attention_forward
def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)

    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """torch's scaled_dot_product_attention with the boolean mask (True: may attend), as transformers' ModernBERT calls
    it: a query that may attend nothing (padding beyond a local layer's window from every real token) gets zeros, where
    eager attention's additive mask gives it uniform weights. No attention weights are returned."""
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return attn_output.transpose(1, 2).contiguous(), None


def attention_function(implementation: str | None) -> tuple[Callable, bool]:
    """(the attention function of `implementation`, whether it takes the boolean mask; the others: additive)."""
    if implementation in (None, "eager"):
        return eager_attention_forward, False
    if implementation == "sdpa":
        return sdpa_attention_forward, True
    return ATTENTION_FUNCTIONS[implementation], False  # a kernel registered with transformers: the additive mask


# Copied from transformers.models.modernbert.modeling_modernbert.rotate_half
def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Applies Rotary Position Embedding to the query and key tensors (in fp32, back in their dtype). Ours: transformers'
    ModernBERT wraps its copy in a hub-kernel module (an internal), so there is no plain source to check it against."""
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (rotate_half(q.float()) * sin)
    k_embed = (k.float() * cos) + (rotate_half(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


# Copied from transformers.models.modernbert.modeling_modernbert.ModernBertAttention with ModernBert->ModernBertPkm
# Differs: `@use_kernelized_func(apply_rotary_pos_emb)` -> ``
# Differs: `"""Performs multi-headed self attention on a batch of unpadded sequences.\n\n    If Flash Attention 2 is installed, this module uses Flash Attention to improve throughput.\n    If Flash Attention 2 is not installed, the implementation will use PyTorch's SDPA kernel,\n    which requires padding and unpadding inputs, adding some overhead.\n\n    See `forward` method for additional details.\n    """` -> `"""Multi-headed self attention with rotary positions; a local layer's window is in its attention mask."""`
# Differs: `**kwargs: Unpack[TransformersKwargs],` -> `**kwargs,`
# Differs: `attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(\n            self.config._attn_implementation, eager_attention_forward\n        )` -> `attention, boolean_mask = attention_function(self.config._attn_implementation)\n        if attention_mask is not None and not boolean_mask:\n            attention_mask = additive_mask(attention_mask, query_states.dtype)`
# Differs: `= attention_interface(` -> `= attention(`
# Differs: `deterministic=self.deterministic_flash_attn,` -> ``
class ModernBertPkmAttention(nn.Module):
    """Multi-headed self attention with rotary positions; a local layer's window is in its attention mask."""

    def __init__(self, config: ModernBertPkmConfig, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention heads ({config.num_attention_heads})"
            )

        self.attention_dropout = config.attention_dropout
        self.deterministic_flash_attn = config.deterministic_flash_attn
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.Wqkv = nn.Linear(
            config.hidden_size, 3 * self.head_dim * config.num_attention_heads, bias=config.attention_bias
        )

        if config.layer_types[layer_idx] == "sliding_attention":
            # config.sliding_window = local_attention // 2 (half-window size, e.g. 64 for local_attention=128)
            # +1 is needed because flash attention sets inclusive boundaries (see modeling_flash_attention_utils.py)
            self.sliding_window = config.sliding_window + 1
        else:
            self.sliding_window = None

        self.is_causal = False

        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.out_drop = nn.Dropout(config.attention_dropout) if config.attention_dropout > 0.0 else nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]

        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(*input_shape, 3, -1, self.head_dim)
        query_states, key_states, value_states = qkv.unbind(dim=-3)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, unsqueeze_dim=1)

        attention, boolean_mask = attention_function(self.config._attn_implementation)
        if attention_mask is not None and not boolean_mask:
            attention_mask = additive_mask(attention_mask, query_states.dtype)

        attn_output, attn_weights = attention(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.head_dim**-0.5,
            sliding_window=self.sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.out_drop(self.Wo(attn_output))
        return attn_output, attn_weights


class ModernBertPkmEncoderLayer(GradientCheckpointingLayer):
    """ModernBERT's pre-norm layer (transformers' `ModernBertEncoderLayer`), ours: at `config.pkm_layers` a product key memory beside (`resm`) or instead of
    (`replace`) the MLP, on the MLP's normalised input; at `config.ngram_layers` an n-gram memory added to the layer's
    input before its attention (Engram's place)."""

    def __init__(self, config: ModernBertPkmConfig, layer_idx: int | None = None, shared_values=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        if layer_idx == 0:
            self.attn_norm = nn.Identity()
        else:
            self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.attn = ModernBertPkmAttention(config=config, layer_idx=layer_idx)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        has_memory = layer_idx in config.pkm_layers
        # "replace": the memory reads LN(h) in place of the MLP (the norm stays: it is the memory's input norm)
        self.mlp = None if has_memory and config.pkm_mode == "replace" else ModernBertPkmMLP(config)
        self.memory = product_key_memory(config, shared_values) if has_memory else None
        if self.memory is not None:
            self.memory.layer_name = f"{LAYER_PATH}{layer_idx}.memory"
        self.ngram = ngram_memory(config, layer_idx) if layer_idx in config.ngram_layers else None
        if self.ngram is not None:
            self.ngram.layer_name = f"{LAYER_PATH}{layer_idx}.ngram"
        self.attention_type = config.layer_types[layer_idx]

    def __call__(self, *args, **kwargs):
        # a checkpointed layer runs its forward again in backward (not through this call): the query BatchNorm's running
        # statistics, updated by the first run, must stay as they are then
        if self.memory is not None:
            self.memory.batch_statistics_updates = 1 if self.gradient_checkpointing and self.training else None
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        padding_mask: torch.Tensor | None = None,
        ngram_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (hidden_states, attention weights: from eager attention only). `padding_mask`: True on real tokens (the
        product-key queries skip padding); `ngram_ids`: the token ids the n-gram memory hashes, -1 at padding."""
        if self.ngram is not None:
            hidden_states = hidden_states + self.ngram(hidden_states, ngram_ids)
        attn_output, attn_weights = self.attn(
            self.attn_norm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
        hidden_states = hidden_states + attn_output
        normed = self.mlp_norm(hidden_states)
        if self.memory is None:
            return hidden_states + self.mlp(normed), attn_weights
        memory_output = self.memory(normed, padding_mask)
        if self.mlp is None:
            return hidden_states + memory_output, attn_weights
        return hidden_states + self.mlp(normed) + memory_output, attn_weights


# Copied from transformers.models.modernbert.modeling_modernbert.ModernBertPredictionHead with ModernBert->ModernBertPkm
class ModernBertPkmPredictionHead(nn.Module):
    def __init__(self, config: ModernBertPkmConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, config.classifier_bias)
        self.act = ACT2FN[config.classifier_activation]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden_states)))


class ModernBertPkmPreTrainedModel(PkmPreTrainedModel):
    """ModernBERT's weight initialisation; the memories' initialisation, checked loading and saving
    (`PkmPreTrainedModel`) under ModernBERT's names (`model.layers.{i}.`, the MLP `.mlp.`)."""

    config: ModernBertPkmConfig
    base_model_prefix = "model"
    _no_split_modules = ["ModernBertPkmEmbeddings", "ModernBertPkmEncoderLayer"]
    memory_layer_path = LAYER_PATH
    memory_ffn_parts = (".mlp.",)
    memory_replaced_parts = (".mlp.Wi.", ".mlp.Wo.")
    body_prefixes = ("embeddings.", LAYER_PATH, "final_norm.")

    # Copied from transformers.models.modernbert.modeling_modernbert.ModernBertPreTrainedModel._init_weights with ModernBert->ModernBertPkm
    # Differs: `def _init_weights(self, module: nn.Module):` -> `@torch.no_grad()\ndef _init_weights(self, module: nn.Module):`
    # Differs: `rope_init_fn = module.compute_default_rope_parameters\n            if module.rope_type[layer_type] != "default":\n                rope_init_fn = ROPE_INIT_FUNCTIONS[module.rope_type[layer_type]]\n            curr_inv_freq, _ = rope_init_fn(module.config, layer_type=layer_type)\n            init.copy_(getattr(module, f"{layer_type}_inv_freq"), curr_inv_freq)\n            init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), curr_inv_freq)` -> `init.copy_(getattr(module, f"{layer_type}_inv_freq"), default_inv_freq(module.config, layer_type))\n    elif isinstance(module, nn.LayerNorm):\n        init.ones_(module.weight)\n        if module.bias is not None:\n            init.zeros_(module.bias)`
    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        cutoff_factor = self.config.initializer_cutoff_factor
        if cutoff_factor is None:
            cutoff_factor = 3

        def init_weight(module: nn.Module, std: float):
            init.trunc_normal_(
                module.weight,
                mean=0.0,
                std=std,
                a=-cutoff_factor * std,
                b=cutoff_factor * std,
            )

            if isinstance(module, nn.Linear):
                if module.bias is not None:
                    init.zeros_(module.bias)

        stds = {
            "in": self.config.initializer_range,
            "out": self.config.initializer_range / math.sqrt(2.0 * self.config.num_hidden_layers),
            "embedding": self.config.initializer_range,
            "final_out": self.config.hidden_size**-0.5,
        }

        if isinstance(module, ModernBertPkmEmbeddings):
            init_weight(module.tok_embeddings, stds["embedding"])
        elif isinstance(module, ModernBertPkmMLP):
            init_weight(module.Wi, stds["in"])
            init_weight(module.Wo, stds["out"])
        elif isinstance(module, ModernBertPkmAttention):
            init_weight(module.Wqkv, stds["in"])
            init_weight(module.Wo, stds["out"])
        elif isinstance(module, ModernBertPkmPredictionHead):
            init_weight(module.dense, stds["out"])
        elif isinstance(module, ModernBertPkmForMaskedLM):
            init_weight(module.decoder, stds["out"])
        elif isinstance(
            module,
            (
                ModernBertPkmForSequenceClassification,
                ModernBertPkmForMultipleChoice,
                ModernBertPkmForTokenClassification,
                ModernBertPkmForQuestionAnswering,
            ),
        ):
            init_weight(module.classifier, stds["final_out"])
        elif isinstance(module, ModernBertPkmRotaryEmbedding):
            for layer_type in module.layer_types:
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), default_inv_freq(module.config, layer_type))
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)


class ModernBertPkmModel(ModernBertPkmPreTrainedModel):
    r"""
    The bare ModernBertPkm model: ModernBERT with product key memory layers at `config.pkm_layers` and hashed n-gram
    memories at `config.ngram_layers`, outputting the final-norm hidden states.
    """

    _auto_class = "AutoModel"
    # eager forwards check that ids index the embedding table (one host sync); False skips it
    validate_input_values = True

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.config = config
        self.embeddings = ModernBertPkmEmbeddings(config)
        # pkm_shared_values: one table, the same module object in every memory layer (Memory+)
        shared = value_table(config) if shared_values_names(config, layer_path=LAYER_PATH) else None
        self.layers = nn.ModuleList(
            [
                ModernBertPkmEncoderLayer(config, layer_idx, shared_values=shared)
                for layer_idx in range(config.num_hidden_layers)
            ]
        )
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.rotary_emb = ModernBertPkmRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        # pkm_shared_values: transformers' tied weights save the table once (under the first memory)
        if shared_values_names(config, layer_path=LAYER_PATH):
            self._tied_weights_keys = shared_values_ties(config, LAYER_PATH)

        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # the shared value table is tied whatever `tie_word_embeddings` says (that flag is about the embeddings)
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return shared_values_ties(self.config, LAYER_PATH)

    def get_input_embeddings(self):
        return self.embeddings.tok_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.tok_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | BaseModelOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
            Token ids (exactly one of `input_ids` and `inputs_embeds`; n-gram memories need `input_ids`).
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 on real tokens, 0 on padding (left or right; the memories skip padding); or a 4-D mask `(batch_size, 1,
            query_length, key_length)`, boolean (True: may attend) or additive, used by every layer (the local layers
            add their window to it).
        position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Rotary positions (default: 0, 1, ...; rotary attention depends on their differences only).
        inputs_embeds (`torch.Tensor` of shape `(batch_size, sequence_length, hidden_size)`, *optional*):
            Token embeddings instead of `input_ids`.
        output_attentions, output_hidden_states, return_dict (`bool`, *optional*):
            As in every transformers model (attention weights need `attn_implementation="eager"`); the hidden states
            are the embeddings, each layer's output, the last one after the final norm (as transformers' ModernBERT).
        """
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        self._check_inputs(input_ids, attention_mask, position_ids, inputs_embeds)

        seq_len = inputs_embeds.shape[1] if inputs_embeds is not None else input_ids.shape[1]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device).unsqueeze(0)

        hidden_states = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds)

        # the memories read real tokens only: the 2-D padding mask, or the tokens a 4-D mask lets attend to themselves
        padding_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            padding_mask = attention_mask.bool()
        elif attention_mask is not None and (self.config.pkm_layers or self.config.ngram_layers):
            padding_mask = real_tokens_of_4d_mask(attention_mask, seq_len).expand(hidden_states.shape[0], -1)
        ngram_ids = self._ngram_ids(input_ids, padding_mask)
        attention_masks = self._attention_masks(attention_mask, hidden_states)

        position_embeddings = {}
        for layer_type in sorted(set(self.config.layer_types)):
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for encoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, attentions = encoder_layer(
                hidden_states,
                attention_masks[encoder_layer.attention_type],  # positional: reentrant checkpointing sees only these
                position_embeddings=position_embeddings[encoder_layer.attention_type],
                padding_mask=padding_mask,
                ngram_ids=ngram_ids,
                **kwargs,
            )
            if output_attentions:
                all_attentions += (attentions,)

        hidden_states = self.final_norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions
        )
        return output if return_dict else output.to_tuple()

    def _ngram_ids(self, input_ids, padding_mask):
        """The ids the n-gram memories hash (-1 at padding); None without n-gram memories."""
        if not self.config.ngram_layers:
            return None
        if input_ids is None:
            raise ValueError(
                f"this model has n-gram memories (ngram_layers={self.config.ngram_layers}), which hash the token ids:"
                " pass input_ids, not inputs_embeds alone"
            )
        return input_ids if padding_mask is None else input_ids.masked_fill(~padding_mask, -1)

    def _attention_masks(self, attention_mask, hidden_states) -> dict:
        """The boolean (batch or 1, 1, seq, seq) mask of each attention kind, True where attention is allowed: padding
        (or the given 4-D mask) for the global layers, and with it the window `|i - j| <= config.sliding_window` for
        the local ones (transformers' bidirectional sliding-window mask); None where every position may attend to
        every other. The attention turns it additive where its kernel needs that."""
        length = hidden_states.shape[1]
        if attention_mask is None:
            allowed = None
        elif attention_mask.dim() == 4:
            allowed = additive_mask(attention_mask, torch.float32) == 0
        else:
            allowed = attention_mask[:, None, None, :].bool()
        positions = torch.arange(length, device=hidden_states.device)
        window = (positions[None, :] - positions[:, None]).abs() <= self.config.sliding_window
        local = window[None, None] if allowed is None else allowed & window
        return {"full_attention": allowed, "sliding_attention": local}

    def _check_inputs(self, input_ids, attention_mask, position_ids, inputs_embeds):
        """Shapes always (free); the values of ids in eager mode only, in one host sync (a compiled or exported graph
        holds no data-dependent check). `validate_input_values = False` skips the latter."""
        check_model_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids)
        if self.validate_input_values:
            check_id_values([("input_ids", input_ids, self.config.vocab_size)])


class ModernBertPkmForMaskedLM(ModernBertPkmPreTrainedModel):
    """ModernBertPkm with ModernBERT's masked language modeling head (`head`, `decoder` tied to the embeddings)."""

    _auto_class = "AutoModelForMaskedLM"
    _tied_weights_keys = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.config = config
        self.model = ModernBertPkmModel(config)
        self.head = ModernBertPkmPredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)

        self.sparse_prediction = self.config.sparse_prediction
        self.sparse_pred_ignore_index = self.config.sparse_pred_ignore_index

        self.post_init()

    def get_output_embeddings(self):
        return self.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear):
        self.decoder = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | MaskedLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids to predict at the masked positions; `-100` elsewhere (ignored). With
            `config.sparse_prediction` the logits are those of the labelled positions only. Other arguments:
            `ModernBertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        last_hidden_state = outputs[0]

        if self.sparse_prediction and labels is not None:
            # flatten labels and output first
            labels = labels.view(-1)
            last_hidden_state = last_hidden_state.view(labels.shape[0], -1)

            # then filter out the non-masked tokens
            mask_tokens = labels != self.sparse_pred_ignore_index
            last_hidden_state = last_hidden_state[mask_tokens]
            labels = labels[mask_tokens]

        logits = self.decoder(self.head(last_hidden_state))

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.config.vocab_size), labels.view(-1))

        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


def pooled(config, last_hidden_state: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """ModernBERT's sequence pooling (`config.classifier_pooling`): the first token (`cls`), or the mean over the real
    tokens (`mean`)."""
    if config.classifier_pooling == "cls":
        return last_hidden_state[:, 0]
    if attention_mask is None or attention_mask.dim() != 2:
        attention_mask = torch.ones(last_hidden_state.shape[:2], device=last_hidden_state.device, dtype=torch.bool)
    return (last_hidden_state * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForSequenceClassification with BertPkm->ModernBertPkm, self\.bert->self.model, self\.dropout->self.drop
# Differs: `a sequence classification/regression head on the pooled output` -> `ModernBERT's classification/regression head (pooling, `head`, `classifier`)`
# Differs: `classifier_dropout = (\n            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob\n        )\n        self.drop = nn.Dropout(classifier_dropout)` -> `self.head = ModernBertPkmPredictionHead(config)\n        self.drop = torch.nn.Dropout(config.classifier_dropout)`
# Differs: `token_type_ids: torch.Tensor | None = None,` -> ``
# Differs: `token_type_ids=token_type_ids,` -> ``
# Differs: `self.drop(outputs[1])` -> `self.drop(self.head(pooled(self.config, outputs[0], attention_mask)))`
class ModernBertPkmForSequenceClassification(ModernBertPkmPreTrainedModel):
    """ModernBertPkm with ModernBERT's classification/regression head (pooling, `head`, `classifier`) (GLUE)."""

    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.config = config

        self.model = ModernBertPkmModel(config)
        self.head = ModernBertPkmPredictionHead(config)
        self.drop = torch.nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | SequenceClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class ids in `[0, num_labels)` (cross-entropy), or targets for regression when `num_labels == 1` (MSE).
            Other arguments: `ModernBertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.drop(self.head(pooled(self.config, outputs[0], attention_mask))))
        loss = sequence_classification_loss(self, logits, labels)

        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForTokenClassification with BertPkm->ModernBertPkm, self\.bert->self.model, self\.dropout->self.drop
# Differs: `a token classification head` -> `ModernBERT's token classification head (`head`, `classifier`)`
# Differs: `ModernBertPkmModel(config, add_pooling_layer=False)\n        classifier_dropout = (\n            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob\n        )\n        self.drop = nn.Dropout(classifier_dropout)` -> `ModernBertPkmModel(config)\n        self.head = ModernBertPkmPredictionHead(config)\n        self.drop = torch.nn.Dropout(config.classifier_dropout)`
# Differs: `token_type_ids: torch.Tensor | None = None,` -> ``
# Differs: `token_type_ids=token_type_ids,` -> ``
# Differs: `self.drop(outputs[0])` -> `self.drop(self.head(outputs[0]))`
class ModernBertPkmForTokenClassification(ModernBertPkmPreTrainedModel):
    """ModernBertPkm with ModernBERT's token classification head (`head`, `classifier`) (e.g. NER)."""

    _auto_class = "AutoModelForTokenClassification"

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.model = ModernBertPkmModel(config)
        self.head = ModernBertPkmPredictionHead(config)
        self.drop = torch.nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | TokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Class ids in `[0, num_labels)` per token; `-100` is ignored. Other arguments: `ModernBertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.drop(self.head(outputs[0])))

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))

        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForQuestionAnswering with BertPkm->ModernBertPkm, self\.bert->self.model, self\.dropout->self.drop, qa_outputs->classifier
# Differs: `with a span extraction head` -> `with ModernBERT's span extraction head`
# Differs: `ModernBertPkmModel(config, add_pooling_layer=False)` -> `ModernBertPkmModel(config)\n        self.head = ModernBertPkmPredictionHead(config)\n        self.drop = torch.nn.Dropout(config.classifier_dropout)`
# Differs: `token_type_ids: torch.Tensor | None = None,` -> ``
# Differs: `token_type_ids=token_type_ids,` -> ``
# Differs: `self.classifier(outputs[0])` -> `self.classifier(self.drop(self.head(outputs[0])))`
class ModernBertPkmForQuestionAnswering(ModernBertPkmPreTrainedModel):
    """ModernBertPkm with ModernBERT's span extraction head (start/end logits) for extractive QA (SQuAD)."""

    _auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.model = ModernBertPkmModel(config)
        self.head = ModernBertPkmPredictionHead(config)
        self.drop = torch.nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | QuestionAnsweringModelOutput:
        r"""
        start_positions, end_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Token positions of the answer span; positions outside the sequence are ignored. Other arguments:
            `ModernBertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.drop(self.head(outputs[0])))
        start_logits, end_logits = logits.split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()
        end_logits = end_logits.squeeze(-1).contiguous()

        total_loss = None
        if start_positions is not None and end_positions is not None:
            # on several GPUs the positions gain a dimension
            if len(start_positions.size()) > 1:
                start_positions = start_positions.squeeze(-1)
            if len(end_positions.size()) > 1:
                end_positions = end_positions.squeeze(-1)
            # positions outside the model inputs are ignored
            ignored_index = start_logits.size(1)
            start_positions = start_positions.clamp(0, ignored_index)
            end_positions = end_positions.clamp(0, ignored_index)

            loss_fct = CrossEntropyLoss(ignore_index=ignored_index)
            total_loss = (loss_fct(start_logits, start_positions) + loss_fct(end_logits, end_positions)) / 2

        output = QuestionAnsweringModelOutput(
            loss=total_loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class ModernBertPkmForMultipleChoice(ModernBertPkmPreTrainedModel):
    """ModernBertPkm with ModernBERT's multiple choice head (a score per choice from the pooled sequence)."""

    _auto_class = "AutoModelForMultipleChoice"

    def __init__(self, config: ModernBertPkmConfig):
        super().__init__(config)
        self.config = config

        self.model = ModernBertPkmModel(config)
        self.head = ModernBertPkmPredictionHead(config)
        self.drop = torch.nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, 1)

        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | MultipleChoiceModelOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, num_choices, sequence_length)`):
            Indices of input sequence tokens in the vocabulary, one sequence per choice (the other inputs alike).
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            The index of the right choice.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        num_choices = number_of_choices(input_ids, inputs_embeds)

        input_ids = input_ids.view(-1, input_ids.size(-1)) if input_ids is not None else None
        attention_mask = attention_mask.view(-1, attention_mask.size(-1)) if attention_mask is not None else None
        position_ids = position_ids.view(-1, position_ids.size(-1)) if position_ids is not None else None
        inputs_embeds = (
            inputs_embeds.view(-1, inputs_embeds.size(-2), inputs_embeds.size(-1))
            if inputs_embeds is not None
            else None
        )

        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        last_hidden_state = outputs[0]  # shape (num_choices, seq_len, hidden_size)

        if self.config.classifier_pooling == "cls":
            indices_0 = torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device)
            # for left or right padding, <cls> is the first non-pad token
            if attention_mask is not None:
                cls_mask = attention_mask.argmax(dim=-1).to(last_hidden_state.device)
            # if no pad, <cls> is the first token
            else:
                cls_mask = torch.full((), 0, dtype=torch.long, device=last_hidden_state.device)
            last_hidden_state = last_hidden_state[indices_0, cls_mask]
        else:
            last_hidden_state = pooled(self.config, last_hidden_state, attention_mask)

        pooled_output = self.drop(self.head(last_hidden_state))
        reshaped_logits = self.classifier(pooled_output).view(-1, num_choices)

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(reshaped_logits, labels)

        output = MultipleChoiceModelOutput(
            loss=loss, logits=reshaped_logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "ModernBertPkmForMaskedLM",
    "ModernBertPkmForMultipleChoice",
    "ModernBertPkmForQuestionAnswering",
    "ModernBertPkmForSequenceClassification",
    "ModernBertPkmForTokenClassification",
    "ModernBertPkmModel",
    "ModernBertPkmPreTrainedModel",
]
