"""ModernBertPkm model configuration: ModernBERT (and Ettin / mmBERT encoders, the same model type) plus product key
memory (PKM) layers and hashed n-gram memories."""

from huggingface_hub.dataclasses import strict
from transformers import ModernBertConfig

from .configuration_bert_pkm import PKM_MAX_MEMORY_PARAMETERS, BertPkmConfig

# transformers before 5.24 copies only the direct relative imports of a loaded file: the files configuration_bert_pkm
# needs are imported here too
from .ngram_memory import largest_primes_below  # noqa: F401
from .product_key_memory_ops import OUTPUT_GATES  # noqa: F401


# Written into every saved ModernBertPkm config so that each saved folder loads through any Auto class as remote code.
MODERNBERT_AUTO_MAP = {
    "AutoConfig": "configuration_modernbert_pkm.ModernBertPkmConfig",
    "AutoModel": "modeling_modernbert_pkm.ModernBertPkmModel",
    "AutoModelForMaskedLM": "modeling_modernbert_pkm.ModernBertPkmForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_modernbert_pkm.ModernBertPkmForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_modernbert_pkm.ModernBertPkmForQuestionAnswering",
    "AutoModelForTokenClassification": "modeling_modernbert_pkm.ModernBertPkmForTokenClassification",
    "AutoModelForMultipleChoice": "modeling_modernbert_pkm.ModernBertPkmForMultipleChoice",
}
# the attention kinds and rotary embeddings the shipped ModernBertPkm blocks implement
MODERNBERT_LAYER_TYPES = ("full_attention", "sliding_attention")
MODERNBERT_ROPE_TYPES = ("default",)
MODERNBERT_POOLINGS = ("cls", "mean")


@strict
class ModernBertPkmConfig(ModernBertConfig):
    r"""
    Configuration of a ModernBERT whose layers at `pkm_layers` carry a product key memory (Lample et al. 2019), on the
    same normalised input as the MLP of the pre-norm block (`"resm"`: `x + MLP(LN(x)) + PKM(LN(x))`, Kim & Jung 2020's
    ResM in a pre-norm layer) or instead of the MLP (`"replace"`: `x + PKM(LN(x))`), and whose layers at
    `ngram_layers` carry a hashed n-gram memory (added to the layer's input before its attention). Every
    [`ModernBertConfig`] field is accepted (the local/global attention pattern `layer_types`, the two rotary `rope_theta`
    of `rope_parameters`, `local_attention`, ...); with `pkm_layers=[]` the model computes what ModernBERT computes.

    The `pkm_*` and `ngram_*` fields are [`BertPkmConfig`]'s, with the same meaning, defaults and checks (the model's
    memories bounded by `max_memory_parameters`). ModernBERT is an encoder: `is_decoder` must stay False.
    """

    model_type = "modernbert_pkm"
    _auto_class = "AutoConfig"  # save_pretrained copies the code files

    is_decoder: bool = False
    pkm_layers: list[int] | None = None
    pkm_mode: str = "resm"
    pkm_n_keys: int = 512
    pkm_heads: int = 4
    pkm_knn: int = 32
    pkm_k_dim: int = 256
    pkm_query_batchnorm: bool = True
    pkm_query_bias: bool = True
    pkm_value_init: str = "normal"
    pkm_input_dropout: float | int = 0.0
    pkm_query_dropout: float | int = 0.0
    pkm_value_dropout: float | int = 0.0
    pkm_weights_checksum: dict | None = None
    pkm_code_version: str | None = None
    pkm_shared_values: bool = False
    pkm_output_gate: str = "none"
    pkm_qk_norm: bool = False
    pkm_score_activation: str = "softmax"
    pkm_memory_scale: float | int | None = None
    pkm_values_quantization: str | None = None
    ngram_layers: list[int] | None = None
    ngram_orders: list[int] | None = None
    ngram_heads: int = 4
    ngram_table_size: int = 65536
    ngram_dim: int = 32
    ngram_conv_kernel: int = 3
    ngram_token_map: bool = False

    def __post_init__(self, **kwargs):
        # the loader's limit: a keyword, neither a field nor saved, so that no folder can raise it (from_dict)
        max_memory_parameters = kwargs.pop("max_memory_parameters", PKM_MAX_MEMORY_PARAMETERS)
        self._check_model_sizes()  # before ModernBertConfig makes one layer_types entry per layer
        every = kwargs.get("global_attn_every_n_layers", 3)  # ModernBertConfig's older form of layer_types
        if self.layer_types is None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"{type(self).__name__}.global_attn_every_n_layers={every!r}: must be an integer >= 1 (every n-th layer"
                " attends globally), or give layer_types"
            )
        if self.pkm_layers is None:
            n = self.num_hidden_layers
            self.pkm_layers = sorted({n // 3, 2 * n // 3})
        self.pkm_layers = [int(i) for i in self.pkm_layers]
        self.ngram_layers = [int(i) for i in (self.ngram_layers or [])]
        self.ngram_orders = [int(n) for n in (self.ngram_orders if self.ngram_orders is not None else [2, 3])]
        self.auto_map = {**MODERNBERT_AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        super().__post_init__(**kwargs)
        self._check_modernbert_fields()
        self._check_pkm_fields(max_memory_parameters)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """[`~PreTrainedConfig.from_dict`] with `max_memory_parameters`, a keyword of the loader (as
        [`BertPkmConfig.from_dict`]); a value in the folder's own config.json is ignored."""
        config_dict = {key: value for key, value in config_dict.items() if key != "max_memory_parameters"}
        if "max_memory_parameters" in kwargs:
            config_dict["max_memory_parameters"] = kwargs.pop("max_memory_parameters")
        return super().from_dict(config_dict, **kwargs)

    def _check_modernbert_fields(self):
        """What the shipped ModernBERT blocks implement, refused in one line where a config asks for more."""

        def fail(field, problem):
            raise ValueError(f"{type(self).__name__}.{field}={getattr(self, field)!r}: {problem}")

        if self.is_decoder:
            fail(
                "is_decoder",
                "ModernBertPkm is an encoder (bidirectional attention); use a decoder family for a causal LM",
            )
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if getattr(self, field) < 1:
                fail(field, "must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            fail("hidden_size", f"must be a multiple of num_attention_heads={self.num_attention_heads}")
        if (self.hidden_size // self.num_attention_heads) % 2:
            fail("num_attention_heads", "the head size hidden_size // num_attention_heads must be even (rotary halves)")
        if self.max_position_embeddings < 1:
            fail("max_position_embeddings", "must be >= 1")
        if self.local_attention < 2 or self.local_attention % 2:
            fail("local_attention", "the sliding window (both sides) must be an even number >= 2 (ModernBERT's: 128)")
        if len(self.layer_types) != self.num_hidden_layers or any(
            kind not in MODERNBERT_LAYER_TYPES for kind in self.layer_types
        ):
            fail("layer_types", f"needs one of {MODERNBERT_LAYER_TYPES} per layer ({self.num_hidden_layers} layers)")
        for kind in set(self.layer_types):
            rope = (self.rope_parameters or {}).get(kind) or {}
            if rope.get("rope_type", "default") not in MODERNBERT_ROPE_TYPES:
                fail("rope_parameters", f"{kind}: only rope_type {MODERNBERT_ROPE_TYPES} (ModernBERT's) is implemented")
        if self.classifier_pooling not in MODERNBERT_POOLINGS:
            fail("classifier_pooling", f"must be one of {MODERNBERT_POOLINGS}")
        for field in ("attention_dropout", "embedding_dropout", "mlp_dropout", "classifier_dropout"):
            if not 0 <= getattr(self, field) < 1:
                fail(field, "a dropout probability must be in [0, 1)")

    # BertPkmConfig's checks and sizes of the memories, shared (they read only the memory fields and the sizes that
    # both configs have: num_hidden_layers, hidden_size, vocab_size, max_position_embeddings, is_decoder)
    _check_model_sizes = BertPkmConfig._check_model_sizes
    _check_pkm_fields = BertPkmConfig._check_pkm_fields
    _check_ngram_fields = BertPkmConfig._check_ngram_fields
    _product_key_parts = BertPkmConfig._product_key_parts
    _ngram_parts = BertPkmConfig._ngram_parts
    _model_memory_parts = BertPkmConfig._model_memory_parts
    _check_one_memory = BertPkmConfig._check_one_memory
    _check_memory_parameters = BertPkmConfig._check_memory_parameters
    _refuse_memory_parameters = BertPkmConfig._refuse_memory_parameters
    _check_memory_plus_fields = BertPkmConfig._check_memory_plus_fields
    ngram_tables = BertPkmConfig.ngram_tables
    num_memory_parameters = BertPkmConfig.num_memory_parameters
    pkm_mem_size = BertPkmConfig.pkm_mem_size


__all__ = ["ModernBertPkmConfig"]
