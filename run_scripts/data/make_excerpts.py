"""Rebuilds the public-domain excerpts of this folder from the Project Gutenberg files (see README.md).

python run_scripts/data/make_excerpts.py /path/to/books   # the folder holding pg1342_*.txt and pg2701_*.txt
"""

import argparse
import hashlib
import re
from pathlib import Path


SOURCES = {
    "pg1342_pride_and_prejudice.txt": "86dab871eec9c0cef97f4cb6313f86c6cc48f6f7809534e65cd3f1c1d486d247",
    "pg2701_moby_dick.txt": "1fc8b162929e0e095ad636c6364a59cb634e5097933eb7735bf2c251f685d274",
}
# (output file, source file, first heading, heading that ends the excerpt or None for the end of the novel)
EXCERPTS = [
    ("pride_and_prejudice_train.txt", "pg1342_pride_and_prejudice.txt", "CHAPTER I.", "CHAPTER XXI."),
    ("pride_and_prejudice_validation.txt", "pg1342_pride_and_prejudice.txt", "CHAPTER LIX.", None),
    ("moby_dick_validation.txt", "pg2701_moby_dick.txt", "CHAPTER 1. Loomings.", "CHAPTER 3. The Spouter-Inn."),
]


def strip_gutenberg(text: str) -> str:
    """The book between the `*** START/END OF THE PROJECT GUTENBERG EBOOK` markers, when it has them."""
    start = re.search(r"^\*\*\* START OF TH.*$", text, flags=re.M)
    end = re.search(r"^\*\*\* END OF TH.*$", text, flags=re.M)
    return text[start.end() if start else 0 : end.start() if end else len(text)]


def excerpt(text: str, first: str, stop: str | None) -> str:
    """From the line `first` (its last occurrence: a table of contents lists it too) up to the line `stop`."""
    # Pride and Prejudice's first chapter has an illustrated heading instead of a "CHAPTER I." line
    text = re.sub(r"^\s*\[Illustration:[^\]]*?Chapter I\.\]\s*$", "CHAPTER I.", text, count=1, flags=re.M)
    start = [m.end() for m in re.finditer(rf"^{re.escape(first)}\s*$", text, flags=re.M)][-1]
    if stop is not None:
        end = re.compile(rf"^{re.escape(stop)}\s*$", flags=re.M).search(text, start).start()
    else:  # the novel ends at its "THE END" (Pride and Prejudice: an illustration) or at the Gutenberg footer
        match = re.compile(r"\[Illustration:\s*THE\s+END\s*\]", flags=re.S).search(text, start)
        end = match.start() if match else len(text)
    return text[start:end]


def paragraphs(text: str) -> list[str]:
    """One paragraph per line: illustrations and italics marks removed, wrapped lines joined."""
    text = re.sub(r"\[Illustration[^\]]*\]", " ", text)
    text = text.replace("_", "")
    result = []
    for block in re.split(r"\n\s*\n", text):
        line = " ".join(block.split())
        if line and not re.fullmatch(r"[\W\d]*|CHAPTER [IVXLC\d]+\b.*", line):
            result.append(line)
    return result


def main():
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("books", type=Path, help="folder with the Project Gutenberg files")
    parser.add_argument("--output_dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()

    for name, sha256 in SOURCES.items():
        digest = hashlib.sha256((args.books / name).read_bytes()).hexdigest()
        if digest != sha256:
            raise SystemExit(f"{args.books / name}: sha256 {digest} is not the expected {sha256}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for output, source, first, stop in EXCERPTS:
        text = strip_gutenberg((args.books / source).read_text(encoding="utf-8"))
        lines = paragraphs(excerpt(text, first, stop))
        (args.output_dir / output).write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"{output}: {source} from {first!r} to {stop or 'the end'!r}: {len(lines)} paragraphs")


if __name__ == "__main__":
    main()
