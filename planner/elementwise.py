"""
planner/elementwise.py: the bytes a training step's memory-bound (element-wise) kernels move through HBM, per token, as
the model's operations read and write them. timing.compute_time prices them at the GPU's datasheet HBM bandwidth
(an upper bound on their speed), which a price per FLOP gets wrong for narrow models: their element-wise bytes per
token grow with h, their FLOPs with h^2. The rest of a step's memory-bound time stays priced per FLOP (plan_time).

Per block and token, in 16-bit elements of width h (f = MLP width, kv = key/value width, p = dropout > 0), each
kernel reading its inputs and writing its output once (bias adds ride in the GEMMs' epilogues: torch's addmm,
Megatron's fused bias-GeLU and bias-dropout-add; the attention kernel's own reads and writes are its time, ATTN_EFF,
and eager attention's s x s scores are timing.eager_attention_time):

    on [s, h], replicated on every tp rank without sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198,
    Sec. 4.2.2: "the layer-norms as well as the dropouts after attention and MLP blocks are not parallelized"):
        op                        forward (read + write)      backward (read + write)
        2 LayerNorm / RMSNorm     2 x (h + h)                 2 x (2h + h)        dy and x in, dx out
        2 residual adds           2 x (2h + h)                2 x (2h + h)        the stream's gradient summed with
                                                                                  the branch's where they meet
        2 dropouts (p)            2 x (h + h + h/2)           2 x (h + h/2 + h)   1-byte mask = h/2 elements
          fused into the add      2 x (h/2)  instead of the dropout's forward (Megatron's bias-dropout-add: one
                                             kernel reads x and the residual and writes the sum and the mask)
    sharded over tp (column-parallel outputs, heads):
        attention output copy     h + h                       h + h               heads to tokens (.contiguous())
        rotary on q and k (rope)  2 (h + kv)                  2 (h + kv)
        GeLU                      f + f                       2f + f
        SwiGLU (gated)            (f + f) + (2f + f)          (2f + f) + (3f + 2f)   silu, then the product
    recompute: full and op (torchtitan's policy keeps matmul outputs and recomputes the rest) run every forward
    above again; selective recomputes only the attention scores (eager_attention_time's).

The loss, per token and logit (V / tp per rank, vocab-parallel): fused (flash-attn's xentropy) reads the 16-bit logits
forward and reads them and writes their gradient backward, 3 elements; otherwise an fp32 copy, its log-softmax and
their gradients: 2 + 4 + 4 + 4 bytes forward, 4 + 4 + 4 + 4 + 4 + 2 backward, 18 elements.
"""
from planner import shape as plan_shape
ELEMENT = 2                 # bytes of a 16-bit activation


def block_elements(job, recompute):
    """Elements moved per token by one block's element-wise kernels: (replicated over tp without SP, sharded)."""
    h, f, kv = job.cfg.n_embd, plan_shape.ffn(job), plan_shape.kv_dim(job)
    drop = job.cfg.dropout > 0
    dropout_forward = (h / 2 if job.fused_bias_dropout_add else 2.5 * h) if drop else 0.0
    replicated_forward = 2 * 2 * h + 2 * 3 * h + 2 * dropout_forward
    replicated_backward = 2 * 3 * h + 2 * 3 * h + (2 * 2.5 * h if drop else 0.0)
    rope = 2 * (h + kv) if job.rope else 0
    mlp_forward, mlp_backward = (5 * f, 8 * f) if job.gated else (2 * f, 3 * f)
    sharded_forward = 2 * h + rope + mlp_forward
    sharded_backward = 2 * h + rope + mlp_backward
    again = recompute in ("full", "op")
    return (replicated_forward * (1 + again) + replicated_backward,
            sharded_forward * (1 + again) + sharded_backward)


def bytes_per_token(job, lay):
    """HBM bytes of element-wise kernels per token a GPU is charged for (global tokens / GPUs, as compute_time's):
    L blocks of (sharded + replicated x tp) elements (the replicated ones run on every tp rank unless SP splits them
    over the sequence) and the loss's V logits, each once over the tp group."""
    replicated, sharded = block_elements(job, lay.recompute)
    copies = lay.tp if lay.tp > 1 and not lay.sp else 1
    loss = (3 if job.fused_loss else 18) * job.cfg.padded_vocab_size
    return ELEMENT * (job.cfg.n_layer * (sharded + copies * replicated) + loss)
