"""RobertaPkm model configuration: RoBERTa / XLM-RoBERTa plus product key memory (PKM) layers."""

from huggingface_hub.dataclasses import strict

from .configuration_bert_pkm import BertPkmConfig

# transformers before 5.24 copies only the direct relative imports of a loaded file: the files configuration_bert_pkm
# needs are imported here too
from .ngram_memory import largest_primes_below  # noqa: F401
from .product_key_memory_ops import OUTPUT_GATES  # noqa: F401


# Written into every saved RobertaPkm config so that each saved folder loads through any Auto class as remote code.
ROBERTA_AUTO_MAP = {
    "AutoConfig": "configuration_roberta_pkm.RobertaPkmConfig",
    "AutoModel": "modeling_roberta_pkm.RobertaPkmModel",
    "AutoModelForMaskedLM": "modeling_roberta_pkm.RobertaPkmForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_roberta_pkm.RobertaPkmForSequenceClassification",
    "AutoModelForQuestionAnswering": "modeling_roberta_pkm.RobertaPkmForQuestionAnswering",
    "AutoModelForTokenClassification": "modeling_roberta_pkm.RobertaPkmForTokenClassification",
    "AutoModelForMultipleChoice": "modeling_roberta_pkm.RobertaPkmForMultipleChoice",
    "AutoModelForCausalLM": "modeling_roberta_pkm.RobertaPkmForCausalLM",
}


@strict
class RobertaPkmConfig(BertPkmConfig):
    r"""
    Configuration of a RoBERTa (or XLM-RoBERTa, DistilRoBERTa: the same architecture) whose layers at `pkm_layers`
    carry a product key memory. Every [`BertPkmConfig`] field is accepted, with the same meaning and checks; the
    defaults are RoBERTa's checkpoints': one token type, positions counted from `pad_token_id + 1` (hence
    `max_position_embeddings=514` for 512 tokens), LayerNorm eps 1e-5, `<s>`=0, `<pad>`=1, `</s>`=2.
    """

    model_type = "roberta_pkm"

    vocab_size: int = 50265
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs):
        # the RobertaPkm classes in place of BertPkm's (a saved folder's own entries are kept)
        self.auto_map = {**ROBERTA_AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        super().__post_init__(**kwargs)
        if self.pad_token_id is None or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"RobertaPkmConfig.pad_token_id={self.pad_token_id!r}: RoBERTa counts positions from the padding id, so"
                f" it must be a token id in [0, {self.vocab_size - 1}]"
            )
        if self.max_position_embeddings <= self.pad_token_id + 1:
            raise ValueError(
                f"RobertaPkmConfig.max_position_embeddings={self.max_position_embeddings}: positions start at"
                f" pad_token_id + 1 = {self.pad_token_id + 1}, so it must be larger (514 holds 512 tokens)"
            )


__all__ = ["RobertaPkmConfig"]
