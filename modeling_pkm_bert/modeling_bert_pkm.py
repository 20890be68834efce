"""PyTorch BERT with product key memory layers (Kim & Jung 2020, "Large Product Key Memory for PLMs")."""

import hashlib

import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
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
from transformers.modeling_utils import PreTrainedModel
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertCrossAttention,
    BertEmbeddings,
    BertIntermediate,
    BertLMPredictionHead,
    BertOnlyMLMHead,
    BertOutput,
    BertPooler,
    BertSelfAttention,
)
from transformers.processing_utils import Unpack
from transformers.pytorch_utils import apply_chunking_to_forward
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_bert_pkm import BertPkmConfig
from .product_key_memory import ProductKeyMemory, ProductKeyValues, _is_exporting


logger = logging.get_logger(__name__)


class BertPkmMemoryOutput(nn.Module):
    """The LayerNorm closing a layer whose FFN was replaced by the memory: LN(x + PKM(x))."""

    def __init__(self, config):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(hidden_states)


class BertPkmLayer(GradientCheckpointingLayer):
    """A BERT layer; at `config.pkm_layers` with a memory beside (`resm`) or instead of (`replace`) the FFN."""

    def __init__(self, config, layer_idx=None, shared_values: ProductKeyValues | None = None):
        super().__init__()
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.attention = BertAttention(config, is_causal=config.is_decoder, layer_idx=layer_idx)
        self.is_decoder = config.is_decoder
        self.add_cross_attention = config.add_cross_attention
        if self.add_cross_attention:
            if not self.is_decoder:
                raise ValueError(f"{self} should be used as a decoder model if cross attention is added")
            self.crossattention = BertAttention(config, is_causal=False, layer_idx=layer_idx, is_cross_attention=True)

        has_memory = layer_idx in config.pkm_layers
        self.memory = (
            ProductKeyMemory(
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
            if has_memory
            else None
        )
        if has_memory:
            self.memory.layer_name = f"encoder.layer.{layer_idx}.memory"
        if has_memory and config.pkm_mode == "replace":
            self.intermediate = None
            self.output = BertPkmMemoryOutput(config)
        else:
            self.intermediate = BertIntermediate(config)
            self.output = BertOutput(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attention_output, _ = self.attention(hidden_states, attention_mask, past_key_values=past_key_values, **kwargs)

        if self.is_decoder and encoder_hidden_states is not None:
            if not hasattr(self, "crossattention"):
                raise ValueError(
                    f"If `encoder_hidden_states` are passed, {self} has to be instantiated with cross-attention layers"
                    " by setting `config.add_cross_attention=True`"
                )
            attention_output, _ = self.crossattention(
                attention_output,
                None,  # attention_mask
                encoder_hidden_states,
                encoder_attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )

        residual = attention_output
        if self.memory is not None:
            residual = attention_output + self.memory(attention_output, padding_mask)
        if self.intermediate is None:
            return self.output(residual)
        return apply_chunking_to_forward(
            self.feed_forward_chunk, self.chunk_size_feed_forward, self.seq_len_dim, attention_output, residual
        )

    def feed_forward_chunk(self, attention_output, residual):
        return self.output(self.intermediate(attention_output), residual)


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


def shared_values_names(config, prefix: str = "") -> list[str]:
    """With `pkm_shared_values`, the names under which the one value table appears, the first memory's first."""
    if not (getattr(config, "pkm_shared_values", False) and config.pkm_layers):
        return []
    return [f"{prefix}encoder.layer.{i}.memory.values.weight" for i in sorted(config.pkm_layers)]


class BertPkmEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # pkm_shared_values: one table, the same module object in every memory layer (Memory+)
        shared = ProductKeyValues(config.pkm_mem_size, config.hidden_size) if shared_values_names(config) else None
        self.layer = nn.ModuleList(
            [BertPkmLayer(config, layer_idx=i, shared_values=shared) for i in range(config.num_hidden_layers)]
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        for layer_module in self.layer:
            hidden_states = layer_module(
                hidden_states,
                attention_mask,
                encoder_hidden_states,  # as a positional argument for gradient checkpointing
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                padding_mask=padding_mask,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states, past_key_values=past_key_values if use_cache else None
        )


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
    return _weights_digest({k: v for k, v in state_dict.items() if k.startswith(("embeddings.", "encoder."))})


def _saved_config(config_class, source, kwargs) -> dict:
    """The checkpoint's own config.json (read through transformers), or {} when it cannot be read."""
    hub_kwargs = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    try:
        config_dict, _ = config_class.get_config_dict(source, **{k: kwargs[k] for k in hub_kwargs if k in kwargs})
        return config_dict
    except Exception:  # a config passed in memory only, an unreachable Hub: judged from the tensors alone
        return {}


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


def _real_tokens_of_4d_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The real tokens of a 4-D attention mask (True/0 where attention is allowed, False/very negative where not):
    those that may attend to themselves. Exact for a 2-D padding mask broadcast to 4-D and for causal masks with
    padding; a token that others may attend to but that may not attend to itself cannot be told from padding
    (refused)."""
    allowed = mask if mask.dtype == torch.bool else mask > -5000  # masked: -inf, finfo.min, BERT's -10000
    current = allowed[..., -length:]  # (batch, heads, length, length): keys at the current positions
    real = current.diagonal(dim1=-2, dim2=-1).any(1)  # (batch, length)
    if not (torch.compiler.is_compiling() or _is_exporting()):
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


@auto_docstring
class BertPkmPreTrainedModel(PreTrainedModel):
    config: BertPkmConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": BertPkmLayer,
        "attentions": BertSelfAttention,
        "cross_attentions": BertCrossAttention,
    }

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
            model._check_loaded_tensors(pretrained_model_name_or_path, info, ignore_mismatched_sizes, kwargs)
        if verify_checksum and model.config.pkm_weights_checksum:
            model._verify_weights_checksum(pretrained_model_name_or_path)
        return (model, info) if output_loading_info else model

    def _check_loaded_tensors(self, source, info, ignore_mismatched_sizes, kwargs):
        """Tensors of the encoder layers (memories, FFNs) that the checkpoint misses, holds in excess or in another
        shape mean the model does not compute what was trained: refused. Only a plain BERT checkpoint may miss the
        memories (and carry the FFN of `replace` layers): that is the +Init."""
        missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
        mismatched = {key: (saved, ours) for key, saved, ours in info["mismatched_keys"]}
        in_layers = lambda keys: sorted(k for k in keys if "encoder.layer." in k)  # noqa: E731
        missing_layers, unexpected_layers = in_layers(missing), in_layers(unexpected)
        shapes = [f"{k}: {tuple(a)} in the checkpoint, {tuple(b)} here" for k, (a, b) in sorted(mismatched.items())]
        if ignore_mismatched_sizes:  # transformers' own opt-out, for shapes
            shapes = []
        if not (missing_layers or unexpected_layers or shapes):
            return
        checkpoint_keys = (set(self.state_dict()) - missing) | unexpected | set(mismatched)
        saved_config = _saved_config(type(self.config), source, kwargs)
        is_pkm = saved_config.get("model_type") == self.config.model_type
        is_pkm = is_pkm or any(".memory." in k for k in checkpoint_keys)
        if not is_pkm:  # +Init of a plain BERT: new memories, the FFN of replace layers dropped
            replaced = (".intermediate.dense.", ".output.dense.")
            missing_layers = [k for k in missing_layers if ".memory." not in k]
            unexpected_layers = [k for k in unexpected_layers if not any(part in k for part in replaced)]
            if not (missing_layers or unexpected_layers or shapes):
                return
        memories = sorted({int(k.split("encoder.layer.")[1].split(".")[0]) for k in checkpoint_keys if ".memory." in k})
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
        raise ValueError(
            f"{source}: the weights do not fit {type(self).__name__} built from the config (pkm_layers="
            f"{self.config.pkm_layers}, pkm_mode={self.config.pkm_mode!r}, pkm_n_keys={self.config.pkm_n_keys}); the"
            f" checkpoint holds memories at layers {memories}; its config.json: {fields}.{report}\nThe loaded model"
            " would not compute what was trained. Fix config.json (or the config= / pkm_* arguments), or pass"
            " ignore_mismatched_memories=True to load anyway with those tensors initialised new"
            " (ignore_mismatched_sizes=True: for tensors of another shape only)"
        )

    def _verify_weights_checksum(self, source):
        recorded = self.config.pkm_weights_checksum
        if recorded.get("dtype") != str(self.dtype):
            logger.warning(f"{source}: loaded in {self.dtype}, saved in {recorded.get('dtype')}: checksum not verified")
            return
        same_class = recorded.get("class") == type(self).__name__
        digest = _weights_digest(self.state_dict()) if same_class else _body_digest(self)
        if digest != recorded["model" if same_class else "body"]:
            raise ValueError(
                f"{source}: the loaded weights do not match the pkm_weights_checksum saved with them (sha256 of the"
                f" {'model' if same_class else 'embeddings and encoder'} tensors): the weights file was altered or"
                " corrupted after saving (safetensors does not check the bytes inside tensors). Restore the file, or"
                " pass verify_checksum=False to load it anyway"
            )

    def save_pretrained(self, save_directory, *args, checksum: bool | None = None, **kwargs):
        r"""
        [`~PreTrainedModel.save_pretrained`]; with `checksum=True` the config records the SHA-256 of the saved
        tensors (`pkm_weights_checksum`), which `from_pretrained` verifies. `None` (default) keeps a loaded
        model's choice: a checksum is recomputed when the config holds one.
        """
        if checksum is None:
            checksum = self.config.pkm_weights_checksum is not None
        state_dict = kwargs.get("state_dict")
        self.config.pkm_weights_checksum = (
            {
                "algorithm": "sha256",
                "class": type(self).__name__,
                "dtype": str(self.dtype),
                "model": _weights_digest(state_dict if state_dict is not None else self.state_dict()),
                "body": _body_digest(self),
            }
            if checksum
            else None
        )
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BertLMPredictionHead):
            init.zeros_(module.bias)
        elif isinstance(module, BertEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)
        elif isinstance(module, ProductKeyMemory):
            # its query Linear and BatchNorm are initialised as BERT's; keys and values as XLM's (a shared table: by
            # every memory alike); the options' parameters as their papers'
            bound = (module.k_dim // 2) ** -0.5
            init.uniform_(module.keys, -bound, bound)
            if module.value_init == "zeros":
                init.zeros_(module.values.weight)
            else:
                init.normal_(module.values.weight, mean=0.0, std=module.v_dim**-0.5)
            module.reset_option_parameters(init)
            if module.memory_scale is not None:
                init.constant_(module.memory_scale, self.config.pkm_memory_scale)

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
        prefix = f"{self.base_model_prefix}." if self.base_model is not self else ""
        memories = [n for n, m in self.named_modules() if isinstance(m, ProductKeyMemory)]
        # a memory whose keys were read but whose values were not: its table was saved under another memory's name
        orphans = [f"{n}.values.weight" for n in memories if f"{n}.values.weight" in missing and f"{n}.keys" not in missing]
        shared = shared_values_names(self.config, prefix)
        if shared:
            separate = [k for k in shared[1:] if k not in missing or k not in self.all_tied_weights_keys]
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


@auto_docstring(custom_intro="The bare BertPkm model: BERT with product key memory layers at `config.pkm_layers`.")
class BertPkmModel(BertPkmPreTrainedModel):
    _auto_class = "AutoModel"
    _no_split_modules = ["BertEmbeddings", "BertPkmLayer"]
    # eager forwards check that ids index the embedding tables (one host sync); False skips it
    validate_input_values = True

    def __init__(self, config: BertPkmConfig, add_pooling_layer=True):
        r"""
        add_pooling_layer (bool, *optional*, defaults to `True`):
            Whether to add a pooling layer
        """
        super().__init__(config)
        self.config = config
        self.gradient_checkpointing = False

        self.embeddings = BertEmbeddings(config)
        self.encoder = BertPkmEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
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

    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | BaseModelOutputWithPoolingAndCrossAttentions:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if self.config.is_decoder:
            use_cache = use_cache if use_cache is not None else self.config.use_cache
        else:
            use_cache = False

        if use_cache and past_key_values is None:
            past_key_values = (
                EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
                if encoder_hidden_states is not None or self.config.is_encoder_decoder
                else DynamicCache(config=self.config)
            )

        past_key_values_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        self._check_inputs(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, past_key_values_length
        )

        embedding_output = self.embeddings(
            input_ids=input_ids,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
            past_key_values_length=past_key_values_length,
        )

        # the memories read real tokens only: the 2-D mask of the current positions, or the tokens a 4-D mask lets
        # attend to themselves
        padding_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            padding_mask = attention_mask[:, -embedding_output.shape[1] :].bool()
        elif attention_mask is not None and attention_mask.dim() == 4 and self.config.pkm_layers:
            real = _real_tokens_of_4d_mask(attention_mask, embedding_output.shape[1])
            padding_mask = real.expand(embedding_output.shape[0], -1)

        attention_mask, encoder_attention_mask = self._create_attention_masks(
            attention_mask=attention_mask,
            encoder_attention_mask=encoder_attention_mask,
            embedding_output=embedding_output,
            encoder_hidden_states=encoder_hidden_states,
            past_key_values=past_key_values,
        )

        encoder_outputs = self.encoder(
            embedding_output,
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_ids=position_ids,
            padding_mask=padding_mask,
            **kwargs,
        )
        sequence_output = encoder_outputs.last_hidden_state
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None

        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=sequence_output,
            pooler_output=pooled_output,
            past_key_values=encoder_outputs.past_key_values,
        )

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
        if position_ids is None and past_length + length > config.max_position_embeddings:
            past = f" after past_key_values of {past_length} tokens" if past_length else ""
            raise ValueError(
                f"{name} of shape {shape}: {length} tokens{past} reach position {past_length + length - 1}, beyond the"
                f" position embeddings (max_position_embeddings={config.max_position_embeddings}); truncate the input"
            )
        for argument, tensor in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if tensor is not None and tuple(tensor.shape) not in (shape, (1, length)):
                _refuse(argument, tensor.shape, f"must match {name}: {shape} (or (1, {length}))")
        if attention_mask is not None:
            _check_attention_mask(attention_mask, batch, length, past_length)
        if not self.validate_input_values or torch.compiler.is_compiling() or _is_exporting():
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

    def _create_attention_masks(
        self, attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states, past_key_values
    ):
        if self.config.is_decoder:
            attention_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=embedding_output,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
            )
        else:
            attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=embedding_output, attention_mask=attention_mask
            )

        if encoder_attention_mask is not None:
            encoder_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=embedding_output,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )
        return attention_mask, encoder_attention_mask


@auto_docstring(custom_intro="BertPkm with a masked language modeling head on top.")
class BertPkmForMaskedLM(BertPkmPreTrainedModel):
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
        self.cls = BertOnlyMLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    @can_return_tuple
    @auto_docstring
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
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | MaskedLMOutput:
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

        return MaskedLMOutput(
            loss=masked_lm_loss,
            logits=prediction_scores,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


@auto_docstring(custom_intro="BertPkm with a language modeling head for causal LM (Lample et al.'s memory setting).")
class BertPkmForCausalLM(BertPkmPreTrainedModel, GenerationMixin):
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
        self.cls = BertOnlyMLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings
        self.cls.predictions.bias = new_embeddings.bias

    @can_return_tuple
    @auto_docstring
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
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | CausalLMOutputWithCrossAttentions:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Labels for the left-to-right language modeling loss; `-100` is ignored.
        """
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
            past_key_values=past_key_values,
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

        return CausalLMOutputWithCrossAttentions(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
        )


@auto_docstring(custom_intro="BertPkm with a sequence classification/regression head on the pooled output (GLUE).")
class BertPkmForSequenceClassification(BertPkmPreTrainedModel):
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

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | SequenceClassifierOutput:
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

        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@auto_docstring(custom_intro="BertPkm with a multiple choice head (a score per choice from the pooled output).")
class BertPkmForMultipleChoice(BertPkmPreTrainedModel):
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

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | MultipleChoiceModelOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch_size, num_choices, sequence_length)`):
            Indices of input sequence tokens in the vocabulary, one sequence per choice.
        """
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

        return MultipleChoiceModelOutput(
            loss=loss, logits=reshaped_logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@auto_docstring(custom_intro="BertPkm with a token classification head (e.g. NER).")
class BertPkmForTokenClassification(BertPkmPreTrainedModel):
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

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | TokenClassifierOutput:
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

        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


@auto_docstring(custom_intro="BertPkm with a span extraction head (start/end logits) for extractive QA (SQuAD).")
class BertPkmForQuestionAnswering(BertPkmPreTrainedModel):
    _auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, config: BertPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.bert = BertPkmModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)

        self.post_init()

    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor] | QuestionAnsweringModelOutput:
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
            # If we are on multi-GPU, split add a dimension
            if len(start_positions.size()) > 1:
                start_positions = start_positions.squeeze(-1)
            if len(end_positions.size()) > 1:
                end_positions = end_positions.squeeze(-1)
            # sometimes the start/end positions are outside our model inputs, we ignore these terms
            ignored_index = start_logits.size(1)
            start_positions = start_positions.clamp(0, ignored_index)
            end_positions = end_positions.clamp(0, ignored_index)

            loss_fct = CrossEntropyLoss(ignore_index=ignored_index)
            total_loss = (loss_fct(start_logits, start_positions) + loss_fct(end_logits, end_positions)) / 2

        return QuestionAnsweringModelOutput(
            loss=total_loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
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
