"""
evaluation.py: the validation loss every loop logs, and the end-of-run sample (generate, then decode with the corpus's
tokenizer): the eyeball test that training worked.
"""
import torch

from common.data_mix import MixtureLoader, source_val_losses
from common.errors import fail

class ValLoss(float):
    """A validation loss; by_source: under --data_mix, each source's own ({} otherwise), for metrics.jsonl."""
    by_source = {}


@torch.no_grad()
def evaluate(loss_fn, loader, cfg):
    """Mean validation loss over eval_iters fixed micro-batches; loss_fn(x, y) -> scalar loss. With a mixture, also
    each source's (its val split alone), so that every rank runs the same forwards (a collective loss_fn)."""
    losses = [float(loss_fn(*loader.micro_batch(i, 0, cfg.micro_batch_size, split="val")))
              for i in range(cfg.eval_iters)]
    val = ValLoss(sum(losses) / len(losses))
    if isinstance(loader, MixtureLoader):
        val.by_source = source_val_losses(loss_fn, loader, cfg)
    return val


def decode(tokens, meta, data_dir=None):
    """Token ids -> text: GPT-2 BPE (the corpus's gpt2.tiktoken, else tiktoken's), raw bytes, a character table
    `itos` (nanoGPT's character-level meta.pkl, or a list in meta.json), or the corpus's Hugging Face
    tokenizer.json. An id the tokenizer lacks (the model's vocabulary is padded) decodes as U+FFFD or nothing. Any
    other tokenizer, or one whose files are missing here: ValueError."""
    if meta.get("tokenizer") == "hf":
        from common.hf.tokenizer import decode_with
        return decode_with(data_dir, tokens)
    if meta.get("tokenizer") == "gpt2":
        from common.hf.tokenizer import END_OF_TEXT, gpt2_ranks
        pieces = {rank: piece for piece, rank in gpt2_ranks(data_dir or ".").items()}
        pieces[len(pieces)] = END_OF_TEXT.encode()      # GPT-2's one special token, the id after its ranks
        return b"".join(pieces.get(t, b"\xef\xbf\xbd") for t in tokens).decode("utf-8", errors="replace")
    if "itos" in meta:
        itos = meta["itos"]
        table = dict(enumerate(itos)) if isinstance(itos, list) else {int(k): v for k, v in itos.items()}
        return "".join(table.get(t, "\ufffd") for t in tokens)
    if meta.get("tokenizer") == "byte":
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    raise ValueError(f"the dataset's tokenizer {meta.get('tokenizer')!r} is unknown here; meta.json needs "
                     f"tokenizer byte, gpt2 or hf, or an itos list (the text of each token id)")


def tokenizer_dir(loader):
    """Where the run's tokenizer files are: its corpus, or a mixture's first source (the sources share one
    tokenizer: data_mix.check_tokenizers_agree)."""
    return loader.names[0] if isinstance(loader, MixtureLoader) else loader.data_dir


def sample_problem(cfg, loader):
    """Why this run's end-of-run sample could not be decoded (its tokenizer unknown, or its files missing here),
    found before the first step (startup.prepare_data); None if it can, or if no sample is asked for."""
    if cfg.sample_tokens <= 0:
        return None
    try:
        decode(loader.micro_batch(0, 0, 1, split="val")[0][0, :8].tolist(), loader.meta, tokenizer_dir(loader))
    except ValueError as e:
        return f"the end-of-run sample cannot be decoded ({e}); fix the corpus or pass --sample_tokens 0"
    return None


def print_sample(model, loader, cfg, env, collective=False):
    """Generate a short continuation of a validation snippet: the eyeball test that training worked, printed by
    rank 0. collective: every rank generates too (a sharded model's forward is collective: TP, EP, ZeRO-3), with
    the same seed and prompt, hence the same tokens. The decoder was checked before the first step
    (sample_problem), so a failure here is an error line and exit code 2, never a sample that says so."""
    if cfg.sample_tokens <= 0 or (env.rank != 0 and not collective):
        return
    model.eval()
    prompt, _ = loader.micro_batch(0, 0, 1, split="val")
    prompt = prompt[:, : min(32, cfg.block_size)]
    torch.manual_seed(cfg.seed)
    out = model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50)
    if env.rank != 0:
        return
    try:
        text = decode(out[0].tolist(), loader.meta, tokenizer_dir(loader))
    except ValueError as e:
        fail(f"the end-of-run sample cannot be decoded ({e})", rank_local=True)
    print(f"---- sample ----\n{text}\n----------------", flush=True)
