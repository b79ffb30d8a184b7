"""
common/hf/tokenizer.py: the tokenizer a run trained with, as files `transformers.AutoTokenizer` loads (hf.py's export),
the files a corpus keeps of its tokenizer, and the gpt2 and Hugging Face tokenizers of corpus preparation (python -m
common.data --tokenizer gpt2 or HF_DIR). Built with the `tokenizers` library (Rust; offline), never with
transformers. docs/huggingface.md.

A corpus names its tokenizer in meta.json; each gets the files that give exactly the ids it trained on:

    byte   a tokenizer.json mapping each UTF-8 byte b to id b: GPT-2's byte-level alphabet (every byte is a
           printable character) and a BPE with no merges. Decoding replaces invalid UTF-8 as Python's
           errors="replace" does, as the run's own samples do.
    gpt2   GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer.json) rebuilt from the corpus's BPE ranks:
           its gpt2.tiktoken (written by python -m common.data), else tiktoken's cached GPT-2 file. tiktoken keeps
           only ranks (token bytes -> id); merges.txt needs each token's pair, found by re-running BPE on the
           token with the ranks below its own.
    hf     the tokenizer.json (and tokenizer_config.json, special_tokens_map.json) the corpus was prepared with,
           copied from its data directory.
"""
import base64
import json
import os
import shutil

from common.errors import require

RANKS_FILE = "gpt2.tiktoken"         # a gpt2 corpus's BPE ranks, in tiktoken's format: "base64(token) rank" lines
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
KINDS = ("byte", "gpt2", "hf")       # the corpora (meta.json's tokenizer) whose tokenizer an export writes
END_OF_TEXT = "<|endoftext|>"        # GPT-2's one special token, the id after its ranks


def tokenizers_module(purpose):
    return require("tokenizers", purpose, "tokenizers==0.23.3")


def byte_alphabet():
    """GPT-2's byte -> character table: printable bytes stand for themselves, the other 68 for the characters
    from U+0100 on, so that every byte string is a string of visible characters (Radford et al. 2019, encoder.py)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in visible]
    return {b: chr(b) for b in visible} | {b: chr(256 + i) for i, b in enumerate(others)}


def as_characters(token, alphabet):
    return "".join(alphabet[b] for b in token)


# ----------------------------------------------------------------------------------------------------------
# building tokenizers

def byte_level(tk, vocab, merges, split_words):
    """A byte-level BPE tokenizer: text -> UTF-8 bytes -> GPT-2's characters -> BPE; ids back to bytes, decoded
    with invalid UTF-8 replaced. split_words: GPT-2's pre-tokenizing regex (words, numbers, spaces) first."""
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tokenizer.decoder = tk.decoders.ByteLevel()
    return tokenizer


def byte_tokenizer():
    """UTF-8 bytes as ids 0..255: the `byte` corpus's tokenizer."""
    tk = tokenizers_module("exporting a byte-level corpus's tokenizer")
    alphabet = byte_alphabet()
    return byte_level(tk, {alphabet[b]: b for b in range(256)}, [], split_words=False)


def merge_of(token, ranks):
    """The two tokens BPE merged into `token`: BPE re-run on its bytes with only the ranks below its own."""
    parts, rank = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        best, i = min((ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if best >= rank:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"the BPE ranks are not a merge table: token {token!r} is no merge of two earlier ones")
    return parts


def vocab_and_merges(ranks):
    """GPT-2's vocab.json {characters: id} and merges.txt [(left, right)] of tiktoken ranks {bytes: id}."""
    alphabet = byte_alphabet()
    if sorted(ranks.values()) != list(range(len(ranks))) or any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError("the BPE ranks must number their tokens 0..n-1 and hold every single byte")
    vocab = {as_characters(t, alphabet): r for t, r in ranks.items()}
    merges = [tuple(as_characters(p, alphabet) for p in merge_of(t, ranks))
              for t, r in sorted(ranks.items(), key=lambda item: item[1]) if len(t) > 1]
    return vocab, merges


def gpt2_tokenizer(ranks, with_end_of_text):
    """(tokenizer, vocab, merges) of a GPT-2-style BPE, `<|endoftext|>` after the ranks if the corpus counts it."""
    tk = tokenizers_module("exporting a GPT-2 BPE corpus's tokenizer")
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = byte_level(tk, vocab, merges, split_words=True)
    if with_end_of_text:
        tokenizer.add_special_tokens([tk.AddedToken(END_OF_TEXT, special=True)])
    return tokenizer, vocab, merges


def read_ranks(path):
    """tiktoken's rank file format: one `base64(token) rank` line per token."""
    with open(path, "rb") as f:
        return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}


def write_ranks(path, ranks):
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)


def gpt2_encoding():
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network: tiktoken downloads its BPE file on first use
        raise ValueError(f"tiktoken could not load the GPT-2 BPE file ({type(e).__name__}: {e}); it is "
                         f"downloaded on first use: without internet use --tokenizer byte") from None


def write_tokenizer_files(tokenizer, path_of):
    """The tokenizer goes with the corpus (its samples decode with it, python -m common.hf export carries it): a
    gpt2 corpus keeps GPT-2's BPE ranks (gpt2.tiktoken), a Hugging Face one its tokenizer files. Each file is
    written where path_of(its name) says: a dataset's writer stages it there and renames it into place with the
    corpus (data.write_dataset), so the ids of one tokenizer never sit beside another's files."""
    if tokenizer == "gpt2":
        write_ranks(path_of(RANKS_FILE), gpt2_encoding()._mergeable_ranks)   # token bytes -> id
    elif tokenizer != "byte":
        copy_tokenizer(tokenizer, path_of)


def gpt2_ranks(data_dir):
    """The corpus's own BPE ranks (data_dir/gpt2.tiktoken), else GPT-2's from tiktoken (its cache, or the network)."""
    path = os.path.join(data_dir, RANKS_FILE)
    if os.path.isfile(path):
        return read_ranks(path)
    tiktoken = require("tiktoken", "a GPT-2 BPE corpus without its gpt2.tiktoken file", "tiktoken==0.14.0")
    try:
        return tiktoken.get_encoding("gpt2")._mergeable_ranks     # (tiktoken keeps them in this attribute only)
    except Exception as e:      # no network and no cached file: tiktoken raises several kinds
        raise ValueError(f"{data_dir} has no {RANKS_FILE} and tiktoken cannot load GPT-2's BPE file offline "
                         f"({type(e).__name__}); copy a gpt2.tiktoken into {data_dir}") from None


# ----------------------------------------------------------------------------------------------------------
# the files of an export

def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)


def export_tokenizer(meta, data_dir, hf_dir, block_size):
    """Write the corpus's tokenizer into hf_dir; returns (what it is, {"bos": id, "eos": id} for config.json).
    ValueError for a corpus whose tokenizer has no Hugging Face form here."""
    kind, vocab_size = meta.get("tokenizer"), meta["vocab_size"]
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=block_size,
                  clean_up_tokenization_spaces=False)
    if kind == "hf":
        copy_tokenizer(data_dir, lambda name: os.path.join(hf_dir, name))
        return f"the corpus's tokenizer.json ({meta.get('tokenizer_from', data_dir)})", {}
    if kind == "byte":
        byte_tokenizer().save(os.path.join(hf_dir, "tokenizer.json"))
        write_json(os.path.join(hf_dir, "tokenizer_config.json"), config)
        return "bytes (ids 0..255)", {}
    if kind != "gpt2":
        raise ValueError(f"the corpus's tokenizer {kind!r} is none of {', '.join(KINDS)}")
    ranks = gpt2_ranks(data_dir)
    if vocab_size not in (len(ranks), len(ranks) + 1):
        raise ValueError(f"the corpus's vocab_size {vocab_size} is not its {len(ranks)} BPE ranks (+ {END_OF_TEXT})")
    tokenizer, vocab, merges = gpt2_tokenizer(ranks, with_end_of_text=vocab_size == len(ranks) + 1)
    tokenizer.save(os.path.join(hf_dir, "tokenizer.json"))
    write_json(os.path.join(hf_dir, "vocab.json"), vocab)
    with open(os.path.join(hf_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    if vocab_size == len(ranks):
        write_json(os.path.join(hf_dir, "tokenizer_config.json"), config)
        return f"GPT-2 BPE, {len(ranks)} tokens", {}
    special = {f"{role}_token": END_OF_TEXT for role in ("bos", "eos", "unk")}
    write_json(os.path.join(hf_dir, "tokenizer_config.json"), config | special)
    return f"GPT-2 BPE, {len(ranks)} tokens + {END_OF_TEXT}", dict(bos=len(ranks), eos=len(ranks))


# ----------------------------------------------------------------------------------------------------------
# corpus preparation with a Hugging Face tokenizer

def hf_tokenizer(directory):
    """The tokenizers.Tokenizer of directory/tokenizer.json; ValueError naming what is missing."""
    tk = tokenizers_module("--tokenizer HF_DIR")
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer {directory}: no tokenizer.json there (expected byte, gpt2, or a directory "
                         f"holding a Hugging Face tokenizer.json)")
    try:
        return tk.Tokenizer.from_file(path)
    except Exception as e:      # the Rust parser's error, whatever it is
        raise ValueError(f"--tokenizer {directory}: {path} is not a tokenizer.json tokenizers can read ({e})") from None


def encode_with(directory, text_bytes):
    """(ids, vocab size incl. added tokens) of the text, as AutoTokenizer(directory)(text,
    add_special_tokens=False) gives them: a corpus is one stream, no BOS/EOS inserted per file."""
    tokenizer = hf_tokenizer(directory)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > 2 ** 16:
        raise ValueError(f"--tokenizer {directory}: {vocab} tokens do not fit the corpus's uint16 ids (at most 65536)")
    ids = tokenizer.encode(text_bytes.decode("utf-8", errors="replace"), add_special_tokens=False).ids
    return ids, vocab


def copy_tokenizer(directory, path_of):
    """The tokenizer files go with the corpus: samples decode with them and an export carries them. Each file
    found in directory is copied to path_of(its name)."""
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), path_of(name))


def decode_with(data_dir, ids):
    return hf_tokenizer(data_dir).decode(ids, skip_special_tokens=False)
