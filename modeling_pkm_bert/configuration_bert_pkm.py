"""BertPkm model configuration: BERT plus product key memory (PKM) layers."""

import math

import transformers
from huggingface_hub.dataclasses import strict
from transformers import BertConfig

from .ngram_memory import largest_primes_below
from .product_key_memory_ops import OUTPUT_GATES, SCORE_ACTIVATIONS


# The version of these code files, recorded in every saved config (`pkm_code_version`), and the transformers releases
# they run on (`make test-compat` tests both ends); a folder's code names both when the installed release is outside.
PKM_CODE_VERSION = "0.6.0"
# the files that travel with every saved model (the remote code): they import each other relatively and nothing else
# of the package
REMOTE_CODE_FILES = (
    "configuration_bert_pkm.py",
    "modeling_bert_pkm.py",
    "modeling_pkm_utils.py",
    "product_key_memory.py",
    "product_key_memory_ops.py",
    "ngram_memory.py",
    "configuration_roberta_pkm.py",
    "modeling_roberta_pkm.py",
    "configuration_modernbert_pkm.py",
    "modeling_modernbert_pkm.py",
)
SUPPORTED_TRANSFORMERS = ((5, 4), (6, 0))  # >= 5.4 (dataclass configs, v5 loading), < 6


def check_transformers_version(version: str = transformers.__version__) -> None:
    installed = tuple(int(part) for part in version.split(".")[:2])
    (low, high) = SUPPORTED_TRANSFORMERS
    if not low <= installed < high:
        raise ImportError(
            f"this BertPkm code (modeling_pkm_bert {PKM_CODE_VERSION}) runs on transformers >={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1]}; transformers {version} is installed. Install a supported transformers, or refresh"
            " the folder's code files from a modeling-pkm-bert release that supports it"
            " (python run_scripts/push_to_hub.py --refresh_code FOLDER)"
        )


check_transformers_version()


PKM_MODES = ("resm", "replace")
PKM_VALUE_INITS = ("normal", "zeros")
# The one limit on a model's memories: the parameters of all its product-key and n-gram memories together (value and
# hash tables, projections, keys, convolutions), checked when the config is built, so that a folder asking for more
# is refused at once rather than by the allocator (or the swap) when the model is built. 2**33 (8.6e9 parameters, 32 GiB
# in fp32): BERT-base with the paper's two memories holds 4.1e8. A machine that has the memory raises it with the
# keyword `max_memory_parameters` (of the config or of `from_pretrained`): the loader's choice, never a folder's.
PKM_MAX_MEMORY_PARAMETERS = 2**33
# the most hash tables an n-gram memory may have (orders x directions x heads; Engram's have 16 to 32): their prime
# sizes are searched for when the config is built
NGRAM_MAX_TABLES = 1024
# the hash's products stay below 2**62 (ids and multipliers below 2**31): rows beyond it are never read
NGRAM_MAX_TABLE_SIZE = 2**62
# The model's own sizes are bounded as its memories are (a folder's config is untrusted), before anything grows with
# them (ModernBERT's `layer_types` has one entry per layer): (lowest, highest), the highest generous for any real
# checkpoint (vocabularies of ~2.6e5 tokens, layers ~3e4 wide, ~1e2 deep, contexts of ~1e7 positions).
MODEL_SIZE_LIMITS = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**19),
    "num_hidden_layers": (1, 2**12),
    "num_attention_heads": (1, 2**12),
    "max_position_embeddings": (1, 2**24),
    "type_vocab_size": (0, 2**16),
    "local_attention": (0, 2**24),
}
# defined once, beside the layer that reads them
PKM_OUTPUT_GATES = OUTPUT_GATES
PKM_SCORE_ACTIVATIONS = SCORE_ACTIVATIONS
PKM_VALUES_QUANTIZATIONS = (None, "int8", "4bit")  # None and the keys of VALUE_QUANTIZATIONS (a literal: arguments.py reads it)

# Written into every saved config so that each saved folder loads through any Auto class as remote code.
AUTO_MAP = {
    "AutoConfig": "configuration_bert_pkm.BertPkmConfig",
    "AutoModel": "modeling_bert_pkm.BertPkmModel",
    "AutoModelForMaskedLM": "modeling_bert_pkm.BertPkmForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_bert_pkm.BertPkmForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_bert_pkm.BertPkmForQuestionAnswering",
    "AutoModelForTokenClassification": "modeling_bert_pkm.BertPkmForTokenClassification",
    "AutoModelForMultipleChoice": "modeling_bert_pkm.BertPkmForMultipleChoice",
    "AutoModelForCausalLM": "modeling_bert_pkm.BertPkmForCausalLM",
}


@strict
class BertPkmConfig(BertConfig):
    r"""
    Configuration of a BERT whose layers at `pkm_layers` carry a product key memory (Lample et al. 2019), placed
    beside the feed-forward network (`"resm"`: LN(x + FFN(x) + PKM(x)), Kim & Jung 2020) or instead of it
    (`"replace"`: LN(x + PKM(x))). Every [`BertConfig`] field is accepted; with `pkm_layers=[]` the model is BERT.

    pkm_layers (`list[int]`, *optional*):
        0-based indices of the layers that get a memory. Defaults to two layers at regular intervals,
        `[n // 3, 2 * n // 3]` for `n = num_hidden_layers`: the paper's `[4, 8]` for 12 layers, `[2, 4]` for 6.
    pkm_mode (`str`, *optional*, defaults to `"resm"`):
        `"resm"` adds the memory beside the FFN, `"replace"` replaces the FFN by the memory.
    pkm_n_keys (`int`, *optional*, defaults to 512):
        Sub-keys per half; the memory has `pkm_n_keys ** 2` slots.
    pkm_heads (`int`, *optional*, defaults to 4):
        Memory heads; each has its own sub-keys, all share the values and their outputs are summed.
    pkm_knn (`int`, *optional*, defaults to 32):
        Slots read per head and token.
    pkm_k_dim (`int`, *optional*, defaults to 256):
        Query/key dimension per head (even: it is split into two halves).
    pkm_query_batchnorm (`bool`, *optional*, defaults to `True`):
        BatchNorm on the queries, with statistics over non-padding tokens.
    pkm_query_bias (`bool`, *optional*, defaults to `True`):
        Bias in the query projection.
    pkm_value_init (`str`, *optional*, defaults to `"normal"`):
        `"normal"`: N(0, hidden_size ** -0.5) as XLM; `"zeros"`: a ResM model then starts as the plain BERT.
    pkm_input_dropout, pkm_query_dropout, pkm_value_dropout (`float`, *optional*, defaults to 0.0):
        Dropout on the memory input, on the queries and on the memory output.
    pkm_code_version (`str`, *optional*):
        The version of the code files saved with the model (written by `save_pretrained`; None: saved before 0.2.0).
    pkm_weights_checksum (`dict`, *optional*):
        Written by `save_pretrained(..., checksum=True)`: the SHA-256 of the saved tensors, verified by
        `from_pretrained` (safetensors checks the file's layout, not the bytes inside the tensors). Not set by hand.
    pkm_shared_values (`bool`, *optional*, defaults to `False`):
        One value table for every memory layer (Memory+): `memory.values` is the same module in each, saved once; each
        layer keeps its own keys, query network and output.
    pkm_output_gate (`str`, *optional*, defaults to `"none"`):
        `"swilu"`: the memory returns `W_out((sum_i s_i v_i) * silu(W_gate x))` (Memory+). With `pkm_mode="replace"`
        it needs `pkm_value_init="normal"` (a replaced FFN cannot be kept, so no start is function-preserving there).
    pkm_qk_norm (`bool`, *optional*, defaults to `False`):
        LayerNorm on each query half and on the sub-keys before scoring (UltraMem, ByteDance's Memory+ port).
    pkm_score_activation (`str`, *optional*, defaults to `"softmax"`):
        `"relu"`: non-competitive weights `relu(score)` over the selected slots instead of their softmax.
    pkm_memory_scale (`float`, *optional*):
        A learned scalar on the memory output, initialised to this value (e.g. 0.01 beside a pretrained FFN); None: none.
    pkm_values_quantization (`str`, *optional*):
        How the memory tables (product-key values and n-gram tables alike) are stored: None (default): floating point,
        trainable; `"int8"`: row-wise int8 (an fp32 scale and bias per row), `"4bit"`: row-wise 4-bit (fp16 scale and
        bias), FBGEMM's packed rows, inference only.
        Written by `modeling_pkm_bert.quantize_memory_values` (`--quantize_values 8|4`); not set by hand.
    ngram_layers (`list[int]`, *optional*, defaults to `[]`):
        0-based indices of the layers that get a hashed n-gram memory (Engram-style, `NgramMemory`), added to the
        layer's input before its attention; independent of `pkm_layers` (a layer may have both). Needs `input_ids`.
    ngram_orders (`list[int]`, *optional*, defaults to `[2, 3]`):
        The n-gram orders. An encoder hashes, per order, the n-gram ending at and the one starting at each position; a
        decoder (`is_decoder=True`) the one ending at it.
    ngram_heads (`int`, *optional*, defaults to 4):
        Hash heads per n-gram kind, each with its own multipliers and table.
    ngram_table_size (`int`, *optional*, defaults to 65536):
        Rows per hash table: the tables take the distinct largest primes <= this number.
    ngram_dim (`int`, *optional*, defaults to 32):
        Features per table row; the memory's width is `kinds * ngram_heads * ngram_dim`.
    ngram_conv_kernel (`int`, *optional*, defaults to 3):
        Taps of the depthwise convolution over the looked-up rows (centred in an encoder, causal in a decoder).
    ngram_token_map (`bool`, *optional*, defaults to `False`):
        Hash canonical ids: a saved `token_map` buffer maps each id to its lowercase, accent-folded form's first id
        (filled by `convert_to_pkm.py --ngram_token_map`).
    """

    model_type = "bert_pkm"
    _auto_class = "AutoConfig"  # save_pretrained copies the code files

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
        self._check_model_sizes()
        if self.pkm_layers is None:
            n = self.num_hidden_layers
            self.pkm_layers = sorted({n // 3, 2 * n // 3})
        self.pkm_layers = [int(i) for i in self.pkm_layers]
        self.ngram_layers = [int(i) for i in (self.ngram_layers or [])]
        self.ngram_orders = [int(n) for n in (self.ngram_orders if self.ngram_orders is not None else [2, 3])]
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        super().__post_init__(**kwargs)
        self._check_pkm_fields(max_memory_parameters)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """[`~PreTrainedConfig.from_dict`] (which `from_pretrained` calls) with `max_memory_parameters`, a keyword of the
        loader, known while the folder's sizes are checked (transformers sets other keywords after); a value in the
        folder's own config.json is ignored."""
        config_dict = {key: value for key, value in config_dict.items() if key != "max_memory_parameters"}
        if "max_memory_parameters" in kwargs:
            config_dict["max_memory_parameters"] = kwargs.pop("max_memory_parameters")
        return super().from_dict(config_dict, **kwargs)

    def _check_model_sizes(self):
        """Every size field of `MODEL_SIZE_LIMITS` the config has, in its range: checked first, before any work."""
        for field, (lowest, highest) in MODEL_SIZE_LIMITS.items():
            value = getattr(self, field, None)
            if value is not None and not lowest <= value <= highest:
                raise ValueError(
                    f"{type(self).__name__}.{field}={value!r}: must be in [{lowest}, {highest:,}] (the limit of any "
                    "real checkpoint; a config asking for more is refused before anything is built)"
                )

    def _check_pkm_fields(self, max_memory_parameters: int):
        def fail(field, problem):
            raise ValueError(f"{type(self).__name__}.{field}={getattr(self, field)!r}: {problem}")

        limit = max_memory_parameters
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(
                f"{type(self).__name__}: max_memory_parameters={limit!r} must be a positive integer (the most parameters"
                f" the model's memories may hold; default {PKM_MAX_MEMORY_PARAMETERS:,})"
            )

        n = self.num_hidden_layers
        if any(i < 0 or i >= n for i in self.pkm_layers):
            fail("pkm_layers", f"every index must be in [0, {n - 1}] (num_hidden_layers={n}; indices are 0-based)")
        if len(set(self.pkm_layers)) != len(self.pkm_layers):
            fail("pkm_layers", "an index is repeated")
        if self.pkm_mode not in PKM_MODES:
            fail("pkm_mode", f"must be one of {PKM_MODES}")
        if self.pkm_value_init not in PKM_VALUE_INITS:
            fail("pkm_value_init", f"must be one of {PKM_VALUE_INITS}")
        if self.pkm_n_keys < 1:
            fail("pkm_n_keys", "must be >= 1")
        if self.pkm_heads < 1:
            fail("pkm_heads", "must be >= 1")
        if not 1 <= self.pkm_knn <= self.pkm_n_keys:
            fail("pkm_knn", f"must be in [1, pkm_n_keys={self.pkm_n_keys}]")
        if self.pkm_k_dim < 2 or self.pkm_k_dim % 2:
            fail("pkm_k_dim", "must be even and >= 2 (the query is split into two halves)")
        for field in ("pkm_input_dropout", "pkm_query_dropout", "pkm_value_dropout"):
            if not 0 <= getattr(self, field) < 1:
                fail(field, "a dropout probability must be in [0, 1)")
        if self.pkm_weights_checksum is not None and not isinstance(self.pkm_weights_checksum.get("model"), str):
            fail("pkm_weights_checksum", "is written by save_pretrained(..., checksum=True): a dict of digests")
        self._check_memory_plus_fields(fail)
        self._check_one_memory(fail, limit, "product-key", self._product_key_parts())
        self._check_ngram_fields(fail, limit)
        self._check_memory_parameters(fail, limit)

    def _check_ngram_fields(self, fail, limit):
        # every size bounded before the one search that grows with them, that of the tables' prime sizes
        n, longest = self.num_hidden_layers, self.max_position_embeddings
        if any(i < 0 or i >= n for i in self.ngram_layers):
            fail("ngram_layers", f"every index must be in [0, {n - 1}] (num_hidden_layers={n}; indices are 0-based)")
        if len(set(self.ngram_layers)) != len(self.ngram_layers):
            fail("ngram_layers", "an index is repeated")
        if not self.ngram_orders or any(order < 1 for order in self.ngram_orders):
            fail("ngram_orders", "needs at least one order, each >= 1 (2: bigrams)")
        if any(order > longest for order in self.ngram_orders):
            fail("ngram_orders", f"an n-gram longer than max_position_embeddings={longest} tokens holds only padding")
        if len(set(self.ngram_orders)) != len(self.ngram_orders):
            fail("ngram_orders", "an order is repeated")
        for field in ("ngram_heads", "ngram_dim", "ngram_conv_kernel", "ngram_table_size"):
            if getattr(self, field) < 1:
                fail(field, "must be >= 1")
        if self.ngram_conv_kernel > longest:
            fail("ngram_conv_kernel", f"a window wider than max_position_embeddings={longest} tokens reads only padding")
        if self.ngram_layers and self.vocab_size >= 2**31:
            fail("ngram_layers", f"the n-gram hash needs ids below 2**31 (vocab_size={self.vocab_size})")
        tables, kinds = self.ngram_tables, self.ngram_tables // self.ngram_heads
        if tables > NGRAM_MAX_TABLES:
            fail(
                "ngram_heads" if self.ngram_heads >= kinds else "ngram_orders",
                f"{len(self.ngram_orders)} order(s) x {kinds // len(self.ngram_orders)} direction(s) x ngram_heads="
                f"{self.ngram_heads:,} = {tables:,} hash tables, over the {NGRAM_MAX_TABLES:,} an n-gram memory may have",
            )
        if self.ngram_table_size > NGRAM_MAX_TABLE_SIZE:
            fail("ngram_table_size", f"the hash reaches rows below 2**62 only: at most {NGRAM_MAX_TABLE_SIZE:,}")
        # before the search: the largest table alone holds more than ngram_table_size / 2 rows (Bertrand's postulate)
        self._check_one_memory(fail, limit, "n-gram", self._ngram_parts(rows=self.ngram_table_size // 2 + 1), "at least ")
        try:
            if tables > self.ngram_table_size:
                raise ValueError
            largest_primes_below(self.ngram_table_size, tables)
        except ValueError:
            fail("ngram_table_size", f"there must be {tables} distinct primes <= it (one per hash table)")

    @property
    def ngram_tables(self) -> int:
        """Hash tables of each n-gram memory: orders x directions (2 in an encoder, 1 in a decoder) x heads."""
        return len(self.ngram_orders) * (1 if self.is_decoder else 2) * self.ngram_heads

    @property
    def num_memory_parameters(self) -> int:
        """The parameters of all the model's memories (product-key and n-gram; a shared value table once): what
        `max_memory_parameters` bounds. Quantized tables count as their unpacked values."""
        return sum(count for _, count, _ in self._model_memory_parts())

    def _product_key_parts(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """One product-key memory's parameters by part: (what, how many, the fields that size it)."""
        hidden, features = self.hidden_size, self.pkm_heads * self.pkm_k_dim
        query = hidden * features + features * self.pkm_query_bias + 2 * features * self.pkm_query_batchnorm
        query += 2 * self.pkm_k_dim * self.pkm_qk_norm + (self.pkm_memory_scale is not None)
        if self.pkm_output_gate == "swilu":
            query += 2 * hidden * hidden + hidden
        return [
            ("the value table", self.pkm_n_keys**2 * hidden, ("pkm_n_keys", "hidden_size")),
            ("the query network", query, ("pkm_heads", "pkm_k_dim", "hidden_size")),
            ("the sub-keys", self.pkm_n_keys * features, ("pkm_n_keys", "pkm_heads", "pkm_k_dim")),
        ]

    def _ngram_parts(self, rows: int | None = None) -> list[tuple[str, int, tuple[str, ...]]]:
        """One n-gram memory's parameters by part; `rows`: of its tables (default: the sum of their prime sizes)."""
        if rows is None:
            rows = sum(largest_primes_below(self.ngram_table_size, self.ngram_tables))
        hidden, width = self.hidden_size, self.ngram_tables * self.ngram_dim
        return [
            ("the n-gram tables", rows * self.ngram_dim, ("ngram_table_size", "ngram_dim", "ngram_heads")),
            ("the key and value projections", 2 * width * hidden + 4 * hidden, ("ngram_dim", "ngram_heads", "hidden_size")),
            ("the convolution", width * (self.ngram_conv_kernel + 2), ("ngram_conv_kernel", "ngram_dim", "ngram_heads")),
        ]

    def _model_memory_parts(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """The memory parameters of the whole model by part, summed over the layers (a shared value table once)."""
        parts = []
        for kind, layers, memory_parts in (
            ("product-key", len(self.pkm_layers), self._product_key_parts),
            ("n-gram", len(self.ngram_layers), self._ngram_parts),
        ):
            for what, count, fields in memory_parts() if layers else []:
                copies = 1 if what == "the value table" and self.pkm_shared_values else layers
                parts.append((f"{what} of {copies} {kind} memory layer(s)", count * copies, fields))
        return parts

    def _check_one_memory(self, fail, limit, kind, parts, at_least=""):
        # one memory of each kind is checked even where no layer has one (then against the default limit at least, so
        # that a lowered limit concerns the memories in use): no model could be built with such a field
        if not (self.pkm_layers if kind == "product-key" else self.ngram_layers):
            limit = max(limit, PKM_MAX_MEMORY_PARAMETERS)
        total = sum(count for _, count, _ in parts)
        if total > limit:
            self._refuse_memory_parameters(fail, limit, f"one {kind} memory would hold {at_least}", total, parts)

    def _check_memory_parameters(self, fail, limit):
        self._check_one_memory(fail, limit, "n-gram", self._ngram_parts())
        parts = self._model_memory_parts()
        total = sum(count for _, count, _ in parts)
        if total > limit:
            self._refuse_memory_parameters(fail, limit, "the model's memories would hold ", total, parts)

    def _refuse_memory_parameters(self, fail, limit, subject, total, parts):
        """Refused, naming the field that sizes the largest part: the one furthest above its default, or the part's
        first where none is above it."""
        what, count, fields = max(parts, key=lambda part: part[1])
        above = {name: getattr(self, name) / max(getattr(type(self), name, 1), 1) for name in fields}
        field = max(above, key=above.get) if max(above.values()) > 1 else fields[0]
        sizes = ", ".join(f"{name}={getattr(self, name):,}" for name in fields)
        fail(
            field,
            f"{subject}{total:,} parameters, {_fp32_size(total)}, the most in {what} ({count:,}; {sizes}): over"
            f" max_memory_parameters={limit:,} ({_fp32_size(limit)}). On a machine that has the memory, raise the limit"
            " with the keyword max_memory_parameters=N (of the config, or of from_pretrained; a folder cannot raise it)",
        )

    def _check_memory_plus_fields(self, fail):
        if self.pkm_output_gate not in PKM_OUTPUT_GATES:
            fail("pkm_output_gate", f"must be one of {PKM_OUTPUT_GATES}")
        if self.pkm_score_activation not in PKM_SCORE_ACTIVATIONS:
            fail("pkm_score_activation", f"must be one of {PKM_SCORE_ACTIVATIONS}")
        if self.pkm_values_quantization not in PKM_VALUES_QUANTIZATIONS:
            fail("pkm_values_quantization", f"must be one of {PKM_VALUES_QUANTIZATIONS} (written by quantize_memory_values)")
        scale = self.pkm_memory_scale
        if scale is not None and (isinstance(scale, bool) or not math.isfinite(scale) or scale == 0):
            fail("pkm_memory_scale", "must be a finite nonzero number (e.g. 0.01 for a near-zero start) or None")
        if self.pkm_output_gate == "swilu" and self.pkm_mode == "replace" and self.pkm_value_init == "zeros":
            fail(
                "pkm_output_gate",
                "'swilu' with pkm_mode='replace' and pkm_value_init='zeros' cannot be function-preserving: the replaced "
                "FFN is gone, and zero values would only start the layer as LN(x) with a gated path that learns from "
                "the values alone; use pkm_mode='resm' for a function-preserving start, or pkm_value_init='normal'",
            )

    @property
    def pkm_mem_size(self) -> int:
        """Number of memory slots (value rows) of each memory layer."""
        return self.pkm_n_keys**2


def _fp32_size(parameters: int) -> str:
    size = parameters * 4
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size:,} bytes ({size / scale:.1f} {unit}) in fp32"
    return f"{size:,} bytes in fp32"


__all__ = ["BertPkmConfig"]
