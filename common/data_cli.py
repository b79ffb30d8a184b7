"""
data_cli.py: the command line of `python -m common.data` (common/data.py prepares a corpus and serves its batches):
which text, which tokenizer, where. A bad input is one `error:` line before anything is written; a Ctrl-C is one
line saying whether the directory's dataset changed (its files are written under temporary names, removed when the
preparation stops, and renamed into place at the end, meta.json last).
"""
import argparse
import json
import os

from common.data import DEFAULT_DATA_DIR, not_a_file, prepare_shakespeare, prepare_stdlib, prepare_text_files
from common.errors import fail, report_interrupts


def main(argv=None):
    p = argparse.ArgumentParser(description="Prepare a dataset as train.bin / val.bin / meta.json.",
                                allow_abbrev=False)         # a prefix of a flag is not the flag
    p.add_argument("--out_dir", default=None, help="where to write (default data/stdlib, data/<name>)")
    p.add_argument("--input", nargs="+", default=None, help="text files to tokenize instead of the stdlib")
    p.add_argument("--shakespeare", action="store_true", help="download tiny-shakespeare (needs internet)")
    p.add_argument("--tokenizer", default="byte",
                   help="byte: raw bytes, vocab 256 (offline); gpt2: tiktoken BPE (downloads its file once); or a "
                        "directory holding a Hugging Face tokenizer.json (the tokenizers library, offline)")
    a = p.parse_args(argv)
    try:
        check_out_dir_arg(a.out_dir)
        if a.tokenizer not in ("byte", "gpt2"):
            from common.hf.tokenizer import hf_tokenizer
            hf_tokenizer(a.tokenizer)               # a readable tokenizer.json there, before any work
        if a.shakespeare and a.input:
            raise ValueError("--shakespeare and --input both name the text: pick one")
        if not (a.shakespeare or a.input) and a.tokenizer != "byte":
            raise ValueError("the default stdlib corpus is byte-level; use --input FILES with another --tokenizer")
        out_dir = a.out_dir or (os.path.join("data", "shakespeare") if a.shakespeare else
                                os.path.join("data", "custom") if a.input else DEFAULT_DATA_DIR)
        report_interrupts(kept=changes_to(out_dir))
        if a.shakespeare:
            meta = prepare_shakespeare(out_dir, a.tokenizer)
        elif a.input:
            meta = prepare_text_files(a.input, out_dir, a.tokenizer)
        else:
            meta = prepare_stdlib(out_dir)
    except (ValueError, OSError) as e:
        fail(str(e))
    print(json.dumps(meta, indent=1))


def check_out_dir_arg(out_dir):
    """--out_dir is a directory, or can be made one (not a file, nor under one)."""
    if out_dir is None:
        return
    if out_dir.strip() == "":
        raise ValueError("--out_dir must name a directory")
    existing = os.path.abspath(out_dir)
    while not os.path.exists(existing):
        if os.path.islink(existing):
            raise ValueError(f"--out_dir {out_dir}: {not_a_file(existing)}")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--out_dir {out_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out_dir {out_dir}: {existing} is not writable")


def changes_to(out_dir):
    """What a Ctrl-C while out_dir is being prepared leaves there, in words, for errors.report_interrupts: the
    dataset it had, or the new one once its meta.json (renamed into place last) has been replaced."""
    meta = os.path.join(out_dir, "meta.json")
    before = meta_version(meta)

    def kept():
        if meta_version(meta) != before:
            return f"{out_dir} holds the newly prepared dataset"
        return f"nothing in {out_dir} was changed" if before else f"no dataset was written to {out_dir}"
    return kept


def meta_version(path):
    """(inode, modification time) of a meta.json, None where there is none: a rename into place changes both."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
