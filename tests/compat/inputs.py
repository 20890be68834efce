"""The fixed inputs of the compatibility folders (torch only: the checking process cannot import the package)."""

import torch


def fixed_inputs(name: str, vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # a padded row: the memories must skip it
    if name.endswith("choice"):
        return {"input_ids": input_ids.view(1, 2, 9), "attention_mask": attention_mask.view(1, 2, 9)}
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def forward_kwargs(name: str) -> dict:
    return {"use_cache": False} if "causal" in name else {}
