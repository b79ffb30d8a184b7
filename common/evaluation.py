"""
evaluation.py: the validation loss every loop logs, and the end-of-run sample (generate, then decode with the corpus's
tokenizer): the eyeball test that training worked.
"""
import torch

from common.data_mix import MixtureLoader, source_val_losses

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
    """Token ids -> text: GPT-2 BPE, raw bytes, a character table `itos` (nanoGPT's character-level meta.pkl, or
    a list in meta.json), or the corpus's Hugging Face tokenizer.json. Any other tokenizer has no decoder here:
    ValueError, and the sample says so."""
    if meta.get("tokenizer") == "hf":
        from common.hf.tokenizer import decode_with
        return decode_with(data_dir, tokens)
    if meta.get("tokenizer") == "gpt2":
        import tiktoken
        return tiktoken.get_encoding("gpt2").decode(tokens)
    if "itos" in meta:
        itos = meta["itos"]
        table = dict(enumerate(itos)) if isinstance(itos, list) else {int(k): v for k, v in itos.items()}
        return "".join(table.get(t, "\ufffd") for t in tokens)
    if meta.get("tokenizer") == "byte":
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    raise ValueError(f"the dataset's tokenizer {meta.get('tokenizer')!r} is unknown here; meta.json needs "
                     f"tokenizer byte, gpt2 or hf, or an itos list (the text of each token id)")


def print_sample(model, loader, cfg, env, collective=False):
    """Generate a short continuation of a validation snippet: the eyeball test that training worked, printed by
    rank 0. collective: every rank generates too (a sharded model's forward is collective: TP, EP, ZeRO-3), with
    the same seed and prompt, hence the same tokens."""
    if cfg.sample_tokens <= 0 or (env.rank != 0 and not collective):
        return
    model.eval()
    prompt, _ = loader.micro_batch(0, 0, 1, split="val")
    prompt = prompt[:, : min(32, cfg.block_size)]
    torch.manual_seed(cfg.seed)
    out = model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=50)
    try:
        text = decode(out[0].tolist(), loader.meta, loader.data_dir)
    except Exception as e:  # e.g. tiktoken cannot fetch its vocabulary offline
        text = f"<cannot decode: {e}>"
    if env.rank == 0:
        print(f"---- sample ----\n{text}\n----------------", flush=True)
