"""PyTorch BERT with product key memory layers (Kim & Jung 2020, "Large Product Key Memory for PLMs").

Remote code: this file travels with every saved model. It imports only torch, transformers' stable public API
(`PreTrainedModel`, `GenerationMixin`, the `Cache` classes, `modeling_outputs`, the attention registry,
`initialization`, `activations`, `logging`) and its sibling files, and owns its BERT building blocks (copied from
`transformers.models.bert.modeling_bert`, transformers 5.23), so that a folder written today runs under later releases.

Top-down, as `modeling_bert.py`: the building blocks, `BertPkmPreTrainedModel`, `BertPkmModel`, the task heads; then,
in a section of its own, the checked loading and saving that `BertPkmPreTrainedModel` runs.
"""

import functools
import hashlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import (
    AttentionInterface,
    Cache,
    DynamicCache,
    EncoderDecoderCache,
    GenerationMixin,
    GradientCheckpointingLayer,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import logging

from .configuration_bert_pkm import PKM_CODE_VERSION, BertPkmConfig
from .ngram_memory import NgramMemory
from .product_key_memory import VALUE_QUANTIZATIONS, ProductKeyMemory, ProductKeyValues, QuantizedProductKeyValues
from .product_key_memory_ops import is_exporting


logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`: the models accept both
# names and fill the field that the installed release's outputs (and its `generate`) have
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithCrossAttentions.__dataclass_fields__ else "past_key_values"

# attention kernels registered with transformers by name (`AttentionInterface.register`); eager and sdpa are our own
ATTENTION_FUNCTIONS = AttentionInterface()


def _merge_cache_arguments(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once: `cache` (transformers >= 5.24) or `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def _resolve(value, config, name):
    return value if value is not None else getattr(config, name, False)


# Adapted from transformers.models.bert.modeling_bert.BertEmbeddings: buffers by register_buffer, the token_type_ids
# buffer always there
class BertPkmEmbeddings(nn.Module):
    """Construct the embeddings from word, position and token_type embeddings."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)

        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # position_ids (1, len position emb) is contiguous in memory and exported when serialized
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False
        )
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_length: int = 0,
    ) -> torch.Tensor:
        if input_ids is not None:
            input_shape = input_ids.size()
        else:
            input_shape = inputs_embeds.size()[:-1]

        batch_size, seq_length = input_shape

        if position_ids is None:
            position_ids = self.position_ids[:, cache_length : seq_length + cache_length]

        # the all-zero buffer helps users trace the model without token_type_ids (transformers issue #5664)
        if token_type_ids is None:
            buffered_token_type_ids = self.token_type_ids.expand(position_ids.shape[0], -1)
            buffered_token_type_ids = torch.gather(buffered_token_type_ids, dim=1, index=position_ids)
            token_type_ids = buffered_token_type_ids.expand(batch_size, seq_length)

        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings

        position_embeddings = self.position_embeddings(position_ids)
        embeddings = embeddings + position_embeddings

        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


def _mask_for(query: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The additive mask in the query's dtype (autocast computes attention in another dtype than the mask's), its
    minimum kept finite so that a query that may attend nothing gets uniform weights rather than NaN."""
    if attention_mask is None or attention_mask.dtype == query.dtype:
        return attention_mask
    return attention_mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)


# Adapted from transformers.models.bert.modeling_bert.eager_attention_forward: the mask in the query's dtype
# (`_mask_for`)
def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    if scaling is None:
        scaling = query.size(-1) ** -0.5

    # Take the dot product between "query" and "key" to get the raw attention scores.
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling

    if attention_mask is not None:
        attn_weights = attn_weights + _mask_for(query, attention_mask)

    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
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
    """torch's scaled_dot_product_attention with the additive mask (no attention weights are returned)."""
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=_mask_for(query, attention_mask), dropout_p=dropout, scale=scaling
    )
    return attn_output.transpose(1, 2).contiguous(), None


def attention_function(implementation: str | None):
    if implementation in (None, "eager"):
        return eager_attention_forward
    if implementation == "sdpa":
        return sdpa_attention_forward
    return ATTENTION_FUNCTIONS[implementation]  # a kernel registered with transformers: it gets the additive mask


# Adapted from transformers.models.bert.modeling_bert.BertSelfAttention: our attention functions, the cache updated
# without kwargs
class BertPkmSelfAttention(nn.Module):
    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0 and not hasattr(config, "embedding_size"):
            raise ValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                f"heads ({config.num_attention_heads})"
            )
        self.config = config

        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

        self.is_decoder = config.is_decoder
        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)

        query_layer = self.query(hidden_states).view(*hidden_shape).transpose(1, 2)
        key_layer = self.key(hidden_states).view(*hidden_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(*hidden_shape).transpose(1, 2)

        if cache is not None:
            # a decoder-only BERT has a plain dynamic cache; an encoder-decoder one the self-attention part
            self_attention_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
            key_layer, value_layer = self_attention_cache.update(key_layer, value_layer, self.layer_idx)

        attn_output, attn_weights = attention_function(self.config._attn_implementation)(
            self,
            query_layer,
            key_layer,
            value_layer,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return attn_output, attn_weights


# Adapted from transformers.models.bert.modeling_bert.BertCrossAttention: our attention functions
class BertPkmCrossAttention(nn.Module):
    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0 and not hasattr(config, "embedding_size"):
            raise ValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                f"heads ({config.num_attention_heads})"
            )
        self.config = config

        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query_layer = self.query(hidden_states).view(hidden_shape).transpose(1, 2)

        is_updated = cache.is_updated.get(self.layer_idx) if cache is not None else False
        if cache is not None and is_updated:
            # reuse k, v of the encoder states
            key_layer = cache.cross_attention_cache.layers[self.layer_idx].keys
            value_layer = cache.cross_attention_cache.layers[self.layer_idx].values
        else:
            kv_shape = (*encoder_hidden_states.shape[:-1], -1, self.attention_head_size)
            key_layer = self.key(encoder_hidden_states).view(kv_shape).transpose(1, 2)
            value_layer = self.value(encoder_hidden_states).view(kv_shape).transpose(1, 2)
            if cache is not None:
                key_layer, value_layer = cache.cross_attention_cache.update(key_layer, value_layer, self.layer_idx)
                cache.is_updated[self.layer_idx] = True

        attn_output, attn_weights = attention_function(self.config._attn_implementation)(
            self,
            query_layer,
            key_layer,
            value_layer,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout.p,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return attn_output, attn_weights


# Copied from transformers.models.bert.modeling_bert.BertSelfOutput with Bert->BertPkm
class BertPkmSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


# Adapted from transformers.models.bert.modeling_bert.BertAttention: the encoder states go to the cross-attention only
class BertPkmAttention(nn.Module):
    def __init__(self, config, is_causal=False, layer_idx=None, is_cross_attention=False):
        super().__init__()
        self.is_cross_attention = is_cross_attention
        attention_class = BertPkmCrossAttention if is_cross_attention else BertPkmSelfAttention
        self.self = attention_class(config, is_causal=is_causal, layer_idx=layer_idx)
        self.output = BertPkmSelfOutput(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.is_cross_attention:
            attention_output, attn_weights = self.self(
                hidden_states, encoder_hidden_states, attention_mask=encoder_attention_mask, cache=cache, **kwargs
            )
        else:
            attention_output, attn_weights = self.self(hidden_states, attention_mask=attention_mask, cache=cache, **kwargs)
        attention_output = self.output(attention_output, hidden_states)
        return attention_output, attn_weights


# Copied from transformers.models.bert.modeling_bert.BertIntermediate with Bert->BertPkm
class BertPkmIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        if isinstance(config.hidden_act, str):
            self.intermediate_act_fn = ACT2FN[config.hidden_act]
        else:
            self.intermediate_act_fn = config.hidden_act

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


# Copied from transformers.models.bert.modeling_bert.BertOutput with Bert->BertPkm
class BertPkmOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertPkmMemoryOutput(nn.Module):
    """The LayerNorm closing a layer whose FFN was replaced by the memory: LN(x + PKM(x))."""

    def __init__(self, config):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(hidden_states)


def memory_options(config, shared_values: ProductKeyValues | None = None) -> dict:
    """The Memory+ options of `config` as `ProductKeyMemory` arguments (only those switched on)."""
    options = {"values": shared_values}
    if config.pkm_qk_norm:
        options["qk_norm"] = True
    if config.pkm_score_activation != "softmax":
        options["score_activation"] = config.pkm_score_activation
    if config.pkm_output_gate != "none":
        options["output_gate"] = config.pkm_output_gate
    if config.pkm_memory_scale is not None:
        options["memory_scale"] = config.pkm_memory_scale
    return options


def product_key_memory(config, shared_values: ProductKeyValues | None = None) -> ProductKeyMemory:
    """The product key memory of a memory layer of `config` (its own quantized table with `pkm_values_quantization`
    where the values are not shared)."""
    if shared_values is None and getattr(config, "pkm_values_quantization", None):
        shared_values = value_table(config)
    return ProductKeyMemory(
        config.hidden_size,
        config.hidden_size,
        n_keys=config.pkm_n_keys,
        heads=config.pkm_heads,
        knn=config.pkm_knn,
        k_dim=config.pkm_k_dim,
        query_batchnorm=config.pkm_query_batchnorm,
        query_bias=config.pkm_query_bias,
        value_init=config.pkm_value_init,
        input_dropout=config.pkm_input_dropout,
        query_dropout=config.pkm_query_dropout,
        value_dropout=config.pkm_value_dropout,
        **memory_options(config, shared_values),
    )


def memory_table(config, rows: int, dim: int, sparse: bool = False) -> ProductKeyValues | QuantizedProductKeyValues:
    """A memory table of `rows` x `dim` for `config`: fp32 rows ([`ProductKeyValues`]: its dense backward into a reused
    buffer), or, with `pkm_values_quantization`, empty packed ones (filled by `from_pretrained`): one format for every
    memory table of the model, product-key values and n-gram tables alike."""
    quantization = getattr(config, "pkm_values_quantization", None)
    if quantization:
        return QuantizedProductKeyValues(rows, dim, VALUE_QUANTIZATIONS[quantization])
    return ProductKeyValues(rows, dim, sparse=sparse)


def value_table(config) -> ProductKeyValues | QuantizedProductKeyValues:
    """A product key memory's value table for `config` ([`memory_table`])."""
    return memory_table(config, config.pkm_mem_size, config.hidden_size)


def ngram_memory(config, layer_idx: int) -> NgramMemory:
    """The n-gram memory of layer `layer_idx` (causal in a decoder); each layer hashes with its own multipliers."""
    memory = NgramMemory(
        config.hidden_size,
        config.vocab_size,
        orders=tuple(config.ngram_orders),
        heads=config.ngram_heads,
        table_size=config.ngram_table_size,
        dim=config.ngram_dim,
        conv_kernel=config.ngram_conv_kernel,
        causal=config.is_decoder,
        token_map=config.ngram_token_map,
        seed=layer_idx,
        table_factory=functools.partial(memory_table, config),
    )
    memory.layer_name = f"encoder.layer.{layer_idx}.ngram"
    return memory


def shared_values_names(config, prefix: str = "", layer_path: str = "encoder.layer.") -> list[str]:
    """With `pkm_shared_values`, the names under which the one value table appears, the first memory's first
    (`layer_path`: where the model's layers are, `"layers."` in ModernBertPkm)."""
    if not (getattr(config, "pkm_shared_values", False) and config.pkm_layers):
        return []
    return [f"{prefix}{layer_path}{i}.memory.values.weight" for i in sorted(config.pkm_layers)]


class BertPkmLayer(GradientCheckpointingLayer):
    """A BERT layer; at `config.pkm_layers` with a memory beside (`resm`) or instead of (`replace`) the FFN.
    Gradient checkpointing (`PreTrainedModel.activation_checkpointing_enable`) recomputes it in backward, as
    transformers' own layers: the tensors that need gradients are passed positionally."""

    def __init__(self, config, layer_idx=None, shared_values: ProductKeyValues | None = None):
        super().__init__()
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.attention = BertPkmAttention(config, is_causal=config.is_decoder, layer_idx=layer_idx)
        self.is_decoder = config.is_decoder
        self.add_cross_attention = config.add_cross_attention
        if self.add_cross_attention:
            if not self.is_decoder:
                raise ValueError(f"{self} should be used as a decoder model if cross attention is added")
            self.crossattention = BertPkmAttention(config, is_causal=False, layer_idx=layer_idx, is_cross_attention=True)

        has_memory = layer_idx in config.pkm_layers
        self.memory = product_key_memory(config, shared_values) if has_memory else None
        if has_memory:
            self.memory.layer_name = f"encoder.layer.{layer_idx}.memory"
        self.ngram = ngram_memory(config, layer_idx) if layer_idx in getattr(config, "ngram_layers", ()) else None
        if has_memory and config.pkm_mode == "replace":
            self.intermediate = None
            self.output = BertPkmMemoryOutput(config)
        else:
            self.intermediate = BertPkmIntermediate(config)
            self.output = BertPkmOutput(config)

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
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        ngram_ids: torch.Tensor | None = None,
        ngram_history_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> hidden_states; with `output_attentions`, (hidden_states, self-attention weights, cross-attention
        weights), the weights from eager attention only. `ngram_ids`: the token ids (-1 at padding) that an n-gram
        memory hashes; `ngram_history_ids`: the tokens before them (cached generation)."""
        if self.ngram is not None:
            # Engram's place: the n-gram memory adds to the residual stream before the layer's attention
            hidden_states = hidden_states + self.ngram(hidden_states, ngram_ids, ngram_history_ids)
        attention_output, self_attention_weights = self.attention(
            hidden_states, attention_mask, cache=cache, **kwargs
        )

        cross_attention_weights = None
        if self.is_decoder and encoder_hidden_states is not None:
            if not hasattr(self, "crossattention"):
                raise ValueError(
                    f"If `encoder_hidden_states` are passed, {self} has to be instantiated with cross-attention layers"
                    " by setting `config.add_cross_attention=True`"
                )
            attention_output, cross_attention_weights = self.crossattention(
                attention_output,
                None,  # attention_mask
                encoder_hidden_states,
                encoder_attention_mask,
                cache=cache,
                **kwargs,
            )

        residual = attention_output
        if self.memory is not None:
            residual = attention_output + self.memory(attention_output, padding_mask)
        if self.intermediate is None:
            layer_output = self.output(residual)
        else:
            layer_output = apply_chunking_to_forward(
                self.feed_forward_chunk, self.chunk_size_feed_forward, self.seq_len_dim, attention_output, residual
            )
        if output_attentions:
            return layer_output, self_attention_weights, cross_attention_weights
        return layer_output

    def feed_forward_chunk(self, attention_output, residual):
        return self.output(self.intermediate(attention_output), residual)


# Adapted from transformers.pytorch_utils.apply_chunking_to_forward: its argument checks left out (the calls are
# ours)
def apply_chunking_to_forward(forward_fn, chunk_size: int, chunk_dim: int, *input_tensors) -> torch.Tensor:
    """`forward_fn` on chunks of `chunk_size` along `chunk_dim` (less peak memory, the same result); 0: at once."""
    if chunk_size > 0:
        num_chunks = input_tensors[0].shape[chunk_dim] // chunk_size
        input_tensors_chunks = tuple(input_tensor.chunk(num_chunks, dim=chunk_dim) for input_tensor in input_tensors)
        output_chunks = tuple(forward_fn(*input_tensors_chunk) for input_tensors_chunk in zip(*input_tensors_chunks))
        return torch.cat(output_chunks, dim=chunk_dim)
    return forward_fn(*input_tensors)


class BertPkmEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # pkm_shared_values: one table, the same module object in every memory layer (Memory+)
        shared = value_table(config) if shared_values_names(config) else None
        self.layer = nn.ModuleList(
            [BertPkmLayer(config, layer_idx=i, shared_values=shared) for i in range(config.num_hidden_layers)]
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        padding_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        ngram_ids: torch.Tensor | None = None,
        ngram_history_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        all_hidden_states = () if output_hidden_states else None
        all_self_attentions = () if output_attentions else None
        all_cross_attentions = () if output_attentions and self.config.add_cross_attention else None
        for layer_module in self.layer:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            layer_outputs = layer_module(
                hidden_states,
                attention_mask,
                encoder_hidden_states,  # positional: reentrant gradient checkpointing sees only positional tensors
                encoder_attention_mask,
                cache=cache,
                padding_mask=padding_mask,
                output_attentions=output_attentions,
                ngram_ids=ngram_ids,
                ngram_history_ids=ngram_history_ids,
                **kwargs,
            )
            if output_attentions:
                hidden_states, self_attention, cross_attention = layer_outputs
                all_self_attentions += (self_attention,)
                if all_cross_attentions is not None:
                    all_cross_attentions += (cross_attention,)
            else:
                hidden_states = layer_outputs
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            attentions=all_self_attentions,
            cross_attentions=all_cross_attentions,
            **{CACHE_FIELD: cache if use_cache else None},
        )


# Copied from transformers.models.bert.modeling_bert.BertPooler with Bert->BertPkm
class BertPkmPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # We "pool" the model by simply taking the hidden state corresponding
        # to the first token.
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


# Copied from transformers.models.bert.modeling_bert.BertPredictionHeadTransform with Bert->BertPkm
class BertPkmPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        if isinstance(config.hidden_act, str):
            self.transform_act_fn = ACT2FN[config.hidden_act]
        else:
            self.transform_act_fn = config.hidden_act
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return hidden_states


# Copied from transformers.models.bert.modeling_bert.BertLMPredictionHead with Bert->BertPkm
class BertPkmLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = BertPkmPredictionHeadTransform(config)

        # The output weights are the same as the input embeddings, but there is
        # an output-only bias for each token.
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states):
        hidden_states = self.transform(hidden_states)
        hidden_states = self.decoder(hidden_states)
        return hidden_states


# Copied from transformers.models.bert.modeling_bert.BertOnlyMLMHead with Bert->BertPkm
class BertPkmOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertPkmLMPredictionHead(config)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        prediction_scores = self.predictions(sequence_output)
        return prediction_scores


class BertPkmPreTrainedModel(PreTrainedModel):
    """Weight initialisation, checked loading and saving shared by every BertPkm model (the checks: last section)."""

    config: BertPkmConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    # eager and sdpa are this file's own; other kernels registered with transformers' AttentionInterface get the
    # additive 4-D mask (flash and flex attention need masks in their own formats: not supported)
    _supports_sdpa = True
    _supports_attention_backend = True
    # what the checked loading reads in tensor names (a family with other names, ModernBertPkm, sets its own): where
    # the layers are, the FFN tensors of a layer (kept by "resm", dropped by "replace"), those "replace" drops from a
    # plain checkpoint, and the body that every head class shares (the checksum's "body")
    memory_layer_path = "encoder.layer."
    memory_ffn_parts = (".intermediate.", ".output.")
    memory_replaced_parts = (".intermediate.dense.", ".output.dense.")
    body_prefixes = ("embeddings.", "encoder.")

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # transformers guesses from the source text (its own attention registry) whether `set_attn_implementation` may
        # switch a built model; ours looks the kernel up by `config._attn_implementation` at every call: it may
        return True

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        ignore_mismatched_memories: bool = False,
        verify_checksum: bool = True,
        **kwargs,
    ):
        r"""
        [`~PreTrainedModel.from_pretrained`] that refuses (ValueError, with the tensors concerned) a checkpoint whose
        layers do not fit the config: memory or FFN tensors missing, unexpected or of another shape (`pkm_layers`,
        `pkm_mode` or `pkm_n_keys` edited, memory tensors stripped). A plain BERT checkpoint loads with new memories
        (+Init; `convert_to_pkm` gives a report). When the saved config holds `pkm_weights_checksum`
        (`save_pretrained(..., checksum=True)`), the loaded tensors are verified against it.

        ignore_mismatched_memories (`bool`, defaults to `False`):
            Load anyway: the tensors that do not fit are initialised new, as transformers does (its warning lists them).
        verify_checksum (`bool`, defaults to `True`):
            `False` skips the checksum verification.
        """
        output_loading_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched_sizes = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
        )
        if not ignore_mismatched_memories:
            _check_loaded_tensors(model, pretrained_model_name_or_path, info, ignore_mismatched_sizes, kwargs)
        if verify_checksum and model.config.pkm_weights_checksum:
            _verify_weights_checksum(model, pretrained_model_name_or_path)
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, checksum: bool | None = None, **kwargs):
        r"""
        [`~PreTrainedModel.save_pretrained`]; with `checksum=True` the config records the SHA-256 of the saved
        tensors (`pkm_weights_checksum`), which `from_pretrained` verifies. `None` (default) keeps a loaded
        model's choice: a checksum is recomputed when the config holds one.
        """
        if checksum is None:
            checksum = self.config.pkm_weights_checksum is not None
        self.config.pkm_code_version = PKM_CODE_VERSION  # the code files saved beside the weights
        self.config.pkm_weights_checksum = _weights_checksum(self, kwargs.get("state_dict")) if checksum else None
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BertPkmLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, BertPkmEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)
        elif isinstance(module, ProductKeyMemory):
            # its query Linear and BatchNorm are initialised as BERT's; keys and values as XLM's (a shared table: by
            # every memory alike); the options' parameters as their papers'
            bound = (module.k_dim // 2) ** -0.5
            init.uniform_(module.keys, -bound, bound)
            if isinstance(module.values, QuantizedProductKeyValues):
                pass  # packed rows (pkm_values_quantization): only ever loaded, never initialised
            elif module.value_init == "zeros":
                init.zeros_(module.values.weight)
            else:
                init.normal_(module.values.weight, mean=0.0, std=module.v_dim**-0.5)
            module.reset_option_parameters(init)
            if module.memory_scale is not None:
                init.constant_(module.memory_scale, self.config.pkm_memory_scale)
        elif isinstance(module, NgramMemory):
            # tables as the module's own init; the convolution and the value projection at zero (a memory added to a
            # trained model starts function-preserving); the hash constants are fixed by the config
            if not isinstance(module.tables, QuantizedProductKeyValues):  # packed rows are only ever loaded
                init.normal_(module.tables.weight, mean=0.0, std=module.dim**-0.5)
            for parameter in (module.conv.weight, module.conv.bias, module.value.weight, module.value.bias):
                init.zeros_(parameter)
            for name, value in module.hash_buffers().items():
                init.copy_(getattr(module, name), value)
            if module.token_map is not None:
                init.copy_(module.token_map, torch.arange(module.vocab_size))

    def mark_tied_weights_as_initialized(self, loading_info):
        self._missing_on_load = set(loading_info.missing_keys)  # before tying removes the tied names from it
        return super().mark_tied_weights_as_initialized(loading_info)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """After `from_pretrained`: a checkpoint whose value tables do not match `pkm_shared_values` is an error, not
        a silent re-initialisation (separate tables read into one, or one table missing from other memories)."""
        missing = getattr(self, "_missing_on_load", None)
        missing = set(loading_info.missing_keys) if missing is None else missing
        self._missing_on_load = None
        super()._adjust_missing_and_unexpected_keys(loading_info)
        _check_value_tables(self, missing)


class BertPkmModel(BertPkmPreTrainedModel):
    r"""
    The bare BertPkm model: BERT with product key memory layers at `config.pkm_layers`, outputting raw hidden states.
    As BERT, it is an encoder, or a decoder with `config.is_decoder=True` (causal self-attention, a cache) and
    cross-attention layers with `config.add_cross_attention=True`.

    add_pooling_layer (`bool`, *optional*, defaults to `True`):
        Whether to add the pooler (a dense layer and tanh on the first token).
    """

    _auto_class = "AutoModel"
    _no_split_modules = ["BertPkmEmbeddings", "BertPkmLayer"]
    # eager forwards check that ids index the embedding tables (one host sync); False skips it
    validate_input_values = True
    # a model family with other embeddings (RobertaPkm) sets its own class and the position its tokens start at
    embeddings_class = BertPkmEmbeddings
    first_position = 0

    def __init__(self, config: BertPkmConfig, add_pooling_layer=True):
        super().__init__(config)
        self.config = config
        self.gradient_checkpointing = False

        self.embeddings = self.embeddings_class(config)
        self.encoder = BertPkmEncoder(config)
        self.pooler = BertPkmPooler(config) if add_pooling_layer else None
        # pkm_shared_values: the table is one module in every memory; transformers' tied weights save it once (under
        # the first memory) and point the other names at it on load
        shared = shared_values_names(config)
        if shared:
            self._tied_weights_keys = {name: shared[0] for name in shared[1:]}

        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # the shared value table is tied whatever `tie_word_embeddings` says (that flag is about the embeddings)
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        shared = shared_values_names(self.config)
        return {name: shared[0] for name in shared[1:]}

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        ngram_history_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | BaseModelOutputWithPoolingAndCrossAttentions:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
            Token ids (exactly one of `input_ids` and `inputs_embeds`).
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 on real tokens, 0 on padding (the memories skip padding); or a 4-D mask `(batch_size, 1, query_length,
            key_length)`, boolean (True: may attend) or additive (0 or a large negative number).
        token_type_ids, position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Segment ids (0 or 1) and positions, as BERT's.
        inputs_embeds (`torch.Tensor` of shape `(batch_size, sequence_length, hidden_size)`, *optional*):
            Token embeddings instead of `input_ids`.
        encoder_hidden_states, encoder_attention_mask (*optional*):
            What the cross-attention layers attend to (`config.add_cross_attention=True`) and its padding mask.
        cache (`Cache`, *optional*):
            Keys and values of earlier positions (decoders); `past_key_values` is the same argument under the name
            transformers used before 5.24.
        use_cache (`bool`, *optional*):
            Return the cache (decoders only; defaults to `config.use_cache`).
        output_attentions, output_hidden_states, return_dict (`bool`, *optional*):
            As in every transformers model (attention weights need `attn_implementation="eager"`).
        ngram_history_ids (`torch.LongTensor` of shape `(batch_size, history_length)`, *optional*):
            With n-gram memories (`config.ngram_layers`) and a non-empty cache: the tokens before `input_ids` (at least
            the last `ngram_context_length`; -1 or masked out where none), which the memories hash beside the new ones.
            `generate` passes them.
        """
        cache = _merge_cache_arguments(cache, past_key_values)
        output_attentions = _resolve(output_attentions, self.config, "output_attentions")
        output_hidden_states = _resolve(output_hidden_states, self.config, "output_hidden_states")
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if self.config.is_decoder:
            use_cache = use_cache if use_cache is not None else self.config.use_cache
        else:
            use_cache = False
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # backward recomputes each layer, which would append its keys and values to the cache a second time
            if cache is not None:
                raise ValueError(
                    f"a cache (holds {cache.get_seq_length()} tokens) cannot be used with gradient checkpointing in"
                    " training: recomputing the layers in backward would write to it again. Pass no cache, or run"
                    " without gradients (torch.no_grad(), model.eval()) or without gradient checkpointing"
                )
            if use_cache:
                logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.")
                use_cache = False

        if use_cache and cache is None:
            cache = (
                EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
                if encoder_hidden_states is not None or self.config.is_encoder_decoder
                else DynamicCache(config=self.config)
            )

        cache_length = cache.get_seq_length() if cache is not None else 0
        self._check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, cache_length)

        embedding_output = self.embeddings(
            input_ids=input_ids,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
            cache_length=cache_length,
        )

        # the memories read real tokens only (product-key queries skip padding, n-grams hash it as padding): the 2-D
        # mask of the current positions, or the tokens a 4-D mask lets attend to themselves
        padding_mask = None
        has_memories = bool(self.config.pkm_layers or self.config.ngram_layers)
        if attention_mask is not None and attention_mask.dim() == 2:
            padding_mask = attention_mask[:, -embedding_output.shape[1] :].bool()
        elif attention_mask is not None and attention_mask.dim() == 4 and has_memories:
            real = _real_tokens_of_4d_mask(attention_mask, embedding_output.shape[1])
            padding_mask = real.expand(embedding_output.shape[0], -1)

        ngram_ids, ngram_history_ids = self._ngram_inputs(
            input_ids, padding_mask, attention_mask, cache_length, ngram_history_ids
        )
        extended_attention_mask = self._attention_mask(attention_mask, embedding_output, cache_length)
        if encoder_attention_mask is not None:
            encoder_attention_mask = _additive_mask(encoder_attention_mask, embedding_output.dtype)

        encoder_outputs = self.encoder(
            embedding_output,
            attention_mask=extended_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            cache=cache,
            use_cache=use_cache,
            padding_mask=padding_mask,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            ngram_ids=ngram_ids,
            ngram_history_ids=ngram_history_ids,
            **kwargs,
        )
        sequence_output = encoder_outputs.last_hidden_state
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None

        output = BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=pooled_output,
            hidden_states=encoder_outputs.hidden_states,
            attentions=encoder_outputs.attentions,
            cross_attentions=encoder_outputs.cross_attentions,
            **{CACHE_FIELD: getattr(encoder_outputs, CACHE_FIELD) if use_cache else None},
        )
        return output if return_dict else output.to_tuple()

    @property
    def ngram_context_length(self) -> int:
        """Tokens before the new ones that a causal n-gram memory reads (0 without n-gram memories)."""
        config = self.config
        if not config.ngram_layers or not config.is_decoder:
            return 0
        return config.ngram_conv_kernel - 1 + max(config.ngram_orders) - 1

    def _ngram_inputs(self, input_ids, padding_mask, attention_mask, cache_length, history_ids):
        """The ids the n-gram memories hash (-1 at padding) and, after a cache, the `ngram_context_length` tokens
        before them; (None, None) without n-gram memories."""
        if not self.config.ngram_layers:
            return None, None
        if input_ids is None:
            raise ValueError(
                f"this model has n-gram memories (ngram_layers={self.config.ngram_layers}), which hash the token ids:"
                " pass input_ids, not inputs_embeds alone"
            )
        ids = input_ids if padding_mask is None else input_ids.masked_fill(~padding_mask, -1)
        context = self.ngram_context_length
        if not context or cache_length == 0:
            return ids, None
        if history_ids is None:
            raise ValueError(
                f"the cache holds {cache_length} tokens and this model has n-gram memories (ngram_layers="
                f"{self.config.ngram_layers}), which hash the tokens before the new ones: pass them as"
                f" ngram_history_ids (the last {context} at least; `generate` does), or run without a cache"
            )
        if history_ids.dim() != 2 or history_ids.shape[0] != ids.shape[0]:
            _refuse("ngram_history_ids", history_ids.shape, f"must be (batch_size={ids.shape[0]}, history_length)")
        if history_ids.shape[1] < min(context, cache_length):
            _refuse(
                "ngram_history_ids",
                history_ids.shape,
                f"holds fewer than the {min(context, cache_length)} tokens before input_ids that the n-gram memories read",
            )
        history = history_ids[:, -context:].long()
        if attention_mask is not None:
            # the mask covers the cached tokens: their padding enters the hash as padding (in a 4-D mask: the cached
            # tokens no new token may attend to)
            start = max(cache_length - history.shape[1], 0)
            if attention_mask.dim() == 2:
                cached_real = attention_mask[:, start:cache_length] != 0
            else:
                cached_real = _allowed_attention(attention_mask)[..., start:cache_length].any(2).any(1)
            history = history.masked_fill(~cached_real, -1)
        if history.shape[1] < context:  # fewer tokens than the memories read: the sequence's start lies in the window
            history = F.pad(history, (context - history.shape[1], 0), value=-1)
        return ids, history

    def _attention_mask(self, attention_mask, embedding_output, cache_length):
        """The additive (batch or 1, 1, query_length, key_length) mask of the self-attention (causal for a decoder),
        or None where every position may attend to every other."""
        length = embedding_output.shape[1]
        if attention_mask is not None and attention_mask.dim() == 4:
            return _additive_mask(attention_mask, embedding_output.dtype)
        allowed = attention_mask[:, None, None, :].bool() if attention_mask is not None else None
        if self.config.is_decoder:
            device = embedding_output.device
            keys = torch.arange(cache_length + length, device=device)
            queries = torch.arange(cache_length, cache_length + length, device=device)
            causal = (keys[None, :] <= queries[:, None])[None, None]
            allowed = causal if allowed is None else allowed & causal
        return _additive_mask(allowed, embedding_output.dtype) if allowed is not None else None

    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, past_length):
        """Shapes always (free); the values of ids in eager mode only, in one host sync (a compiled or exported graph
        holds no data-dependent check). `validate_input_values = False` skips the latter."""
        config = self.config
        if input_ids is not None:
            if input_ids.dim() != 2:
                hint = "; a single sequence needs a batch dimension: input_ids[None]" if input_ids.dim() == 1 else ""
                _refuse("input_ids", input_ids.shape, f"must be 2-D (batch_size, sequence_length){hint}")
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                _refuse("input_ids", input_ids.shape, f"has dtype {input_ids.dtype}; token ids must be integers")
            name, shape = "input_ids", tuple(input_ids.shape)
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
                allowed = f"must be (batch_size, sequence_length, hidden_size={config.hidden_size})"
                _refuse("inputs_embeds", inputs_embeds.shape, allowed)
            name, shape = "inputs_embeds", tuple(inputs_embeds.shape[:2])
        batch, length = shape
        if batch == 0 or length == 0:
            _refuse(name, shape, "holds no token: every batch needs at least one sequence of at least one token")
        last_position = self.first_position + past_length + length - 1
        if position_ids is None and last_position >= config.max_position_embeddings:
            past = f" after past_key_values of {past_length} tokens" if past_length else ""
            raise ValueError(
                f"{name} of shape {shape}: {length} tokens{past} reach position {last_position}, beyond the"
                f" position embeddings (max_position_embeddings={config.max_position_embeddings}); truncate the input"
            )
        if position_ids is not None and tuple(position_ids.shape) not in (shape, (1, length)):
            _refuse("position_ids", position_ids.shape, f"must match {name}: {shape} (or (1, {length}))")
        # token types broadcast over the batch or the positions (exported generation passes one per sequence)
        if token_type_ids is not None and (
            token_type_ids.dim() != 2 or any(size not in (full, 1) for size, full in zip(token_type_ids.shape, shape))
        ):
            _refuse("token_type_ids", token_type_ids.shape, f"must match {name}: {shape} (or broadcast to it)")
        if attention_mask is not None:
            _check_attention_mask(attention_mask, batch, length, past_length)
        if not self.validate_input_values or torch.compiler.is_compiling() or is_exporting():
            return
        # out-of-range ids index the embedding tables: an IndexError on CPU, a device-side assert on GPU
        limits = [
            ("input_ids", input_ids, config.vocab_size),
            ("token_type_ids", token_type_ids, config.type_vocab_size),
            ("position_ids", position_ids, config.max_position_embeddings),
        ]
        limits = [(argument, tensor, bound) for argument, tensor, bound in limits if tensor is not None]
        if not limits:
            return
        extremes = torch.stack([torch.stack(torch.aminmax(t.detach())).to(torch.int64) for _, t, _ in limits]).tolist()
        for (argument, tensor, bound), (low, high) in zip(limits, extremes):
            if low < 0 or high >= bound:
                value = low if low < 0 else high
                _refuse(argument, tensor.shape, f"holds {value}; values must be in [0, {bound - 1}]")


def _refuse(argument, shape, problem):
    raise ValueError(f"{argument} of shape {tuple(shape)} {problem}")


def _check_attention_mask(mask, batch, length, past_length):
    kv_length = past_length + length
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_length):
            past = f" (past_key_values hold {past_length} tokens)" if past_length else ""
            _refuse("attention_mask", mask.shape, f"must be (batch_size, sequence_length) = {(batch, kv_length)}{past}")
    elif mask.dim() == 4:
        if mask.shape[0] not in (1, batch) or tuple(mask.shape[2:]) != (length, kv_length):
            _refuse("attention_mask", mask.shape, f"(4-D) must be ({batch} or 1, heads or 1, {length}, {kv_length})")
    else:
        _refuse("attention_mask", mask.shape, f"must be 2-D {(batch, kv_length)} (1 on real tokens) or a 4-D mask")


def _allowed_attention(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D attention mask as booleans, True where attention is allowed."""
    return mask if mask.dtype == torch.bool else mask > -5000  # masked: -inf, finfo.min, BERT's -10000


def _real_tokens_of_4d_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The real tokens of a 4-D attention mask (True/0 where attention is allowed, False/very negative where not):
    those that may attend to themselves. Exact for a 2-D padding mask broadcast to 4-D and for causal masks with
    padding; a token that others may attend to but that may not attend to itself cannot be told from padding
    (refused)."""
    current = _allowed_attention(mask)[..., -length:]  # (batch, heads, length, length): keys at the current positions
    real = current.diagonal(dim1=-2, dim2=-1).any(1)  # (batch, length)
    if not (torch.compiler.is_compiling() or is_exporting()):
        unclear = current.any(2).any(1) & ~real  # visible to some query, yet not to itself
        if unclear.any():
            sequence, position = (int(i) for i in unclear.nonzero()[0])
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)}: token {position} of sequence {sequence} may be attended"
                " to but may not attend to itself, so the memories cannot tell whether it is padding (their query"
                " BatchNorm must skip padding); pass the 2-D padding mask, or a 4-D mask in which every real token"
                " attends to itself and padding is attended by none"
            )
    return real


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed (a boolean True, or 1 in a 2-D padding mask), the dtype's minimum elsewhere (not
    -inf, so that a query that may attend nothing gets uniform weights rather than NaN); 2-D masks become 4-D. A
    floating 4-D mask is additive already (0 or a large negative number): as it is."""
    if mask.dim() == 4 and mask.is_floating_point():
        return mask
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    allowed = mask.bool()
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


# the input checks and mask helpers, under the public names another model family's file (modeling_modernbert_pkm.py)
# imports them by
refuse_input = _refuse
check_attention_mask = _check_attention_mask
real_tokens_of_4d_mask = _real_tokens_of_4d_mask
additive_mask = _additive_mask


def add_ngram_history(model_inputs: dict, input_ids: torch.Tensor, context: int, kwargs: dict) -> dict:
    """A generation step's inputs with, for n-gram memories reading `context` tokens back, `ngram_history_ids`: the
    tokens before the step's new ones (padding as -1)."""
    new_ids = model_inputs.get("input_ids")
    if context and new_ids is not None and new_ids.shape[1] < input_ids.shape[1]:
        history = input_ids[:, : input_ids.shape[1] - new_ids.shape[1]][:, -context:]
        mask = model_inputs.get("attention_mask", kwargs.get("attention_mask"))
        if mask is not None and mask.dim() == 2 and mask.shape[1] == input_ids.shape[1]:
            history = history.masked_fill(mask[:, : input_ids.shape[1] - new_ids.shape[1]][:, -context:] == 0, -1)
        model_inputs["ngram_history_ids"] = history
    return model_inputs


class BertPkmForMaskedLM(BertPkmPreTrainedModel):
    """BertPkm with a masked language modeling head on top (BERT's, tied to the word embeddings)."""

    _auto_class = "AutoModelForMaskedLM"
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        if config.is_decoder:
            logger.warning(
                "If you want to use `BertPkmForMaskedLM` make sure `config.is_decoder=False` for "
                "bi-directional self-attention."
            )
        self.bert = BertPkmModel(config, add_pooling_layer=False)
        self.cls = BertPkmOnlyMLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | MaskedLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids to predict at the masked positions; `-100` elsewhere (ignored). Other arguments: `BertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            return_dict=True,
            **kwargs,
        )
        prediction_scores = self.cls(outputs[0])

        masked_lm_loss = None
        if labels is not None:
            loss_fct = CrossEntropyLoss()  # -100 index = padding token
            masked_lm_loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))

        output = MaskedLMOutput(
            loss=masked_lm_loss,
            logits=prediction_scores,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class BertPkmForCausalLM(BertPkmPreTrainedModel, GenerationMixin):
    """BertPkm with a language modeling head for causal LM (Lample et al.'s memory setting); `generate` works."""

    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {
        "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        if not config.is_decoder:
            logger.warning("If you want to use `BertPkmForCausalLM` as a standalone, add `is_decoder=True.`")
        self.bert = BertPkmModel(config, add_pooling_layer=False)
        self.cls = BertPkmOnlyMLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' inputs for a generation step; with n-gram memories also `ngram_history_ids`, the tokens
        before the step's new ones (padding as -1), which the memories hash beside them."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        return add_ngram_history(model_inputs, input_ids, self.bert.ngram_context_length, kwargs)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | CausalLMOutputWithCrossAttentions:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Labels for the left-to-right language modeling loss (shifted inside); `-100` is ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            Compute the logits of the last `logits_to_keep` positions only (0: all), or of the positions listed.
        Other arguments: `BertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        if labels is not None:
            use_cache = False

        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            cache=_merge_cache_arguments(cache, past_key_values),
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.cls(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        output = CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return output if return_dict else output.to_tuple()


class BertPkmForSequenceClassification(BertPkmPreTrainedModel):
    """BertPkm with a sequence classification/regression head on the pooled output (GLUE)."""

    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.config = config

        self.bert = BertPkmModel(config)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | SequenceClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class ids in `[0, num_labels)` (cross-entropy), or targets for regression when `num_labels == 1` (MSE).
            Other arguments: `BertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs[1]))

        loss = None
        if labels is not None:
            if self.config.problem_type is None:
                if self.num_labels == 1:
                    self.config.problem_type = "regression"
                elif self.num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
                    self.config.problem_type = "single_label_classification"
                else:
                    self.config.problem_type = "multi_label_classification"

            if self.config.problem_type == "regression":
                loss_fct = MSELoss()
                if self.num_labels == 1:
                    loss = loss_fct(logits.squeeze(), labels.squeeze())
                else:
                    loss = loss_fct(logits, labels)
            elif self.config.problem_type == "single_label_classification":
                loss_fct = CrossEntropyLoss()
                loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            elif self.config.problem_type == "multi_label_classification":
                loss_fct = BCEWithLogitsLoss()
                loss = loss_fct(logits, labels)

        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class BertPkmForMultipleChoice(BertPkmPreTrainedModel):
    """BertPkm with a multiple choice head (a score per choice from the pooled output)."""

    _auto_class = "AutoModelForMultipleChoice"

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)

        self.bert = BertPkmModel(config)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, 1)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
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
        if input_ids is not None and input_ids.dim() != 3:
            _refuse("input_ids", input_ids.shape, "must be 3-D (batch_size, num_choices, sequence_length)")
        if inputs_embeds is not None and inputs_embeds.dim() != 4:
            allowed = "must be 4-D (batch_size, num_choices, sequence_length, hidden_size)"
            _refuse("inputs_embeds", inputs_embeds.shape, allowed)
        num_choices = input_ids.shape[1] if input_ids is not None else inputs_embeds.shape[1]

        def flat(tensor):
            return tensor.reshape(-1, tensor.size(-1)) if tensor is not None else None

        outputs = self.bert(
            flat(input_ids),
            attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids),
            position_ids=flat(position_ids),
            inputs_embeds=inputs_embeds.flatten(0, 1) if inputs_embeds is not None else None,
            return_dict=True,
            **kwargs,
        )
        reshaped_logits = self.classifier(self.dropout(outputs[1])).view(-1, num_choices)

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(reshaped_logits, labels)

        output = MultipleChoiceModelOutput(
            loss=loss, logits=reshaped_logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class BertPkmForTokenClassification(BertPkmPreTrainedModel):
    """BertPkm with a token classification head (e.g. NER)."""

    _auto_class = "AutoModelForTokenClassification"

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.bert = BertPkmModel(config, add_pooling_layer=False)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor] | TokenClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Class ids in `[0, num_labels)` per token; `-100` is ignored. Other arguments: `BertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(self.dropout(outputs[0]))

        loss = None
        if labels is not None:
            loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))

        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class BertPkmForQuestionAnswering(BertPkmPreTrainedModel):
    """BertPkm with a span extraction head (start/end logits) for extractive QA (SQuAD)."""

    _auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.bert = BertPkmModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
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
            `BertPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.qa_outputs(outputs[0])
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


# ----------------------------------------------------------------------------------------------------------------------
# Checked loading and saving, run by `BertPkmPreTrainedModel.from_pretrained`, `save_pretrained` and
# `_adjust_missing_and_unexpected_keys`: memory and FFN tensors missing, unexpected or of another shape; value tables
# that do not match `pkm_shared_values`; the optional weights checksum.
# ----------------------------------------------------------------------------------------------------------------------


class BertPkmLoadingError(ValueError, RuntimeError):
    """A checkpoint that does not fit the model: a ValueError, and the RuntimeError transformers raises for tensors of
    another shape (callers that catch either keep working)."""


def _check_loaded_tensors(model, source, info, ignore_mismatched_sizes, kwargs):
    """Tensors of the encoder layers (memories, FFNs) that the checkpoint misses, holds in excess or in another
    shape mean the model does not compute what was trained: refused. Only a plain BERT checkpoint may miss the
    memories (and carry the FFN of `replace` layers): that is the +Init."""
    missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
    mismatched = {key: (saved, ours) for key, saved, ours in info["mismatched_keys"]}
    checkpoint_keys = (set(model.state_dict()) - missing) | unexpected | set(mismatched)
    # a shared value table (pkm_shared_values) is tied, which transformers may report as loaded: its names are no sign
    # that the checkpoint holds memories (the memories' other tensors are)
    prefix = f"{model.base_model_prefix}." if model.base_model is not model else ""
    checkpoint_keys -= set(shared_values_names(model.config, prefix, model.memory_layer_path)) - unexpected
    path = model.memory_layer_path
    memory_layers = set(model.config.pkm_layers) | {_layer_index(k, path) for k in checkpoint_keys if ".memory." in k}

    def about_memories(key):  # a memory tensor, or the FFN of a memory layer (which pkm_mode keeps or drops)
        layer = _layer_index(key, path)
        ffn = ".attention." not in key and any(part in key for part in model.memory_ffn_parts)
        return layer is not None and (".memory." in key or ".ngram." in key or (layer in memory_layers and ffn))

    # other tensors missing or unexpected: transformers' behaviour (initialised new, listed in its load report)
    missing_layers = sorted(filter(about_memories, missing))
    unexpected_layers = sorted(filter(about_memories, unexpected))
    shapes = [f"{k}: {tuple(a)} in the checkpoint, {tuple(b)} here" for k, (a, b) in sorted(mismatched.items())]
    if ignore_mismatched_sizes:  # transformers' own opt-out, for shapes
        shapes = []
    if not (missing_layers or unexpected_layers or shapes):
        return
    saved_config = _saved_config(type(model.config), source, kwargs)
    # n-gram memories added to a checkpoint saved without them (any BERT or BertPkm one) start new: +Init
    saved_ngram_layers = set(saved_config.get("ngram_layers") or ())
    missing_layers = [k for k in missing_layers if ".ngram." not in k or _layer_index(k, path) in saved_ngram_layers]
    if not (missing_layers or unexpected_layers or shapes):
        return
    # the class's model_type: a config read from a plain checkpoint's config.json holds that checkpoint's model_type
    is_pkm = saved_config.get("model_type") == type(model.config).model_type
    is_pkm = is_pkm or any(".memory." in k for k in checkpoint_keys)
    if not is_pkm:  # +Init of a plain BERT: new memories, the FFN of replace layers dropped
        replaced = model.memory_replaced_parts
        missing_layers = [k for k in missing_layers if ".memory." not in k]
        unexpected_layers = [k for k in unexpected_layers if not any(part in k for part in replaced)]
        if not (missing_layers or unexpected_layers or shapes):
            return
    memories = sorted({_layer_index(k, path) for k in checkpoint_keys if ".memory." in k})
    fields = ("model_type", "pkm_layers", "pkm_mode", "pkm_n_keys")
    fields = {field: saved_config[field] for field in fields if field in saved_config}
    listing = [("missing from the checkpoint (would be initialised at random)", missing_layers)]
    listing += [("in the checkpoint but not in the model (would be dropped)", unexpected_layers)]
    listing += [("of another shape", shapes)]
    report = ""
    for what, keys in listing:
        if keys:
            more = f", ... {len(keys) - 12} more" if len(keys) > 12 else ""
            report += f"\n  {len(keys)} tensor(s) {what}: " + ", ".join(keys[:12]) + more
    raise BertPkmLoadingError(
        f"{source}: the weights do not fit {type(model).__name__} built from the config (pkm_layers="
        f"{model.config.pkm_layers}, pkm_mode={model.config.pkm_mode!r}, pkm_n_keys={model.config.pkm_n_keys}); the"
        f" checkpoint holds memories at layers {memories}; its config.json: {fields}.{report}\nThe loaded model"
        " would not compute what was trained. Fix config.json (or the config= / pkm_* arguments), or pass"
        " ignore_mismatched_memories=True to load anyway with those tensors initialised new"
        " (ignore_mismatched_sizes=True: for tensors of another shape only)"
    )


def _layer_index(key: str, path: str = "encoder.layer.") -> int | None:
    if path not in key or not key.split(path)[1].split(".")[0].isdigit():
        return None
    return int(key.split(path)[1].split(".")[0])


def _saved_config(config_class, source, kwargs) -> dict:
    """The checkpoint's own config.json (read through transformers), or {} when it cannot be read."""
    hub_kwargs = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    try:
        config_dict, _ = config_class.get_config_dict(source, **{k: kwargs[k] for k in hub_kwargs if k in kwargs})
        return config_dict
    except Exception:  # a config passed in memory only, an unreachable Hub: judged from the tensors alone
        return {}


def _verify_weights_checksum(model, source):
    """Refuses loaded weights whose digest differs from the `pkm_weights_checksum` saved with them (loaded in another
    dtype than saved: a warning, not verified)."""
    recorded = model.config.pkm_weights_checksum
    if recorded.get("dtype") != str(model.dtype):
        logger.warning(f"{source}: loaded in {model.dtype}, saved in {recorded.get('dtype')}: checksum not verified")
        return
    same_class = recorded.get("class") == type(model).__name__
    digest = _weights_digest(model.state_dict()) if same_class else _body_digest(model)
    if digest != recorded["model" if same_class else "body"]:
        raise ValueError(
            f"{source}: the loaded weights do not match the pkm_weights_checksum saved with them (sha256 of the"
            f" {'model' if same_class else 'embeddings and encoder'} tensors): the weights file was altered or"
            " corrupted after saving (safetensors does not check the bytes inside tensors). Restore the file, or"
            " pass verify_checksum=False to load it anyway"
        )


def _weights_checksum(model, state_dict: dict | None) -> dict:
    """The `pkm_weights_checksum` that `save_pretrained(..., checksum=True)` records: SHA-256 of the saved tensors, and
    of the embeddings and encoder alone (which every head class shares)."""
    return {
        "algorithm": "sha256",
        "class": type(model).__name__,
        "dtype": str(model.dtype),
        "model": _weights_digest(state_dict if state_dict is not None else model.state_dict()),
        "body": _body_digest(model),
    }


def _weights_digest(state_dict: dict) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of the tensors, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _body_digest(model) -> str:
    """The digest of the embeddings and encoder (what every head class shares; the pooler and heads vary by class)."""
    state_dict = model.base_model.state_dict()
    return _weights_digest({k: v for k, v in state_dict.items() if k.startswith(model.body_prefixes)})


def _check_value_tables(model, missing: set[str]) -> None:
    """A checkpoint's value tables must match `pkm_shared_values` (`missing`: the keys it lacked before tying)."""
    prefix = f"{model.base_model_prefix}." if model.base_model is not model else ""
    memories = [n for n, m in model.named_modules() if isinstance(m, ProductKeyMemory)]
    # a memory whose keys were read but whose values were not: its table was saved under another memory's name
    orphans = [f"{n}.values.weight" for n in memories if f"{n}.values.weight" in missing and f"{n}.keys" not in missing]
    shared = shared_values_names(model.config, prefix, model.memory_layer_path)
    if shared:
        separate = [k for k in shared[1:] if k not in missing or k not in model.all_tied_weights_keys]
        if separate:
            raise ValueError(
                f"the checkpoint holds a separate value table per memory ({separate} besides {shared[0]}) but "
                "the config has pkm_shared_values=True: load it with pkm_shared_values=False"
            )
    elif orphans:
        raise ValueError(
            f"the checkpoint has no value table for {orphans}: it was saved "
            "with pkm_shared_values=True (one table, stored once); load it with pkm_shared_values=True (the "
            "checkpoint's own config) instead of pkm_shared_values=False"
        )


__all__ = [
    "BertPkmForCausalLM",
    "BertPkmForMaskedLM",
    "BertPkmForMultipleChoice",
    "BertPkmForQuestionAnswering",
    "BertPkmForSequenceClassification",
    "BertPkmForTokenClassification",
    "BertPkmLayer",
    "BertPkmModel",
    "BertPkmPreTrainedModel",
]
