#!/usr/bin/env python
# Copyright the modeling_pkm_bert authors. Licensed under the Apache License 2.0.
"""
The memory report of a BertPkm model: per memory layer, slot-usage heat maps and the sorted usage curve (MU, top-1 MU,
KL_u, KL_w, Gini) on held-out text; per-class usage with IOU and KL between the classes (Kim & Jung 2020, Figure 4)
for labelled examples; the staleness histogram (Figure 2) and training curves (Figure 3) of a training run. Writes
PNG figures, `memory_report.md` embedding them and `memory_report.json` into --output_dir.

    python run_scripts/memory_report.py --model_name_or_path out/resm --validation_file held_out.txt \\
        --run_dir out/resm --output_dir out/resm/memory_report
    python run_scripts/memory_report.py --model_name_or_path out/sst2 --task_name sst2 \\
        --train_file SST-2/dev.tsv --output_dir out/sst2/memory_report

Without --validation_file, the usage is measured on the labelled examples; with neither, on the project's embedded
held-out text (two chapters of Pride and Prejudice).
"""

import argparse
import os
from pathlib import Path


from modeling_pkm_bert.training.arguments import help_requested  # noqa: E402 (standard library only)
from modeling_pkm_bert.utils.input_errors import exits_with_usage_errors, usage_errors  # noqa: E402
from modeling_pkm_bert.utils.output_folders import check_command_paths, check_output_folder  # noqa: E402

if not help_requested(__name__):  # `--help` prints at once: the libraries below load only for a run
    from modeling_pkm_bert.analysis.report import (
        TOOL,
        check_reportable,
        check_run_dir,
        read_texts,
        sequence_length_of,
        write_memory_report,
    )
    from modeling_pkm_bert.training.glue_data import class_data_from_files


EMBEDDED_VALIDATION_FILE = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_validation.txt"


def build_parser():
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog=os.path.basename(__file__), description="Figures and a markdown report of a model's product key memories"
    )
    parser.add_argument("--model_name_or_path", required=True, help="A BertPkm folder (any head) or Hub id.")
    parser.add_argument("--validation_file", default=None, help="Held-out text (txt, or csv/tsv/json with a text column).")
    parser.add_argument("--task_name", default=None, help="A GLUE task: --train_file is then its TSV (e.g. dev.tsv).")
    parser.add_argument("--train_file", default=None, help="Labelled examples for the per-class usage (a 'label' column).")
    parser.add_argument("--run_dir", default=None, help="A training output folder: staleness and training curves.")
    parser.add_argument(
        "--output_dir",
        required=True,
        help="Where the report goes: a new or empty folder, or an earlier report's (replaced when complete); never the "
        "model's folder or the run directory.",
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true", help="Replace a non-empty --output_dir this script did not write."
    )
    parser.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="Tokens per held-out sequence (default: 128, at most the model's positions).",
    )
    parser.add_argument("--max_sequences", type=int, default=64, help="At most this many held-out sequences.")
    parser.add_argument("--max_examples", type=int, default=512, help="At most this many labelled examples.")
    parser.add_argument("--batch_size", type=int, default=8, help="Sequences per forward.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Load the model's code from its folder/Hub.")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.task_name is not None and args.train_file is None:
        parser.error("--task_name needs --train_file: the task's labelled TSV (e.g. SST-2/dev.tsv)")
    for option in ("validation_file", "train_file"):
        path = getattr(args, option)
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{option} {path!r} does not exist")
    for option in ("max_seq_length", "max_sequences", "max_examples", "batch_size"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    reads = [(f"--{option}", getattr(args, option)) for option in ("model_name_or_path", "run_dir", "validation_file",
                                                                   "train_file")]  # fmt: skip
    with usage_errors(parser):
        check_output_folder(args.output_dir, TOOL, overwrite=args.overwrite_output_dir, reads=reads)
    check_command_paths(parser, args, TOOL)
    return args


@exits_with_usage_errors(build_parser)  # a model without memories, a run folder without logs, ...: a usage error
def main(argv=None):
    args = parse_args(argv)
    from modeling_pkm_bert.training.loading import load_model, load_tokenizer

    # cheap checks first: a bad run directory fails before the model loads
    if args.run_dir is not None:
        check_run_dir(args.run_dir)
    model = load_model("base", args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    check_reportable(model)  # product key or n-gram memories, before the data is read
    tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    max_seq_length = sequence_length_of(model, args.max_seq_length)  # the default fits the model's positions
    class_data = (
        class_data_from_files(tokenizer, args.train_file, args.task_name, max_seq_length, args.max_examples)
        if args.train_file is not None
        else None
    )
    texts = None
    if args.validation_file is not None:
        texts = read_texts(args.validation_file)
    elif class_data is None:
        texts = read_texts(str(EMBEDDED_VALIDATION_FILE))
    report = write_memory_report(
        model,
        tokenizer,
        args.output_dir,
        texts=texts,
        class_data=class_data,
        run_dir=args.run_dir,
        max_seq_length=max_seq_length,
        max_sequences=args.max_sequences,
        batch_size=args.batch_size,
        title=f"Memory report of {os.path.basename(os.path.normpath(args.model_name_or_path))}",
        overwrite=args.overwrite_output_dir,
    )
    print(f"wrote {os.path.join(args.output_dir, 'memory_report.md')}")
    return report


if __name__ == "__main__":
    main()
