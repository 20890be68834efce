#!/usr/bin/env python
"""
Convert a BERT, DistilBERT, RoBERTa, DistilRoBERTa, XLM-RoBERTa or ModernBERT-type (ModernBERT, Ettin's encoders,
mmBERT) checkpoint (local folder or Hub id) into a BertPkm, RobertaPkm or ModernBertPkm model with product key memory
layers ("+Init" of Kim & Jung 2020) and save it as a complete Hub repository; optionally push it to the Hub.

    python run_scripts/convert_to_pkm.py --model_name_or_path bert-base-uncased --output_dir bert-pkm \
        --pkm_layers 4 8 --pkm_mode resm --pkm_value_init zeros
    python run_scripts/convert_to_pkm.py --model_name_or_path answerdotai/ModernBERT-base --output_dir modernbert-pkm \
        --pkm_layers 7 14 --pkm_mode resm --pkm_value_init zeros
"""

import argparse
import logging
import os
import sys
from pathlib import Path


from modeling_pkm_bert.hub.card_command import card_command  # noqa: E402
from modeling_pkm_bert.training.arguments import (  # noqa: E402
    TARGET_CLASSES,
    add_pkm_arguments,
    check_push_arguments,
    help_requested,
    hub_model_id,
)
from modeling_pkm_bert.utils.input_errors import exits_with_usage_errors, usage_errors  # noqa: E402
from modeling_pkm_bert.utils.output_folders import check_command_paths, check_output_folder  # noqa: E402


if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    from transformers import AutoConfig, set_seed

    from modeling_pkm_bert.hub.conversion import (
        TOOL,
        check_source,
        conversion_target,
        convert_to_pkm,
        load_source_tokenizer,
        save_converted,
        sentence_transformers_files,
    )
    from modeling_pkm_bert.hub.model_card import card_base_model, card_license
    from modeling_pkm_bert.hub.upload import push_folder_to_hub
    from modeling_pkm_bert.training.loading import pkm_kwargs_from_args


logger = logging.getLogger(__name__)


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__),
        description="Convert a BERT/DistilBERT/RoBERTa/XLM-RoBERTa/ModernBERT checkpoint into a BertPkm/RobertaPkm/"
        "ModernBertPkm model.",
    )
    parser.add_argument(
        "--model_name_or_path", type=str, required=True, help="BERT, DistilBERT, RoBERTa, XLM-RoBERTa or ModernBERT-type (ModernBERT, Ettin, mmBERT) checkpoint: a local folder or Hub id."
    )
    parser.add_argument(
        "--output_dir",
        type=str,
        required=True,
        help="Where to write the converted Hub folder: a new or empty folder, or an earlier conversion's (replaced when "
        "complete); never the source folder.",
    )
    parser.add_argument(
        "--target_class",
        type=str,
        default=None,
        choices=TARGET_CLASSES,
        help="BertPkm class to build (default: the one of the source's head, BertForMaskedLM -> BertPkmForMaskedLM); "
        "a RoBERTa-family source builds the RobertaPkm class of the same head, a ModernBERT-type one the ModernBertPkm class.",
    )
    parser.add_argument(
        "--num_labels", type=int, default=None, help="Labels of a new classification head (with --target_class)."
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Replace a non-empty --output_dir this script did not write."
    )
    parser.add_argument("--max_shard_size", type=str, default="2GB", help="Weights above this size are sharded.")
    parser.add_argument("--seed", type=int, default=42, help="Seed of the memory initialisation.")
    parser.add_argument(
        "--base_model",
        type=hub_model_id,
        default=None,
        help="Hub id of the source for the model card's `base_model` (default: --model_name_or_path when it is a Hub "
        "id; give it for a local folder, e.g. sentence-transformers/all-MiniLM-L6-v2).",
    )
    parser.add_argument(
        "--license",
        type=str,
        default=None,
        help="License for the model card (default: the source's, from its card or config, else apache-2.0).",
    )
    parser.add_argument(
        "--quantize_values",
        type=int,
        default=None,
        choices=(8, 4),
        help="Store the value tables as int8 (8) or 4-bit (4) rows for serving (inference only; docs/serving.md).",
    )
    parser.add_argument("--push_to_hub", action="store_true", help="Upload the output folder to the Hub.")
    parser.add_argument(
        "--hub_model_id", type=str, default=None, help="Repository to push to (default: the --output_dir name)."
    )
    parser.add_argument("--private", action="store_true", help="Create the Hub repository as private.")
    parser.add_argument("--hub_token", type=str, default=None, help="Hub token (default: HF_TOKEN or the login).")
    add_pkm_arguments(parser, training_options=False)  # the pkm_* flags every script shares
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.num_labels is not None and args.num_labels < 1:
        parser.error("--num_labels must be >= 1")
    check_push_arguments(parser, args, ("hub_model_id", "private", "hub_token"))
    try:
        check_source(args.model_name_or_path)
    except ValueError as error:
        parser.error(f"--model_name_or_path {error}")
    with usage_errors(parser):
        reads = {"--model_name_or_path": args.model_name_or_path}
        check_output_folder(args.output_dir, TOOL, overwrite=args.overwrite_output_dir, reads=reads)
        sentence_transformers_files(args.model_name_or_path)  # malformed sentence-transformers module files
    check_command_paths(parser, args, TOOL)
    check_target_config(parser, args)
    return args


def check_target_config(parser, args) -> None:
    """The config the conversion will build, checked from the source's config alone (the model type, the target class,
    the `--pkm_*` values the config refuses) before any weight loads; a source whose config cannot be read here (a Hub
    id not in the cache) is named by the conversion."""
    try:
        source_config = AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=False)
    except (OSError, ValueError):
        return
    overrides = {"num_labels": args.num_labels} if args.num_labels is not None else None
    with usage_errors(parser, ValueError):  # only the config is built here: its ValueError is the flags' fault
        conversion_target(source_config, args.model_name_or_path, args.target_class, overrides, pkm_kwargs_from_args(args))


@exits_with_usage_errors(build_parser)  # what only the source shows (a Hub id not cached offline): a usage error
def main(argv=None):
    args = parse_args(argv)
    # secrets (by flag name and by parsed destination) and paths removed
    command = card_command(__file__, sys.argv[1:] if argv is None else argv, args.output_dir, parser=build_parser())
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    hub_model_id = args.hub_model_id or (Path(args.output_dir).absolute().name if args.push_to_hub else None)
    set_seed(args.seed)

    # Convert
    config_overrides = {"num_labels": args.num_labels} if args.num_labels is not None else None
    model, report = convert_to_pkm(
        args.model_name_or_path, args.target_class, config_overrides=config_overrides, **pkm_kwargs_from_args(args)
    )
    print(report)
    if args.quantize_values:
        from modeling_pkm_bert import quantize_memory_values

        tables = quantize_memory_values(model, bits=args.quantize_values)
        logger.info(f"Quantized {tables} value table(s) to {model.config.pkm_values_quantization} rows")

    # Save the Hub folder: weights, code, config, tokenizer, model card
    tokenizer = load_source_tokenizer(args.model_name_or_path)
    if tokenizer is None:
        logger.warning(f"{args.model_name_or_path} has no tokenizer files: the output folder has no tokenizer")
    output_dir = save_converted(
        model,
        report,
        args.output_dir,
        tokenizer=tokenizer,
        source_name=card_base_model(args.model_name_or_path, args.base_model),
        license=card_license(args.model_name_or_path, args.license),
        repo_id=hub_model_id,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite_output_dir,
        command=command,
    )
    logger.info(f"Saved {report.target_class} to {output_dir}")

    if args.push_to_hub:
        commit = push_folder_to_hub(
            output_dir,
            hub_model_id,
            private=args.private,
            token=args.hub_token,
            commit_message=f"Convert {report.source} to {report.target_class}",
        )
        logger.info(f"Pushed to {commit}")
    return output_dir


if __name__ == "__main__":
    main()
