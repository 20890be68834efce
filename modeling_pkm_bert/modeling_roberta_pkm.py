"""PyTorch RoBERTa / XLM-RoBERTa with product key memory layers (Kim & Jung 2020's +Init and ResM on RoBERTa).

Remote code, as modeling_bert_pkm.py: it imports only torch, transformers' stable public API and its sibling files.
RoBERTa is BERT with three differences, which are all this file holds: embeddings whose positions are counted from
`padding_idx + 1` and derived from the input ids, a single token type, and RoBERTa's heads (`lm_head`, a
classification head on the first token instead of a pooler). The layers are BertPkm's, imported; the memories, the
attention masks and the checked loading and saving are the shared module's (`modeling_pkm_utils.py`). Weight names
follow transformers' RoBERTa (`roberta.embeddings...`, `lm_head.dense/layer_norm/decoder`, `classifier.dense/out_proj`),
so that a RoBERTa checkpoint's heads load as they are.
"""

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import Cache, GenerationMixin
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import logging

# transformers before 5.24 copies only the direct relative imports of a loaded file: every file modeling_bert_pkm,
# modeling_pkm_utils and the configurations need is imported here too
from .configuration_bert_pkm import PKM_CODE_VERSION  # noqa: F401
from .configuration_roberta_pkm import RobertaPkmConfig
from .modeling_bert_pkm import BertPkmModel, BertPkmPreTrainedModel
from .modeling_pkm_utils import (
    CACHE_FIELD,
    add_ngram_history,
    merge_cache_arguments,
    number_of_choices,
    sequence_classification_loss,
)
from .ngram_memory import NgramMemory  # noqa: F401
from .product_key_memory import ProductKeyMemory  # noqa: F401
from .product_key_memory_ops import is_exporting  # noqa: F401


logger = logging.get_logger(__name__)


# Copied from transformers.models.roberta.modeling_roberta.RobertaEmbeddings with Roberta->RobertaPkm
# Differs: `self.token_type_ids.to(position_ids.device).expand(` -> `self.token_type_ids.expand(`
class RobertaPkmEmbeddings(nn.Module):
    """Construct the embeddings from word, position and token_type embeddings."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)

        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        # position_ids (1, len position emb) is contiguous in memory and exported when serialized
        self.position_ids = nn.Buffer(torch.arange(config.max_position_embeddings).expand((1, -1)), persistent=False)
        self.token_type_ids = nn.Buffer(torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

        self.padding_idx = config.pad_token_id
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size, padding_idx=self.padding_idx
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache_length: int = 0,
    ) -> torch.Tensor:
        if position_ids is None:
            if input_ids is not None:
                # Create the position ids from the input token ids. Any padded tokens remain padded.
                position_ids = self.create_position_ids_from_input_ids(input_ids, self.padding_idx, cache_length)
            else:
                position_ids = self.create_position_ids_from_inputs_embeds(inputs_embeds, self.padding_idx)

        if input_ids is not None:
            input_shape = input_ids.size()
        else:
            input_shape = inputs_embeds.size()[:-1]

        batch_size, seq_length = input_shape

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

    @staticmethod
    def create_position_ids_from_inputs_embeds(inputs_embeds, padding_idx):
        """
        We are provided embeddings directly. We cannot infer which are padded so just generate sequential position ids.

        Args:
            inputs_embeds: torch.Tensor

        Returns: torch.Tensor
        """
        input_shape = inputs_embeds.size()[:-1]
        sequence_length = input_shape[1]

        position_ids = torch.arange(
            padding_idx + 1, sequence_length + padding_idx + 1, dtype=torch.long, device=inputs_embeds.device
        )
        return position_ids.unsqueeze(0).expand(input_shape)

    @staticmethod
    def create_position_ids_from_input_ids(input_ids, padding_idx, cache_length=0):
        """
        Replace non-padding symbols with their position numbers. Position numbers begin at padding_idx+1. Padding symbols
        are ignored. This is modified from fairseq's `utils.make_positions`.

        Args:
            x: torch.Tensor x:

        Returns: torch.Tensor
        """
        # The series of casts and type-conversions here are carefully balanced to both work with ONNX export and XLA.
        mask = input_ids.ne(padding_idx).int()
        incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + cache_length) * mask
        return incremental_indices.long() + padding_idx


# Copied from transformers.models.roberta.modeling_roberta.RobertaLMHead with Roberta->RobertaPkm
# Differs: `x = gelu(x)` -> `x = ACT2FN["gelu"](x)`
class RobertaPkmLMHead(nn.Module):
    """RobertaPkm Head for masked language modeling."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, features, **kwargs):
        x = self.dense(features)
        x = ACT2FN["gelu"](x)
        x = self.layer_norm(x)

        # project back to size of vocabulary with bias
        x = self.decoder(x)

        return x


# Copied from transformers.models.roberta.modeling_roberta.RobertaClassificationHead with Roberta->RobertaPkm
class RobertaPkmClassificationHead(nn.Module):
    """Head for sentence-level classification tasks."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features, **kwargs):
        x = features[:, 0, :]  # take <s> token (equiv. to [CLS])
        x = self.dropout(x)
        x = self.dense(x)
        x = torch.tanh(x)
        x = self.dropout(x)
        x = self.out_proj(x)
        return x


class RobertaPkmPreTrainedModel(BertPkmPreTrainedModel):
    """BertPkm's weight initialisation, checked loading and saving, under RoBERTa's prefix and with its modules."""

    config: RobertaPkmConfig
    base_model_prefix = "roberta"

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RobertaPkmLMHead):
            init.zeros_(module.bias)
        elif isinstance(module, RobertaPkmEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
            init.zeros_(module.token_type_ids)


class RobertaPkmModel(BertPkmModel, RobertaPkmPreTrainedModel):
    r"""
    The bare RobertaPkm model: RoBERTa with product key memory layers at `config.pkm_layers` (BertPkmModel's encoder,
    RoBERTa's embeddings), outputting raw hidden states; a decoder with `config.is_decoder=True`.

    add_pooling_layer (`bool`, *optional*, defaults to `True`):
        Whether to add the pooler (a dense layer and tanh on the first token; RoBERTa's heads do not use it).
    """

    config: RobertaPkmConfig
    _no_split_modules = ["RobertaPkmEmbeddings", "BertPkmLayer"]
    embeddings_class = RobertaPkmEmbeddings

    @property
    def first_position(self) -> int:
        return self.config.pad_token_id + 1  # RoBERTa counts positions from padding_idx + 1


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForMaskedLM with bert->roberta, BertPkm->RobertaPkm, cls\.predictions\.decoder->lm_head.decoder, cls\.predictions\.bias->lm_head.bias, self\.cls->self.lm_head, OnlyMLMHead->LMHead
# Differs: `self.lm_head.bias = new_embeddings.bias` -> ``
class RobertaPkmForMaskedLM(RobertaPkmPreTrainedModel):
    """RobertaPkm with a masked language modeling head on top, tied to the word embeddings."""

    _auto_class = "AutoModelForMaskedLM"
    _tied_weights_keys = {
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)
        if config.is_decoder:
            logger.warning(
                "If you want to use `RobertaPkmForMaskedLM` make sure `config.is_decoder=False` for "
                "bi-directional self-attention."
            )
        self.roberta = RobertaPkmModel(config, add_pooling_layer=False)
        self.lm_head = RobertaPkmLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

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
            Token ids to predict at the masked positions; `-100` elsewhere (ignored). Other arguments: `RobertaPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.roberta(
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
        prediction_scores = self.lm_head(outputs[0])

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


def roberta_generation_positions(input_ids, attention_mask, new_tokens: int, padding_idx: int) -> torch.Tensor:
    """The positions of a generation step's `new_tokens` last tokens as a plain forward over all the tokens so far,
    `input_ids`, gives them: counted from `padding_idx + 1` over the real tokens, `padding_idx` at padding (`<pad>` ids
    and the tokens a 2-D `attention_mask` masks), so that a left-padded prompt generates as it would alone.
    transformers' generate passes positions counted from 0, 2 below RoBERTa's: they are replaced, as are any given to
    generate."""
    real = input_ids.ne(padding_idx)
    if attention_mask is not None and attention_mask.shape == input_ids.shape:
        real &= attention_mask != 0
    positions = (real.cumsum(1) + padding_idx).masked_fill(~real, padding_idx)
    return positions[:, -new_tokens:]


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForCausalLM with bert->roberta, BertPkm->RobertaPkm, cls\.predictions\.decoder->lm_head.decoder, cls\.predictions\.bias->lm_head.bias, self\.cls->self.lm_head, OnlyMLMHead->LMHead
# Differs: `a language modeling head for causal LM (Lample et al.'s memory setting)` -> `RoBERTa's language modeling head for causal LM`
# Differs: `self.lm_head.bias = new_embeddings.bias` -> ``
# Differs: `; with n-gram memories also `ngram_history_ids`, the tokens\n        before the step's new ones (padding as -1), which the memories hash beside them.` -> `, with RoBERTa's positions (`roberta_generation_positions`) and,\n        with n-gram memories, `ngram_history_ids`.`
# Differs: `model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)` -> `model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)\n        new_tokens = model_inputs["input_ids"].shape[1]\n        model_inputs["position_ids"] = roberta_generation_positions(\n            input_ids, kwargs.get("attention_mask"), new_tokens, self.config.pad_token_id\n        )`
class RobertaPkmForCausalLM(RobertaPkmPreTrainedModel, GenerationMixin):
    """RobertaPkm with RoBERTa's language modeling head for causal LM; `generate` works."""

    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {
        "lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
        "lm_head.decoder.bias": "lm_head.bias",
    }

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)
        if not config.is_decoder:
            logger.warning("If you want to use `RobertaPkmForCausalLM` as a standalone, add `is_decoder=True.`")
        self.roberta = RobertaPkmModel(config, add_pooling_layer=False)
        self.lm_head = RobertaPkmLMHead(config)

        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' inputs for a generation step, with RoBERTa's positions (`roberta_generation_positions`) and,
        with n-gram memories, `ngram_history_ids`."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        new_tokens = model_inputs["input_ids"].shape[1]
        model_inputs["position_ids"] = roberta_generation_positions(
            input_ids, kwargs.get("attention_mask"), new_tokens, self.config.pad_token_id
        )
        return add_ngram_history(model_inputs, input_ids, self.roberta.ngram_context_length, kwargs)

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
        Other arguments: `RobertaPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        if labels is not None:
            use_cache = False

        outputs = self.roberta(
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
        logits = self.lm_head(hidden_states[:, slice_indices, :])

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


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForSequenceClassification with bert->roberta, BertPkm->RobertaPkm
# Differs: `a sequence classification/regression head on the pooled output` -> `RoBERTa's classification/regression head (dense, tanh, out_proj on `<s>`)`
# Differs: `self.roberta = RobertaPkmModel(config)\n        classifier_dropout = (\n            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob\n        )\n        self.dropout = nn.Dropout(classifier_dropout)\n        self.classifier = nn.Linear(config.hidden_size, config.num_labels)` -> `self.roberta = RobertaPkmModel(config, add_pooling_layer=False)\n        self.classifier = RobertaPkmClassificationHead(config)`
# Differs: `self.classifier(self.dropout(outputs[1]))` -> `self.classifier(outputs[0])`
class RobertaPkmForSequenceClassification(RobertaPkmPreTrainedModel):
    """RobertaPkm with RoBERTa's classification/regression head (dense, tanh, out_proj on `<s>`) (GLUE)."""

    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.config = config

        self.roberta = RobertaPkmModel(config, add_pooling_layer=False)
        self.classifier = RobertaPkmClassificationHead(config)

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
            Other arguments: `RobertaPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.roberta(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            return_dict=True,
            **kwargs,
        )
        logits = self.classifier(outputs[0])
        loss = sequence_classification_loss(self, logits, labels)

        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForMultipleChoice with bert->roberta, BertPkm->RobertaPkm
# Differs: `classifier_dropout = (\n            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob\n        )\n        self.dropout = nn.Dropout(classifier_dropout)` -> `self.dropout = nn.Dropout(config.hidden_dropout_prob)  # RoBERTa's`
class RobertaPkmForMultipleChoice(RobertaPkmPreTrainedModel):
    """RobertaPkm with a multiple choice head (a score per choice from the pooled output)."""

    _auto_class = "AutoModelForMultipleChoice"

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)

        self.roberta = RobertaPkmModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)  # RoBERTa's
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

        outputs = self.roberta(
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


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForTokenClassification with bert->roberta, BertPkm->RobertaPkm
class RobertaPkmForTokenClassification(RobertaPkmPreTrainedModel):
    """RobertaPkm with a token classification head (e.g. NER)."""

    _auto_class = "AutoModelForTokenClassification"

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.roberta = RobertaPkmModel(config, add_pooling_layer=False)
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
            Class ids in `[0, num_labels)` per token; `-100` is ignored. Other arguments: `RobertaPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.roberta(
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


# Copied from modeling_pkm_bert.modeling_bert_pkm.BertPkmForQuestionAnswering with bert->roberta, BertPkm->RobertaPkm
class RobertaPkmForQuestionAnswering(RobertaPkmPreTrainedModel):
    """RobertaPkm with a span extraction head (start/end logits) for extractive QA (SQuAD)."""

    _auto_class = "AutoModelForQuestionAnswering"

    def __init__(self, config: RobertaPkmConfig):
        super().__init__(config)
        self.num_labels = config.num_labels

        self.roberta = RobertaPkmModel(config, add_pooling_layer=False)
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
            `RobertaPkmModel`.
        """
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        outputs = self.roberta(
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
    "RobertaPkmForCausalLM",
    "RobertaPkmForMaskedLM",
    "RobertaPkmForMultipleChoice",
    "RobertaPkmForQuestionAnswering",
    "RobertaPkmForSequenceClassification",
    "RobertaPkmForTokenClassification",
    "RobertaPkmModel",
    "RobertaPkmPreTrainedModel",
]
