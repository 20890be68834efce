#!/usr/bin/env python
"""
Publish a BertPkm output folder (converted or trained) on the Hugging Face Hub: check that it is a complete Hub
repository, write a model card if it has none, then create the repository and upload what a model repository needs
(an allow-list: weights, configs, code files, tokenizer, card, results, sentence-transformers modules, the memory
report). Accelerate checkpoints (step_*/epoch_*), pickles, logs, tracker folders and hidden files are never sent;
symlinks are refused. `--dry_run` lists what would be sent and changes nothing in the folder.

    python run_scripts/push_to_hub.py --model_dir outputs/mlm --hub_model_id me/bert-pkm-mlm --private

`--refresh_code` first replaces the folder's remote-code files by the installed package's (checked: the folder must
compute the same outputs through them, in a process without the package); without `--hub_model_id` it only refreshes:

    python run_scripts/push_to_hub.py --model_dir old-folder --refresh_code
"""

import argparse
import logging
import os
from pathlib import Path


from modeling_pkm_bert.training.arguments import help_requested  # noqa: E402 (standard library only)
from modeling_pkm_bert.utils.input_errors import InputError, exits_with_usage_errors  # noqa: E402
from modeling_pkm_bert.utils.output_folders import check_command_paths  # noqa: E402

if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    from modeling_pkm_bert.hub.model_card import write_model_card
    from modeling_pkm_bert.hub.refresh import refresh_code
    from modeling_pkm_bert.hub.upload import TOKENIZER_FILES, check_hub_folder, files_to_upload, push_folder_to_hub


logger = logging.getLogger(__name__)


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description="Upload a BertPkm output folder to the Hugging Face Hub."
    )
    parser.add_argument(
        "--model_dir", type=str, required=True, help="Output folder of convert_to_pkm.py or of a run_* script."
    )
    parser.add_argument("--hub_model_id", type=str, default=None, help="Repository to push to, e.g. user/bert-pkm.")
    parser.add_argument(
        "--refresh_code",
        action="store_true",
        help="Replace the folder's code files by the installed package's (checked to compute the same outputs) first;"
        " without --hub_model_id, only that.",
    )
    parser.add_argument(
        "--quantize_values",
        type=int,
        default=None,
        choices=(8, 4),
        help="Publish the model with int8 (8) or 4-bit (4) value tables: written to --quantized_dir first (default:"
        " MODEL_DIR-int8 / MODEL_DIR-4bit), MODEL_DIR is left as it is (docs/serving.md).",
    )
    parser.add_argument("--quantized_dir", type=str, default=None, help="Where --quantize_values writes its folder.")
    parser.add_argument("--private", action="store_true", help="Create the repository as private.")
    parser.add_argument("--hub_token", type=str, default=None, help="Hub token (default: HF_TOKEN or the login).")
    parser.add_argument("--commit_message", type=str, default="Upload BertPkm model")
    parser.add_argument("--base_model", type=str, default=None, help="Hub id of the base model, for a new model card.")
    parser.add_argument("--license", type=str, default=None, help="License, for a new model card.")
    parser.add_argument("--dry_run", action="store_true", help="List what would be uploaded, upload nothing.")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.model_dir).is_dir():
        parser.error(f"--model_dir {args.model_dir} is not a folder")
    if not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"--model_dir {args.model_dir} has no config.json: not a saved model folder")
    if args.quantized_dir and not args.quantize_values:
        parser.error("--quantized_dir needs --quantize_values")
    if args.hub_model_id is None and not args.refresh_code:
        parser.error("--hub_model_id is required (or --refresh_code alone, to refresh the folder's code files)")
    check_command_paths(parser, args, "push_to_hub")  # --quantized_dir apart from --model_dir
    return args


@exits_with_usage_errors(build_parser)  # a folder that is no BertPkm model, a --quantized_dir in use: a usage error
def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)

    if args.refresh_code:
        changed = refresh_code(args.model_dir, dry_run=args.dry_run)
        verb = "Would refresh" if args.dry_run else "Refreshed"
        print(f"{verb} {', '.join(changed)} in {args.model_dir}" if changed else f"{args.model_dir}: code files up to date")
        if args.hub_model_id is None:
            return None
    if args.quantize_values:
        from modeling_pkm_bert.hub.upload import quantize_folder

        suffix = "int8" if args.quantize_values == 8 else "4bit"
        quantized_dir = args.quantized_dir or f"{str(args.model_dir).rstrip('/')}-{suffix}"
        args.model_dir = quantize_folder(args.model_dir, quantized_dir, bits=args.quantize_values)
        logger.info(f"Wrote the {suffix} model to {args.model_dir}")
    try:
        check_hub_folder(args.model_dir)
    except ValueError as error:  # what the folder lacks (a plain BERT, a missing code file or shard)
        raise InputError(f"--model_dir {error}") from None
    if not any((Path(args.model_dir) / name).is_file() for name in TOKENIZER_FILES):
        logger.warning(f"{args.model_dir} has no tokenizer: users of the repository will need another one")
    files = files_to_upload(args.model_dir)  # refuses symlinks before anything is written or sent
    new_card = not (Path(args.model_dir) / "README.md").is_file()
    if args.dry_run:  # changes nothing: the card that would be written is only announced
        files = sorted(files + ["README.md"]) if new_card else files
        print(f"Would upload {len(files)} files to {args.hub_model_id}:")
        for name in files:
            print(f"  {name}" + (" (a model card, written at upload)" if new_card and name == "README.md" else ""))
        return None
    if new_card:
        write_model_card(args.model_dir, repo_id=args.hub_model_id, base_model=args.base_model, license=args.license)
        logger.info(f"Wrote a model card to {Path(args.model_dir) / 'README.md'}")
        files = files_to_upload(args.model_dir)
    print(f"Uploading {len(files)} files to {args.hub_model_id}:")
    print("\n".join(f"  {name}" for name in files))
    commit = push_folder_to_hub(
        args.model_dir,
        args.hub_model_id,
        private=args.private,
        token=args.hub_token,
        commit_message=args.commit_message,
    )
    logger.info(f"Pushed to {commit}")
    return commit


if __name__ == "__main__":
    main()
