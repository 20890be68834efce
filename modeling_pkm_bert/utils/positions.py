"""How many tokens a sequence of a model may hold (its position embeddings), for every command that picks a sequence
length: the training scripts, the memory report and the memory explorer."""

from ..configuration_roberta_pkm import RobertaPkmConfig
from .input_errors import InputError


# RoBERTa-family model types: their positions start at pad_token_id + 1
ROBERTA_FAMILY_MODEL_TYPES = ("roberta", "xlm-roberta", RobertaPkmConfig.model_type)


def usable_positions(config) -> int | None:
    """The most tokens a sequence of the model may hold: `max_position_embeddings` (GPT-2: `n_positions`), less the
    `pad_token_id + 1` positions a RoBERTa-family model skips (roberta-base: 514 -> 512); None where unknown."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and getattr(config, "model_type", None) in ROBERTA_FAMILY_MODEL_TYPES:
        positions -= (getattr(config, "pad_token_id", None) or 0) + 1
    return positions


def fitting_length(config, default: int) -> int:
    """`default` capped at the model's usable positions: a script's default sequence length that the model takes."""
    positions = usable_positions(config)
    return default if positions is None else max(1, min(default, positions))


def sequence_length(
    config, given: int | None, default: int, option: str = "--max_seq_length", error: type[Exception] = InputError
) -> int:
    """A command's tokens per sequence: `given`, else `default` capped at the model's positions (`fitting_length`);
    `error` naming `option` where a given length exceeds the positions (the model would refuse every sequence)."""
    if given is None:
        return fitting_length(config, default)
    positions = usable_positions(config)
    if positions is not None and given > positions:
        raise error(f"{option} {given} is longer than the model's {positions} positions (max_position_embeddings)")
    return given


__all__ = ["ROBERTA_FAMILY_MODEL_TYPES", "fitting_length", "sequence_length", "usable_positions"]
