#!/usr/bin/env python
# Copyright the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
The memory explorer of a BertPkm model: one static page (`index.html`, opened from disk, no server, no network) that
shows, per memory layer, the slots ranked by use with the usage curve (the memory report's numbers for the same texts),
each slot's contexts and the tokens its value promotes, and which slots a token's occurrences select, per layer and
head; for hashed n-gram memories the same per bucket, with its collisions. Its data (`explorer.json`, and `data/*.js`
loaded as slots are opened) sits beside it.

    python run_scripts/memory_explorer.py --model_name_or_path out/resm --output_dir out/resm/explorer
    python run_scripts/memory_explorer.py --model_name_or_path out/resm --text_file a.txt b.txt \\
        --max_tokens 100000 --layers 4 --output_dir out/resm/explorer

Without --text_file or --dataset_name, it reads the embedded held-out text the memory report reads (the last chapters
of Pride and Prejudice). How the values are projected onto the vocabulary: modeling_pkm_bert/analysis/explorer.py.
"""

import argparse
import os
from pathlib import Path


from modeling_pkm_bert.training.arguments import help_requested  # noqa: E402 (standard library only)
from modeling_pkm_bert.utils.input_errors import exits_with_usage_errors, one_line, usage_errors  # noqa: E402
from modeling_pkm_bert.utils.output_folders import check_command_paths, check_output_folder  # noqa: E402

if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    from modeling_pkm_bert.analysis.explorer import TOOL, MemoryExplorerError, build_memory_explorer, explored_memories
    from modeling_pkm_bert.analysis.report import read_texts


EMBEDDED_TEXT_FILE = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_validation.txt"


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description="A static HTML page that shows what a model's memory slots hold"
    )
    parser.add_argument("--model_name_or_path", required=True, help="A BertPkm folder (any head) or Hub id.")
    parser.add_argument(
        "--output_dir",
        required=True,
        help="Where index.html and its data go: a new or empty folder, or an earlier explorer's (replaced when "
        "complete); never the model's folder.",
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Replace a non-empty --output_dir this script did not write."
    )
    parser.add_argument(
        "--text_file", nargs="+", action="extend", default=None,
        help="Text to run (txt, or csv/tsv/json with a text column); several files, or the flag repeated.",
    )
    parser.add_argument("--dataset_name", default=None, help="A datasets name or local path (instead of --text_file).")
    parser.add_argument("--dataset_config_name", default=None, help="Its configuration (e.g. wikitext-2-raw-v1).")
    parser.add_argument("--dataset_split", default="validation", help="Its split.")
    parser.add_argument("--text_column", default="text", help="Its text column.")
    parser.add_argument(
        "--layers", nargs="+", type=int, default=None, help="Encoder layers whose memories to explore (default: all)."
    )
    parser.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="Tokens per sequence (as the memory report; default: 128, at most the model's positions).",
    )
    parser.add_argument("--max_tokens", type=int, default=100_000, help="Run at most this many tokens (whole sequences).")
    parser.add_argument("--contexts_per_slot", type=int, default=10, help="The heaviest contexts kept per slot.")
    parser.add_argument("--window", type=int, default=12, help="Tokens shown each side of a context's token.")
    parser.add_argument("--top_tokens", type=int, default=10, help="Promoted tokens shown per slot.")
    parser.add_argument(
        "--max_projected_slots", type=int, default=None,
        help="Project the values of only this many most-used slots onto the vocabulary (default: every slot).",
    )
    parser.add_argument("--batch_size", type=int, default=8, help="Sequences per forward.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Load the model's code from its folder/Hub.")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.text_file is not None and args.dataset_name is not None:
        parser.error("give --text_file or --dataset_name, not both")
    for path in args.text_file or []:
        if not os.path.isfile(path):
            parser.error(f"--text_file {path!r} does not exist")
    for option in ("max_seq_length", "max_tokens", "contexts_per_slot", "top_tokens", "batch_size"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if args.window < 0:
        parser.error(f"--window must be >= 0, got {args.window}")
    reads = [("--model_name_or_path", args.model_name_or_path), *(("--text_file", path) for path in args.text_file or [])]
    with usage_errors(parser):
        check_output_folder(args.output_dir, TOOL, overwrite=args.overwrite_output_dir, reads=reads)
    check_command_paths(parser, args, TOOL)  # nor inside what it reads (a --dataset_name folder)
    return args


def dataset_texts(args) -> list[str]:
    import datasets

    try:
        dataset = datasets.load_dataset(args.dataset_name, args.dataset_config_name, split=args.dataset_split)
    except FileNotFoundError as error:  # datasets' DatasetNotFoundError: no such dataset, folder or file
        raise MemoryExplorerError(f"--dataset_name {args.dataset_name!r}: {error}") from None
    except ValueError as error:  # an unknown split (a local folder has only `train` by default) or config
        if not str(error).startswith("Unknown split"):
            raise MemoryExplorerError(f"--dataset_name {args.dataset_name!r}: {one_line(error)}") from None
        splits = datasets.get_dataset_split_names(args.dataset_name, args.dataset_config_name)
        raise MemoryExplorerError(
            f"--dataset_split {args.dataset_split!r} is not a split of {args.dataset_name} (its splits: "
            f"{', '.join(splits)}): give --dataset_split {splits[0]}"
        ) from None
    if args.text_column not in dataset.column_names:
        raise MemoryExplorerError(
            f"--text_column {args.text_column!r} is not a column of {args.dataset_name} (columns: {dataset.column_names})"
        )
    return [text for text in dataset[args.text_column] if text and text.strip()]


@exits_with_usage_errors(build_parser)  # a model without memories, a text too short, ...: a usage error, not a traceback
def main(argv=None):
    args = parse_args(argv)
    from modeling_pkm_bert.training.loading import load_model, load_tokenizer

    # Read the texts first: a bad file fails before the model loads
    if args.dataset_name is not None:
        texts = dataset_texts(args)
    else:
        texts = [text for path in args.text_file or [str(EMBEDDED_TEXT_FILE)] for text in read_texts(path)]

    # Load the model with its LM head (the value projection's output embedding) and check the layers
    model = load_model("masked-lm", args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    explored_memories(model, args.layers)
    tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)

    summary = build_memory_explorer(
        model,
        tokenizer,
        args.output_dir,
        texts,
        layers=args.layers,
        max_seq_length=args.max_seq_length,
        max_tokens=args.max_tokens,
        contexts_per_slot=args.contexts_per_slot,
        top_tokens=args.top_tokens,
        window=args.window,
        max_projected_slots=args.max_projected_slots,
        batch_size=args.batch_size,
        title=f"Memory explorer of {os.path.basename(os.path.normpath(args.model_name_or_path))}",
        progress=True,
        overwrite=args.overwrite_output_dir,
    )
    print(f"wrote {os.path.join(args.output_dir, 'index.html')} ({summary['tokens']} tokens)")
    return summary


if __name__ == "__main__":
    main()
