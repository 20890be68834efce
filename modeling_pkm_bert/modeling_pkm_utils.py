"""The machinery the PKM model families share (BertPkm, RobertaPkm, ModernBertPkm), written once: the memory factories,
the attention-mask helpers, the input checks, the parts of the task heads that do not depend on the backbone, and the
checked loading and saving (`PkmPreTrainedModel`, the base of every family's `*PreTrainedModel`).

Remote code: this file travels with every saved model, as the families' files that import it. It imports only torch,
transformers' stable public API and its sibling files (`from .x import Y`), and does no I/O.
"""

import functools
import hashlib

import torch
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
from transformers.utils import logging

from .configuration_bert_pkm import PKM_CODE_VERSION
from .ngram_memory import NgramMemory
from .product_key_memory import VALUE_QUANTIZATIONS, ProductKeyMemory, ProductKeyValues, QuantizedProductKeyValues
from .product_key_memory_ops import is_exporting


logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`: the models accept both
# names and fill the field that the installed release's outputs (and its `generate`) have
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithCrossAttentions.__dataclass_fields__ else "past_key_values"

# attention kernels registered with transformers by name (`AttentionInterface.register`); eager and sdpa are each
# family's own
ATTENTION_FUNCTIONS = AttentionInterface()


def merge_cache_arguments(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once: `cache` (transformers >= 5.24) or `past_key_values`, not both")
    return cache if cache is not None else past_key_values


# ----------------------------------------------------------------------------------------------------------------------
# Memory factories: the product key and n-gram memories of a layer, their value tables
# ----------------------------------------------------------------------------------------------------------------------


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


def shared_values_ties(config, layer_path: str) -> dict[str, str]:
    """With `pkm_shared_values`, the tied weights of a bare model: every memory's value table name -> the first's."""
    names = shared_values_names(config, layer_path=layer_path)
    return {name: names[0] for name in names[1:]}


# ----------------------------------------------------------------------------------------------------------------------
# Attention masks and input checks
# ----------------------------------------------------------------------------------------------------------------------


def refuse_input(argument, shape, problem):
    raise ValueError(f"{argument} of shape {tuple(shape)} {problem}")


def check_attention_mask(mask, batch, length, past_length):
    kv_length = past_length + length
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_length):
            past = f" (past_key_values hold {past_length} tokens)" if past_length else ""
            refuse_input("attention_mask", mask.shape, f"must be (batch_size, sequence_length) = {(batch, kv_length)}{past}")
    elif mask.dim() == 4:
        if mask.shape[0] not in (1, batch) or tuple(mask.shape[2:]) != (length, kv_length):
            refuse_input("attention_mask", mask.shape, f"(4-D) must be ({batch} or 1, heads or 1, {length}, {kv_length})")
    else:
        refuse_input("attention_mask", mask.shape, f"must be 2-D {(batch, kv_length)} (1 on real tokens) or a 4-D mask")


def allowed_attention(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D attention mask as booleans, True where attention is allowed."""
    return mask if mask.dtype == torch.bool else mask > -5000  # masked: -inf, finfo.min, BERT's -10000


def real_tokens_of_4d_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The real tokens of a 4-D attention mask (True/0 where attention is allowed, False/very negative where not):
    those that may attend to themselves. Exact for a 2-D padding mask broadcast to 4-D and for causal masks with
    padding; a token that others may attend to but that may not attend to itself cannot be told from padding
    (refused)."""
    current = allowed_attention(mask)[..., -length:]  # (batch, heads, length, length): keys at the current positions
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


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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



def check_model_inputs(
    config, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids=None, past_length=0, first_position=None
) -> None:
    """The shapes of a bare model's inputs (free: no host sync). `first_position`: the position of the first token
    (BertPkm 0, RobertaPkm `padding_idx + 1`), for the check that the tokens stay within the position embeddings;
    None for rotary positions (no table to overrun)."""
    if input_ids is not None:
        if input_ids.dim() != 2:
            hint = "; a single sequence needs a batch dimension: input_ids[None]" if input_ids.dim() == 1 else ""
            refuse_input("input_ids", input_ids.shape, f"must be 2-D (batch_size, sequence_length){hint}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            refuse_input("input_ids", input_ids.shape, f"has dtype {input_ids.dtype}; token ids must be integers")
        name, shape = "input_ids", tuple(input_ids.shape)
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
            allowed = f"must be (batch_size, sequence_length, hidden_size={config.hidden_size})"
            refuse_input("inputs_embeds", inputs_embeds.shape, allowed)
        name, shape = "inputs_embeds", tuple(inputs_embeds.shape[:2])
    batch, length = shape
    if batch == 0 or length == 0:
        refuse_input(name, shape, "holds no token: every batch needs at least one sequence of at least one token")
    if first_position is not None:
        last_position = first_position + past_length + length - 1
        if position_ids is None and last_position >= config.max_position_embeddings:
            past = f" after past_key_values of {past_length} tokens" if past_length else ""
            raise ValueError(
                f"{name} of shape {shape}: {length} tokens{past} reach position {last_position}, beyond the"
                f" position embeddings (max_position_embeddings={config.max_position_embeddings}); truncate the input"
            )
    if position_ids is not None and tuple(position_ids.shape) not in (shape, (1, length)):
        refuse_input("position_ids", position_ids.shape, f"must match {name}: {shape} (or (1, {length}))")
    # token types broadcast over the batch or the positions (exported generation passes one per sequence)
    if token_type_ids is not None and (
        token_type_ids.dim() != 2 or any(size not in (full, 1) for size, full in zip(token_type_ids.shape, shape))
    ):
        refuse_input("token_type_ids", token_type_ids.shape, f"must match {name}: {shape} (or broadcast to it)")
    if attention_mask is not None:
        check_attention_mask(attention_mask, batch, length, past_length)


def check_id_values(limits: list[tuple[str, torch.Tensor | None, int]]) -> None:
    """Each (argument, ids or None, bound): the ids lie in [0, bound), checked in one host sync, in eager mode only (a
    compiled or exported graph holds no data-dependent check). Out-of-range ids index an embedding table: an IndexError
    on CPU, a device-side assert on GPU."""
    if torch.compiler.is_compiling() or is_exporting():
        return
    limits = [(argument, tensor, bound) for argument, tensor, bound in limits if tensor is not None]
    if not limits:
        return
    extremes = torch.stack([torch.stack(torch.aminmax(t.detach())).to(torch.int64) for _, t, _ in limits]).tolist()
    for (argument, tensor, bound), (low, high) in zip(limits, extremes):
        if low < 0 or high >= bound:
            value = low if low < 0 else high
            refuse_input(argument, tensor.shape, f"holds {value}; values must be in [0, {bound - 1}]")


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


# ----------------------------------------------------------------------------------------------------------------------
# The task heads' parts that do not depend on the backbone
# ----------------------------------------------------------------------------------------------------------------------


def sequence_classification_loss(model, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """The loss of a sequence classification head (transformers' rule): by `config.problem_type`, set from the labels
    when the config has none (recorded there, as transformers does): MSE for `num_labels == 1` (regression),
    cross-entropy for integer labels, BCE with logits otherwise (multi-label)."""
    if labels is None:
        return None
    config, num_labels = model.config, model.num_labels
    if config.problem_type is None:
        if num_labels == 1:
            config.problem_type = "regression"
        elif num_labels > 1 and (labels.dtype == torch.long or labels.dtype == torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"

    loss = None
    if config.problem_type == "regression":
        loss_fct = MSELoss()
        if num_labels == 1:
            loss = loss_fct(logits.squeeze(), labels.squeeze())
        else:
            loss = loss_fct(logits, labels)
    elif config.problem_type == "single_label_classification":
        loss_fct = CrossEntropyLoss()
        loss = loss_fct(logits.view(-1, num_labels), labels.view(-1))
    elif config.problem_type == "multi_label_classification":
        loss_fct = BCEWithLogitsLoss()
        loss = loss_fct(logits, labels)
    return loss


def number_of_choices(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> int:
    """The choices of a multiple choice head's inputs, which must be (batch_size, num_choices, sequence_length) ids or
    (batch_size, num_choices, sequence_length, hidden_size) embeddings."""
    if input_ids is not None and input_ids.dim() != 3:
        refuse_input("input_ids", input_ids.shape, "must be 3-D (batch_size, num_choices, sequence_length)")
    if inputs_embeds is not None and inputs_embeds.dim() != 4:
        allowed = "must be 4-D (batch_size, num_choices, sequence_length, hidden_size)"
        refuse_input("inputs_embeds", inputs_embeds.shape, allowed)
    return input_ids.shape[1] if input_ids is not None else inputs_embeds.shape[1]


# ----------------------------------------------------------------------------------------------------------------------
# Checked loading and saving, run by `PkmPreTrainedModel.from_pretrained`, `save_pretrained` and
# `_adjust_missing_and_unexpected_keys`: memory and FFN tensors missing, unexpected or of another shape; value tables
# that do not match `pkm_shared_values`; the optional weights checksum.
# ----------------------------------------------------------------------------------------------------------------------


class PkmPreTrainedModel(PreTrainedModel):
    """What every PKM model shares, whatever its backbone: the memories' initialisation, the checked loading and saving
    (the checks: below) and the attention kernels. Each family's `*PreTrainedModel` subclasses it and names where its
    tensors are: `memory_layer_path` (where the layers are, e.g. `"encoder.layer."`), `memory_ffn_parts` (the FFN
    tensors of a layer, kept by "resm", dropped by "replace"), `memory_replaced_parts` (those "replace" drops from a
    plain checkpoint) and `body_prefixes` (the body that every head class shares: the checksum's "body")."""

    supports_gradient_checkpointing = True
    # eager and sdpa are the families' own; other kernels registered with transformers' AttentionInterface get the
    # additive 4-D mask (flash and flex attention need masks in their own formats: not supported)
    _supports_sdpa = True
    _supports_attention_backend = True
    memory_layer_path: str
    memory_ffn_parts: tuple[str, ...]
    memory_replaced_parts: tuple[str, ...]
    body_prefixes: tuple[str, ...]

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
        """transformers' initialisation, then the memories' (the families add their own modules')."""
        super()._init_weights(module)
        if isinstance(module, ProductKeyMemory):
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
