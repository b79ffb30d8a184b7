"""
hf.py: a run's model out to a Hugging Face checkpoint, and a Hugging Face checkpoint in as a run's first weights
(docs/huggingface.md). Names, permutations and the config are common/hf/convert.py's (GPT-NeoX, model.py's GPT) or
common/hf/llama.py's (Llama, Qwen2, Mixtral: the --arch family); tokenizer files common/hf/tokenizer.py's.
transformers is never imported: files are read with safetensors (and written by hand, below).

    python -m common.hf export OUT_DIR HF_DIR [--dtype float32] [--data_dir DIR] [--no_tokenizer]
    python train_X.py ... --init_from HF_DIR                       (every train script, any layout)

Export: OUT_DIR's latest checkpoint (any layout saves train_single's form) is memory-mapped and written to
HF_DIR/config.json + model.safetensors (+ the corpus's tokenizer), in the checkpoint's dtype or --dtype.
safetensors' format is a JSON header of every tensor's dtype, shape and byte range, then the bytes: the header
needs only shapes, so the file is written one converted tensor at a time, never the whole model in memory.

Import: --init_from is checked against the run's flags when the command line is parsed (one line naming the
field and its value for a model model.py cannot represent, hf/convert.architecture_problem); then each rank reads
exactly the tensors it holds, as a --resume does (checkpoint.start_from -> held.restore: TP slices, pipeline
stages, ZeRO shards), memory-mapped, converted one at a time. AdamW starts fresh, the step at 0.
"""
import argparse
import json
import math
import os
import re
import struct
import sys
from dataclasses import asdict

import torch

from common.checkpoint.compat import saved_model_config
from common.checkpoint.files import latest_checkpoint, load_checkpoint, write_directory_atomically
from common.data import read_meta
from common.distributed import fail_together
from common.errors import ConfigError, check, fail, report_interrupts, require
from common.hf import convert, llama
from common.hf.convert import WTE, architecture_problem, shape_problem
from common.hf.tokenizer import KINDS, TOKENIZER_FILES, export_tokenizer, tokenizers_module
from common.model_setup import gpt_config
from model import GPT, GPTConfig

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def family_of(mc):
    """The module that converts a model config: llama.py for the Llama family (RMSNorm, SwiGLU), convert.py's
    GPT-NeoX for model.py's GPT."""
    return llama if mc.get("norm") == "rmsnorm" or mc.get("mlp") == "swiglu" else convert


def hf_entries(fam, mc, names):
    """[(transformers name, shape)] of model.py's parameters `names` [(name, shape)], from meta tensors."""
    return [(twin, tuple(t.shape)) for name, shape in names
            for twin, t in fam.to_hf_pieces(name, torch.empty(shape, device="meta"), mc)]


def parameter_names(gcfg):
    """model.py's parameters in their order, each once (the tied lm_head is the embedding)."""
    with torch.device("meta"):
        return [(name, tuple(p.shape)) for name, p in GPT(gcfg).named_parameters()]


# ----------------------------------------------------------------------------------------------------------
# export

def write_safetensors(path, entries, dtype, tensors):
    """Write `tensors` (an iterator of (name, tensor) in the order of `entries`: (name, shape)) to path in
    safetensors' format: 8 bytes of header length (little-endian), the JSON header padded to 8 bytes, the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = dict(dtype=SAFETENSORS_DTYPES[dtype], shape=list(shape), data_offsets=[offset, offset + size])
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:                      # (into the export's fresh directory: write_directory_atomically)
        f.write(struct.pack("<Q", len(text)) + text)
        for (name, shape), (written, tensor) in zip(entries, tensors, strict=True):
            assert written == name and tuple(tensor.shape) == shape, (written, name)
            f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy())


def generation_config(config):
    """generation_config.json: the padded ids are never generated (model.py's sampling leaves them out too), while
    their logits stay in the softmax, which model.py's loss and an evaluation's log-likelihoods include."""
    padded = list(range(config["tokenizer_vocab_size"], config["vocab_size"]))
    return dict(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"],
                **({"suppress_tokens": padded} if padded else {}))


def export_args(argv):
    p = argparse.ArgumentParser(prog="python -m common.hf", allow_abbrev=False,
                                description="Export a run's latest checkpoint as a Hugging Face GPTNeoXForCausalLM "
                                            "(model.py's GPT) or LlamaForCausalLM, Qwen2ForCausalLM, "
                                            "MixtralForCausalLM (the Llama family, --arch).")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", allow_abbrev=False, help="OUT_DIR's latest checkpoint -> HF_DIR")
    e.add_argument("out_dir", metavar="OUT_DIR", help="the run's --out_dir (its ckpt/ holds the checkpoints)")
    e.add_argument("hf_dir", metavar="HF_DIR", help="where config.json, model.safetensors and the tokenizer go")
    e.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the weights' dtype (default: the checkpoint's, float32 or float64)")
    e.add_argument("--data_dir", default=None, help="the corpus whose tokenizer goes along (default: the run's)")
    e.add_argument("--no_tokenizer", action="store_true", help="export the weights and config.json only")
    return p.parse_args(argv)


def export_checks(args):
    """(checkpoint state, its model config, the corpus's meta and directory or None): every check of an export,
    before anything is written."""
    path = latest_checkpoint(args.out_dir)
    check(path is not None, f"{args.out_dir}: no checkpoint there (no complete step directory in its ckpt/)")
    try:
        state = load_checkpoint(path, mmap=True)     # every tensor stays on disk until it is written
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e).removeprefix("--resume: ")) from None
    mc = saved_model_config(state)
    fam = family_of(mc)
    problem = fam.export_problem(mc)
    check(problem is None, f"{path}: {problem[0]} {json.dumps(problem[1])}: {fam.class_name(mc)} cannot hold it "
                           f"({problem[2]})" if problem else "")
    names = parameter_names(GPTConfig(**mc))
    missing = [name for name, _ in names if name not in state["model"]]
    check(not missing, f"{path} lacks {missing[0] if missing else ''} (a damaged checkpoint)")
    check_fits_dtype(path, state["model"], names, export_dtype(args, state["model"]))
    if args.no_tokenizer:
        return state, mc, None, None
    corpus = state.get("corpus") or [dict(path=(state.get("config") or {}).get("data_dir"))]   # older: config's
    data_dir = args.data_dir or corpus[0]["path"]       # a mixture's sources share one tokenizer (data_mix.py)
    check(data_dir is not None and os.path.isdir(data_dir),
          f"the run's corpus {data_dir} is not here (its tokenizer goes with the model): pass --data_dir DIR where "
          f"its meta.json is, or --no_tokenizer")
    try:
        meta, meta_path = read_meta(data_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check(meta["vocab_size"] == mc["vocab_size"], f"{meta_path} says vocab_size {meta['vocab_size']} but the "
                                                  f"checkpoint's model has {mc['vocab_size']}: another corpus")
    check(meta.get("tokenizer") in KINDS, f"{meta_path}: tokenizer {meta.get('tokenizer')!r} has no Hugging Face "
                                          f"form here ({', '.join(KINDS)} do): pass --no_tokenizer")
    if meta.get("tokenizer") in ("byte", "gpt2"):
        tokenizers_module(f"exporting a {meta['tokenizer']} corpus's tokenizer (or pass --no_tokenizer)")
    return state, mc, meta, data_dir


def export_kept(hf_dir, target):
    """What a Ctrl-C during an export leaves in HF_DIR, in words: as it was, until the new export takes its place."""
    from common.checkpoint.files import kept_words
    return kept_words(target, f"{hf_dir} holds the new export",
                      f"{hf_dir} is as it was (an export is renamed into place only once whole)")


def export_dtype(args, weights):
    return DTYPES[args.dtype] if args.dtype else weights[WTE].dtype


def check_fits_dtype(path, weights, names, dtype):
    """A narrower dtype than the checkpoint's turns values beyond its range into inf: refused, naming the first
    tensor that holds one (float16's largest is 65504)."""
    for name, _ in names:
        value = weights[name]
        if torch.finfo(dtype).max < torch.finfo(value.dtype).max:
            largest = float(value.abs().max())
            check(largest <= torch.finfo(dtype).max,
                  f"{path}: {name} holds {largest:g}, beyond {str(dtype).removeprefix('torch.')}'s largest "
                  f"{torch.finfo(dtype).max:g}: exported so it would be inf (export with --dtype float32 or bfloat16)")


EXPORT_FILES = {WEIGHTS, "config.json", "generation_config.json", "vocab.json", "merges.txt", *TOKENIZER_FILES}


def export_target(hf_dir):
    """The directory an export replaces as a whole (write_directory_atomically): HF_DIR, or the directory it is a
    symbolic link to. ConfigError for a dangling link, a path that is not a directory, or a directory holding a file
    an export does not write (replacing it would delete that file)."""
    target = os.path.realpath(hf_dir)
    link = f" (a symbolic link to {target})" if os.path.islink(hf_dir) else ""
    check(not os.path.lexists(hf_dir) or os.path.exists(hf_dir),
          f"HF_DIR {hf_dir} is a symbolic link to {os.readlink(hf_dir) if os.path.islink(hf_dir) else ''}, which does "
          f"not exist (remove the link, or create its directory)")
    check(not os.path.isfile(target), f"HF_DIR {hf_dir}{link} is a file, not a directory")
    check(not os.path.exists(target) or os.path.isdir(target), f"HF_DIR {hf_dir}{link} is not a directory")
    foreign = sorted(set(os.listdir(target)) - EXPORT_FILES) if os.path.isdir(target) else []
    check(not foreign, f"HF_DIR {hf_dir}{link} holds {foreign[0] if foreign else ''}, which an export does not write: "
                       f"an export replaces the whole directory, so give a new or empty one, or an earlier export")
    return target


def write_export(directory, state, mc, meta, data_dir, dtype):
    """config.json, generation_config.json, model.safetensors and the tokenizer's files into `directory`; returns
    (config, what the tokenizer is)."""
    special, tokenizer = {}, "none (--no_tokenizer)"
    if meta is not None:
        tokenizer, special = export_tokenizer(meta, data_dir, directory, mc["block_size"])
    weights, names, fam = state["model"], parameter_names(GPTConfig(**mc)), family_of(mc)
    converted = (piece for name, _ in names for piece in fam.to_hf_pieces(name, weights[name], mc))
    write_safetensors(os.path.join(directory, WEIGHTS), hf_entries(fam, mc, names), dtype, converted)
    config = fam.hf_config(mc, str(dtype).removeprefix("torch."), mc["vocab_size"], special)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation_config(config), f, indent=1)
    return config, tokenizer


def main(argv=None):
    args = export_args(argv)
    try:
        state, mc, meta, data_dir = export_checks(args)
        target = export_target(args.hf_dir)
    except (ValueError, OSError) as e:              # ConfigError is a ValueError
        fail(str(e))
    dtype = export_dtype(args, state["model"])
    report_interrupts(kept=export_kept(args.hf_dir, target))
    try:                    # all of it, or nothing: a full disk or a kill leaves HF_DIR's earlier export as it was
        config, tokenizer = write_directory_atomically(target, lambda d: write_export(d, state, mc, meta, data_dir,
                                                                                      dtype))
    except ValueError as e:                         # a tokenizer that cannot be written (export_tokenizer)
        fail(str(e))
    except OSError as e:
        fail(f"cannot write the export to {args.hf_dir} ({e.strerror or e}); what was there is kept as it was")
    dtype_name = str(dtype).removeprefix("torch.")
    names, fam = parameter_names(GPTConfig(**mc)), family_of(mc)
    padding = f", padded to {config['vocab_size']} rows" if config["vocab_size"] != mc["vocab_size"] else ""
    print(f"exported step {state['step']} of {args.out_dir} to {args.hf_dir}: {fam.class_name(mc)}, "
          f"{sum(math.prod(s) for _, s in names):,} parameters in {dtype_name}, vocabulary {mc['vocab_size']}"
          f"{padding}; tokenizer: {tokenizer}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# import (--init_from)

def read_config(hf_dir):
    """HF_DIR/config.json as a dict; ConfigError naming what is wrong."""
    path = os.path.join(hf_dir, "config.json")
    check(os.path.isdir(hf_dir), f"--init_from {hf_dir}: not a directory")
    check(os.path.isfile(path), f"--init_from {hf_dir}: no config.json there (a Hugging Face model directory has one)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--init_from {path}: not a readable JSON file ({e})") from None
    check(isinstance(hf, dict), f"--init_from {path}: not a JSON object")
    return hf


def weight_files(hf_dir):
    """{NeoX name: safetensors file} of HF_DIR: model.safetensors, or the files its index names."""
    single, index = os.path.join(hf_dir, WEIGHTS), os.path.join(hf_dir, INDEX)
    if os.path.isfile(single):
        safetensors = require("safetensors", "--init_from", "safetensors==0.8.0")
        try:
            with safetensors.safe_open(single, "pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:      # safetensors' own error for a damaged file, or an OSError
            raise ConfigError(f"--init_from {single}: not a readable safetensors file ({e})") from None
    check(os.path.isfile(index), f"--init_from {hf_dir}: no {WEIGHTS} or {INDEX} (only safetensors weights are "
                                 f"read: pickled .bin files can run code)")
    try:
        with open(index) as f:
            return {name: os.path.join(hf_dir, file) for name, file in json.load(f)["weight_map"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--init_from {index}: not a safetensors index ({type(e).__name__}: {e})") from None


def check_init_from(cfg):
    """What config.json and the flags decide, when the command line is parsed: ConfigError naming the first field
    model.py cannot represent, or a model shape that differs from the run's flags."""
    require("safetensors", "--init_from", "safetensors==0.8.0")
    hf = read_config(cfg.init_from)
    kind = hf.get("model_type")
    in_family = kind in llama.FAMILY
    problem = llama.architecture_problem(hf) if in_family else architecture_problem(hf, cfg.rope_base)
    if problem is not None:
        field, value, why = problem
        raise ConfigError(f"--init_from {cfg.init_from}: {field} {json.dumps(value)} in its config.json cannot be "
                          f"represented by model.py ({why})")
    if in_family:
        check(cfg.arch == kind, f"--init_from {cfg.init_from}: model_type {json.dumps(kind)} in its config.json vs "
                                f"--arch {cfg.arch} in this run (give --arch {kind})")
    else:
        check(cfg.n_experts == 0, f"--n_experts {cfg.n_experts}: --init_from {cfg.init_from} is a dense GPT-NeoX "
                                  f"model (no experts to start them from)")
        check(cfg.arch == "gpt", f"--arch {cfg.arch}: --init_from {cfg.init_from} is a GPT-NeoX model (--arch gpt)")
    shape = shape_problem(hf, cfg) or (family_problem(hf, cfg) if in_family else None)
    if shape is not None:
        field, value, flag, mine = shape
        raise ConfigError(f"--init_from {cfg.init_from}: {field} {json.dumps(value)} in its config.json vs --{flag} "
                          f"{mine} in this run (the model's shape comes from the flags and must match)")
    unused = unused_tensors(weight_files(cfg.init_from), gpt_config(cfg, 0))
    check(not unused, f"--init_from {cfg.init_from}: its weights hold {unused[0] if unused else ''}"
                      f"{f' and {len(unused) - 1} more' if len(unused) > 1 else ''}, which this run's model has no "
                      f"place for (a layer past --n_layer, an output head of its own while the model ties it to the "
                      f"embedding, ...): every tensor is used or the import is refused, as dropping one changes the "
                      f"model")


# Buffers that older transformers versions saved beside the weights and every version computes again at load
RECOMPUTED = re.compile(r".*\.(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)")


def unused_tensors(files, gcfg):
    """The tensors of an --init_from directory (`files`: weight_files') that no parameter of model.py's `gcfg`
    takes, sorted; buffers that transformers recomputes (RECOMPUTED) aside."""
    mc = asdict(gcfg)
    used = {twin for twin, _ in hf_entries(family_of(mc), mc, parameter_names(gcfg))}
    return sorted(name for name in files if name not in used and not RECOMPUTED.fullmatch(name))


def family_problem(hf, cfg):
    """(config.json field, its value, the run's flag, the flag's value) of the first Llama-family field of the
    run's model that differs from config.json's."""
    gcfg = gpt_config(cfg, 0)
    for field, (value, source) in llama.model_fields(hf).items():
        mine = {"n_kv_head": gcfg.kv_heads, "ffn_hidden": gcfg.ffn}.get(field, getattr(gcfg, field))
        if mine != value:
            flag = "arch" if field in ("qkv_bias", "bias") else field
            return source, value, flag, getattr(cfg, flag)
    return None


class HFWeights:
    """The weights of HF_DIR as checkpoint.py's `saved` mapping: saved[name] -> (model.py's whole value, no AdamW
    moments), read from the memory-mapped file and converted when a rank asks for it. Buffers keep their values."""

    def __init__(self, hf_dir, gcfg, held):
        self.files, self.gcfg, self.mc = weight_files(hf_dir), gcfg, asdict(gcfg)
        self.family = family_of(self.mc)
        self.hf_dir, self.open = hf_dir, {}
        self.buffers = {name: b for m in held.modules for name, b in m.named_buffers()}

    def handle(self, name):
        path = self.files[name]
        if path not in self.open:
            self.open[path] = require("safetensors", "--init_from").safe_open(path, "pt")
        return self.open[path]

    def __getitem__(self, name):
        if name in self.buffers:
            return self.buffers[name], None
        twins = self.family.hf_names(name, self.mc)
        return self.family.from_hf_pieces(name, [self.handle(t).get_tensor(t) for t in twins], self.mc), None

    def problem(self, shapes):
        """Why this rank cannot take its part (None if it can): a tensor it holds missing or shaped otherwise."""
        for twin, shape, name in [(t, s, name) for name, shape in shapes if name not in self.buffers
                                  for (t, s) in hf_entries(self.family, self.mc, [(name, shape)])]:
            if twin not in self.files:
                return f"--init_from {self.hf_dir}: its weights lack {twin} (model.py's {name})"
            found = tuple(self.handle(twin).get_slice(twin).get_shape())
            if name == WTE and found != shape:
                return (f"--init_from {self.hf_dir}: vocab_size {found[0]} in its weights, but this run's embedding "
                        f"has {shape[0]} rows (the corpus's vocab_size {self.gcfg.vocab_size}, which model.py pads to "
                        f"a multiple of 64): prepare the corpus with its tokenizer (python -m common.data --input "
                        f"FILES --tokenizer {self.hf_dir})")
            if found != shape:
                return f"--init_from {self.hf_dir}: {twin} has shape {found}, model.py's {name} {shape}"
            value = self.handle(twin).get_tensor(twin)
            if value.is_floating_point() and not torch.isfinite(value).all():
                return (f"--init_from {self.hf_dir}: {twin} (model.py's {name}) holds inf/NaN: these weights cannot "
                        f"start a run")
        return None


def init_from(cfg, env, gcfg, held):
    """Every rank keeps its part of HF_DIR's weights (what a resume would give it), or all stop with one line."""
    error, weights = None, None
    try:
        weights = HFWeights(cfg.init_from, gcfg, held)
        error = weights.problem(held.shapes())
    except (ValueError, OSError) as e:
        error = str(e)
    except Exception as e:                          # a damaged shard: safetensors raises its own error type
        error = f"--init_from {cfg.init_from}: cannot read its weights ({type(e).__name__}: {e})"
    fail_together(error, env)
    held.restore(weights)
    if env.rank == 0:
        print(f"init_from: weights of {cfg.init_from} ({weights.family.class_name(weights.mc)}), AdamW fresh, step 0",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
