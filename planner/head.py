"""
planner/head.py: what the LM head and the loss hold on the last pipeline stage, per micro-batch, as each stack's own
loss code allocates it, for planner/memory.py. Formulas only; each loss names the code it was read from.

    saved      kept from the loss's forward until its backward (x the head micro-batches in flight: memory.py)
    transient  the larger of the loss's forward peak and its backward peak beyond `saved`, with every
               activation still alive (memory.other_bytes): once per rank

Per logit (L = s/cp x b x V/t logits of one micro-batch, bpv = the logits' bytes, up = 4 where a 16-bit logit is
upcast to fp32 and 0 where it already is fp32, held = bpv where the training loop keeps the logits, job.logits_held):

    loss (--loss)     source (inputs.LOSS_NAMES)                                                     saved  forward       backward
    cross_entropy     F.cross_entropy(logits.float()): model.LMHead, torchtitan  4      bpv + up      8 + held
    loss_parallel     torch's DTensor loss_parallel (torchtitan under TP)         4      bpv + up      12 + held
    vocab_parallel    common/tp_grads.VocabParallelCrossEntropy (train_tp/5d)     4      bpv + up + 8  8 + held
    megatron          Megatron's _VocabParallelCrossEntropy, fused or not         4      bpv           up/2 + held
    nanotron          nanotron's _ShardedCrossEntropy (dtype=torch.float)          4      bpv + up      up/2 + held
    fused             one kernel on the 16-bit logits (flash-attn, a compiled     bpv    0             bpv + held
                      loss); + 4 bytes of log-sum-exp per token saved
    linear_ce         kernels/linear_cross_entropy (the fused chunked head): no logits kept, see fused_head_bytes

How each was read:
- cross_entropy: log_softmax saves its fp32 output; nll_loss's backward returns a dense fp32 gradient of it and
  log_softmax's backward its own fp32 output (aten nll_loss_backward, _log_softmax_backward_data): 8 bytes beside the
  saved 4. The forward holds the 16-bit logits, their fp32 copy and the log-softmax at once.
- loss_parallel: torch/distributed/tensor/parallel/loss.py, _nll_loss_and_log_softmax_backward: zeros_like(x), then
  (grad_input + exp(x)) * grad_output, fp32, alive together beside the saved log-softmax (measured:
  tests/test_plan_memory.py).
- vocab_parallel: the forward makes the fp32 copy, z = logits - max, exp(z) and exp / sum (saved) out of place, all
  alive at the save; the backward's scatter_add and its scaling are two new fp32 tensors.
- megatron (megatron/core/tensor_parallel/cross_entropy.py): .float() is the one copy; the max is subtracted, exp
  taken and the softmax normalised in place on it, which is saved; the backward writes the gradient in place into
  the saved softmax, and .float()'s backward casts it to the logits' dtype (bpv = up/2 bytes).
- nanotron (src/nanotron/parallel/tensor_parallel/functional.py, sharded_cross_entropy): the cast to fp32, then
  `sharded_logits - logits_max` out of place (which becomes the saved softmax in place): one fp32 copy more than
  Megatron's in the forward; the backward in place as Megatron's.
- fused: flash-attn's losses/cross_entropy.py saves the logits and their log-sum-exp and writes the gradient in the
  logits' dtype; torch.compile's min-cut partitioner does the same with a compiled loss (torchtitan's
  build_cross_entropy_loss compiles it).

Chunking (--loss_chunks k, a chunked loss such as torchtune's CEWithChunkedOutputLoss): each chunk's loss runs alone
on 1/k of the logits, so the per-logit working set beyond the logits themselves (forward and backward) is 1/k;
what each chunk saves stays for all. The fused head chunks the head's matmul itself (fused_head_bytes).
"""
from kernels.linear_cross_entropy import default_chunk
from planner.inputs import PRECISION

# The fused head's [chunk, V] buffers alive at once: the Triton row kernel turns the chunk's logits into their
# gradient in place (1); the torch reference it runs on CPU (ce_grad_reference) makes exp(z - lse) and then its
# scatter_add and its scaled copy out of place, two fp32 chunks beside z (3).
CHUNK_BUFFERS = dict(triton=1, torch=3)


def loss_of(job, lay):
    """The loss a job runs on a layout: job.loss where given; else the old flags' (fused_loss, inplace_loss,
    loss_parallel with tp > 1), else F.cross_entropy. 'nanoscale' is this project's own head: model.LMHead at tp 1,
    train_tp's vocab-parallel loss with tp > 1."""
    if job.loss == "nanoscale":
        return "vocab_parallel" if lay.tp > 1 else "cross_entropy"
    if job.loss:
        return job.loss
    if job.fused_loss:
        return "fused"
    if job.inplace_loss:
        return "megatron"
    return "loss_parallel" if job.loss_parallel and lay.tp > 1 else "cross_entropy"


def logits_per_micro_batch(job, lay):
    """Logits one rank computes per micro-batch: s/cp tokens x b sequences x V/t vocabulary columns (the LM head's
    input is all-gathered over tp under SP, so every rank holds the whole sequence's slice of the vocabulary)."""
    cfg = job.cfg
    return cfg.block_size // lay.cp * lay.micro_batch_size * cfg.padded_vocab_size / lay.tp


def per_logit(loss, bpv, held):
    """(saved, forward, backward) bytes per logit of a loss (the table above); forward and backward beyond saved, the
    logits themselves in forward, `held` (bpv or 0) in backward."""
    up = 4 if bpv < 4 else 0
    if loss == "fused":
        return bpv, 0, bpv + held
    forward = dict(vocab_parallel=bpv + up + 8, megatron=bpv).get(loss, bpv + up)
    backward = dict(cross_entropy=8, loss_parallel=12, vocab_parallel=8).get(loss, up / 2)
    return 4, forward, backward + held


def loss_saved_bytes(job, lay):
    """What the loss keeps from its forward to its backward for one micro-batch (the fused head: fused_head_bytes'
    saved; the fused loss: + its fp32 log-sum-exp per token)."""
    if loss_of(job, lay) == "linear_ce":
        return fused_head_bytes(job, lay)[0]
    bpv = PRECISION[job.precision][1]
    saved = per_logit(loss_of(job, lay), bpv, 0)[0] * logits_per_micro_batch(job, lay)
    tokens = job.cfg.block_size // lay.cp * lay.micro_batch_size
    return saved + (4 * tokens if loss_of(job, lay) == "fused" else 0)


def loss_transient_bytes(job, lay):
    """The larger of the loss's forward and backward peaks beyond what it saves, for one micro-batch: per_logit's
    terms over logits_per_micro_batch, the working sets (all but the logits themselves) / job.loss_chunks."""
    loss = loss_of(job, lay)
    if loss == "linear_ce":
        return fused_head_bytes(job, lay)[1]
    bpv = PRECISION[job.precision][1]
    held = bpv if job.logits_held else 0
    _, forward, backward = per_logit(loss, bpv, held)
    k = job.loss_chunks
    forward = bpv + (forward - bpv) / k if loss != "fused" else forward
    backward = held + (backward - held) / k
    return max(forward, backward) * logits_per_micro_batch(job, lay)


def fused_head_bytes(job, lay, backend="triton"):
    """(saved, transient) of kernels/linear_cross_entropy's head for one micro-batch of N = s/cp x b tokens, C = h,
    V = the padded vocabulary (tp 1: the fused head needs the whole vocabulary; kernels/apply.py), logits in bpv
    bytes (LinearCrossEntropyFunction's forward and _chunk_pass):
        saved      dh (N x C) and dW in the weight's dtype (V x C), bpv each: the backward only scales them
        transient  under amp, autocast's 16-bit copies of h (ln_f's output is fp32 under autocast) and of the tied
                   fp32 weight, and dW's fp32 accumulator beside its 16-bit cast, with each chunk's (V x C) dW term
                   and its fp32 copy made before the add (with fp32 logits the accumulator is the saved dW, the
                   term added in place); CHUNK_BUFFERS[backend] [n, V] chunks (z in bpv, the torch reference's
                   others in fp32; n = default_chunk, or N / loss_chunks) and the per-row losses (4n)."""
    cfg, bpv = job.cfg, PRECISION[job.precision][1]
    n_tokens, C, V = cfg.block_size // lay.cp * lay.micro_batch_size, cfg.n_embd, cfg.padded_vocab_size
    chunk = default_chunk(n_tokens, V, C) if job.loss_chunks == 1 else -(-n_tokens // job.loss_chunks)
    casts = (n_tokens + V) * C * bpv if job.precision == "amp" else 0
    accumulator = V * C * (4 + bpv + 4) if bpv < 4 else 0
    chunks = chunk * V * (bpv + 4 * (CHUNK_BUFFERS[backend] - 1)) + 4 * chunk
    return (n_tokens + V) * C * bpv, casts + accumulator + chunks
