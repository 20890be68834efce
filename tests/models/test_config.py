import pytest

from modeling_pkm_bert import AUTO_MAP, BertPkmConfig
from transformers import BertConfig


def test_defaults_are_the_papers_bert_base_setting():
    config = BertPkmConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (768, 12, 3072)
    assert config.pkm_layers == [4, 8] and config.pkm_mode == "resm"
    assert (config.pkm_n_keys, config.pkm_heads, config.pkm_knn, config.pkm_k_dim) == (512, 4, 32, 256)
    assert config.pkm_query_batchnorm and config.pkm_value_init == "normal"
    assert config.pkm_input_dropout == config.pkm_query_dropout == config.pkm_value_dropout == 0
    assert config.model_type == "bert_pkm" and isinstance(config, BertConfig)
    assert BertPkmConfig(num_hidden_layers=6).pkm_layers == [2, 4]
    assert BertPkmConfig(pkm_layers=[]).pkm_layers == []


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(pkm_layers=[12]), "pkm_layers"),
        (dict(pkm_layers=[-1]), "pkm_layers"),
        (dict(num_hidden_layers=4, pkm_layers=[1, 4]), "pkm_layers"),
        (dict(pkm_layers=[3, 3]), "pkm_layers"),
        (dict(pkm_k_dim=255), "pkm_k_dim"),
        (dict(pkm_knn=0), "pkm_knn"),
        (dict(pkm_knn=513), "pkm_knn"),
        (dict(pkm_heads=0), "pkm_heads"),
        (dict(pkm_n_keys=0), "pkm_n_keys"),
        (dict(pkm_mode="after"), "pkm_mode"),
        (dict(pkm_value_init="uniform"), "pkm_value_init"),
        (dict(pkm_input_dropout=1.0), "pkm_input_dropout"),
        (dict(pkm_query_dropout=-0.1), "pkm_query_dropout"),
        (dict(pkm_value_dropout=1.5), "pkm_value_dropout"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BertPkmConfig(**kwargs)


def test_wrong_types_are_rejected():
    with pytest.raises(Exception, match="pkm_knn"):
        BertPkmConfig(pkm_knn="many")


def test_round_trip_and_auto_map(tmp_path):
    config = BertPkmConfig(num_hidden_layers=6, pkm_layers=[1, 5], pkm_mode="replace", pkm_knn=8, pkm_value_dropout=0.1)
    config.save_pretrained(tmp_path)
    loaded = BertPkmConfig.from_pretrained(tmp_path)
    for name in ("pkm_layers", "pkm_mode", "pkm_knn", "pkm_value_dropout", "num_hidden_layers"):
        assert getattr(loaded, name) == getattr(config, name)
    assert loaded.auto_map == AUTO_MAP
    assert set(AUTO_MAP) == {
        "AutoConfig", "AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
        "AutoModelForQuestionAnswering", "AutoModelForTokenClassification", "AutoModelForMultipleChoice",
        "AutoModelForCausalLM",
    }  # fmt: skip
