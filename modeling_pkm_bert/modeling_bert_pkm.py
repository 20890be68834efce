"""PyTorch BERT with product key memory layers (Kim & Jung 2020, "Large Product Key Memory for PLMs").

Remote code: this file travels with every saved model. It imports only torch, transformers' stable public API
(`PreTrainedModel`, `GenerationMixin`, the `Cache` classes, `modeling_outputs`, the attention registry,
`initialization`, `activations`, `logging`) and its sibling files, and owns its BERT building blocks (copied from
`transformers.models.bert.modeling_bert`, transformers 5.23), so that a folder written today runs under later releases.

Top-down, as `modeling_bert.py`: the building blocks, `BertPkmPreTrainedModel`, `BertPkmModel`, the task heads. What
the three families share (the memory factories, the attention masks, the input checks, the parts of the heads that do
not depend on the backbone, the checked loading and saving of `PkmPreTrainedModel`) is in `modeling_pkm_utils.py`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import (
    Cache,
    DynamicCache,
    EncoderDecoderCache,
    GenerationMixin,
    GradientCheckpointingLayer,
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

# transformers before 5.24 copies only the direct relative imports of a loaded file: every file modeling_pkm_utils needs
# is imported here too
from .configuration_bert_pkm import PKM_CODE_VERSION, BertPkmConfig  # noqa: F401
from .modeling_pkm_utils import (
    ATTENTION_FUNCTIONS,
    CACHE_FIELD,
    BertPkmLoadingError,  # noqa: F401  (importable from here, as before the shared module)
    PkmPreTrainedModel,
    add_ngram_history,
    additive_mask,
    allowed_attention,
    check_id_values,
    check_model_inputs,
    memory_table,  # noqa: F401  (a public name: `modeling_bert_pkm.memory_table(config, rows, dim, sparse)`)
    merge_cache_arguments,
    ngram_memory,
    number_of_choices,
    product_key_memory,
    real_tokens_of_4d_mask,
    refuse_input,
    sequence_classification_loss,
    shared_values_names,
    shared_values_ties,
    value_table,
)
from .ngram_memory import NgramMemory  # noqa: F401
from .product_key_memory import ProductKeyValues
from .product_key_memory_ops import is_exporting  # noqa: F401


logger = logging.get_logger(__name__)


def _resolve(value, config, name):
    return value if value is not None else getattr(config, name, False)


# Copied from transformers.models.bert.modeling_bert.BertEmbeddings with Bert->BertPkm
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
        self.position_ids = nn.Buffer(torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False)
        self.token_type_ids = nn.Buffer(torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

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

        # Setting the token_type_ids to the registered buffer in constructor where it is all zeros, which usually occurs
        # when its auto-generated, registered buffer helps users when tracing the model without passing token_type_ids, solves
        # issue #5664
        if token_type_ids is None:
            if hasattr(self, "token_type_ids"):
                # NOTE: We assume either pos ids to have bsz == 1 (broadcastable) or bsz == effective bsz (input_shape[0])
                buffered_token_type_ids = self.token_type_ids.expand(position_ids.shape[0], -1)
                buffered_token_type_ids = torch.gather(buffered_token_type_ids, dim=1, index=position_ids)
                token_type_ids = buffered_token_type_ids.expand(batch_size, seq_length)
            else:
                token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=self.position_ids.device)

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


# Copied from transformers.models.bert.modeling_bert.eager_attention_forward
# Differs: `**kwargs: Unpack[TransformersKwargs],` -> `**kwargs,`
# Differs: `attn_weights + attention_mask` -> `attn_weights + _mask_for(query, attention_mask)`
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


# Copied from transformers.models.bert.modeling_bert.BertSelfAttention with Bert->BertPkm
# Differs: `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")` -> ``
# Differs: `**kwargs: Unpack[TransformersKwargs],` -> `**kwargs,`
# Differs: `self.layer_idx, kwargs=kwargs)` -> `self.layer_idx)`
# Differs: `attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(\n            self.config._attn_implementation, eager_attention_forward\n        )` -> ``
# Differs: `= attention_interface(` -> `= attention_function(self.config._attn_implementation)(`
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
    ) -> tuple[torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)

        # get all proj
        query_layer = self.query(hidden_states).view(*hidden_shape).transpose(1, 2)
        key_layer = self.key(hidden_states).view(*hidden_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(*hidden_shape).transpose(1, 2)

        if cache is not None:
            # decoder-only bert can have a simple dynamic cache for example
            current_cache = cache
            if isinstance(cache, EncoderDecoderCache):
                current_cache = cache.self_attention_cache

            # save all key/value_layer to cache to be re-used for fast auto-regressive generation
            key_layer, value_layer = current_cache.update(key_layer, value_layer, self.layer_idx)

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


# Copied from transformers.models.bert.modeling_bert.BertCrossAttention with Bert->BertPkm
# Differs: `@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")` -> ``
# Differs: `**kwargs: Unpack[TransformersKwargs],` -> `**kwargs,`
# Differs: `attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(\n            self.config._attn_implementation, eager_attention_forward\n        )` -> ``
# Differs: `= attention_interface(` -> `= attention_function(self.config._attn_implementation)(`
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
    ) -> tuple[torch.Tensor]:
        # determine input shapes
        input_shape = hidden_states.shape[:-1]

        hidden_shape = (*input_shape, -1, self.attention_head_size)

        # get query proj
        query_layer = self.query(hidden_states).view(hidden_shape).transpose(1, 2)

        is_updated = cache.is_updated.get(self.layer_idx) if cache is not None else False
        if cache is not None and is_updated:
            # reuse k,v, cross_attentions
            key_layer = cache.cross_attention_cache.layers[self.layer_idx].keys
            value_layer = cache.cross_attention_cache.layers[self.layer_idx].values
        else:
            kv_shape = (*encoder_hidden_states.shape[:-1], -1, self.attention_head_size)
            key_layer = self.key(encoder_hidden_states).view(kv_shape).transpose(1, 2)
            value_layer = self.value(encoder_hidden_states).view(kv_shape).transpose(1, 2)

            if cache is not None:
                # save all states to the cache
                key_layer, value_layer = cache.cross_attention_cache.update(key_layer, value_layer, self.layer_idx)
                # set flag that curr layer for cross-attn is already updated so we can re-use in subsequent calls
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


class BertPkmAttention(nn.Module):
    """BERT's attention block (transformers' `BertAttention`), ours: the encoder states go to the cross-attention
    only (our self-attention takes none)."""

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


def apply_chunking_to_forward(forward_fn, chunk_size: int, chunk_dim: int, *input_tensors) -> torch.Tensor:
    """`forward_fn` on chunks of `chunk_size` along `chunk_dim` (less peak memory, the same result); 0: at once. Ours,
    in the manner of transformers' `pytorch_utils.apply_chunking_to_forward` (whose argument checks our calls need
    not)."""
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


class BertPkmPreTrainedModel(PkmPreTrainedModel):
    """BERT's weight initialisation under the memories' (`PkmPreTrainedModel`: also the checked loading and saving)
    shared by every BertPkm model."""

    config: BertPkmConfig
    base_model_prefix = "bert"
    # what the checked loading reads in tensor names: where the layers are, the FFN tensors of a layer (kept by "resm",
    # dropped by "replace"), those "replace" drops from a plain checkpoint, and the body that every head class shares
    # (the checksum's "body")
    memory_layer_path = "encoder.layer."
    memory_ffn_parts = (".intermediate.", ".output.")
    memory_replaced_parts = (".intermediate.dense.", ".output.dense.")
    body_prefixes = ("embeddings.", "encoder.")

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BertPkmLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, BertPkmEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)


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
        if shared_values_names(config):
            self._tied_weights_keys = shared_values_ties(config, self.memory_layer_path)

        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # the shared value table is tied whatever `tie_word_embeddings` says (that flag is about the embeddings)
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return shared_values_ties(self.config, self.memory_layer_path)

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
        cache = merge_cache_arguments(cache, past_key_values)
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
            real = real_tokens_of_4d_mask(attention_mask, embedding_output.shape[1])
            padding_mask = real.expand(embedding_output.shape[0], -1)

        ngram_ids, ngram_history_ids = self._ngram_inputs(
            input_ids, padding_mask, attention_mask, cache_length, ngram_history_ids
        )
        extended_attention_mask = self._attention_mask(attention_mask, embedding_output, cache_length)
        if encoder_attention_mask is not None:
            encoder_attention_mask = additive_mask(encoder_attention_mask, embedding_output.dtype)

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
            refuse_input("ngram_history_ids", history_ids.shape, f"must be (batch_size={ids.shape[0]}, history_length)")
        if history_ids.shape[1] < min(context, cache_length):
            refuse_input(
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
                cached_real = allowed_attention(attention_mask)[..., start:cache_length].any(2).any(1)
            history = history.masked_fill(~cached_real, -1)
        if history.shape[1] < context:  # fewer tokens than the memories read: the sequence's start lies in the window
            history = F.pad(history, (context - history.shape[1], 0), value=-1)
        return ids, history

    def _attention_mask(self, attention_mask, embedding_output, cache_length):
        """The additive (batch or 1, 1, query_length, key_length) mask of the self-attention (causal for a decoder),
        or None where every position may attend to every other."""
        length = embedding_output.shape[1]
        if attention_mask is not None and attention_mask.dim() == 4:
            return additive_mask(attention_mask, embedding_output.dtype)
        allowed = attention_mask[:, None, None, :].bool() if attention_mask is not None else None
        if self.config.is_decoder:
            device = embedding_output.device
            keys = torch.arange(cache_length + length, device=device)
            queries = torch.arange(cache_length, cache_length + length, device=device)
            causal = (keys[None, :] <= queries[:, None])[None, None]
            allowed = causal if allowed is None else allowed & causal
        return additive_mask(allowed, embedding_output.dtype) if allowed is not None else None

    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, past_length):
        """Shapes always (free); the values of ids in eager mode only, in one host sync (a compiled or exported graph
        holds no data-dependent check). `validate_input_values = False` skips the latter."""
        config = self.config
        check_model_inputs(
            config, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, past_length,
            first_position=self.first_position,
        )  # fmt: skip
        if self.validate_input_values:
            check_id_values([
                ("input_ids", input_ids, config.vocab_size),
                ("token_type_ids", token_type_ids, config.type_vocab_size),
                ("position_ids", position_ids, config.max_position_embeddings),
            ])  # fmt: skip


class BertPkmForMaskedLM(BertPkmPreTrainedModel):
    """BertPkm with a masked language modeling head on top, tied to the word embeddings."""

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
            cache=merge_cache_arguments(cache, past_key_values),
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
        loss = sequence_classification_loss(self, logits, labels)

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
        num_choices = number_of_choices(input_ids, inputs_embeds)

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
