"""
planner/runtime_memory.py: what a pipeline runtime keeps beside a stage's activations, for planner/memory.py.
Formulas only; each term says which software keeps it (a Job field that --software sets) and the source line.

    (the LM head and the loss, each stack's own: planner/head.py)
    pipeline outputs kept (job.pp_outputs_kept, with pp > 1)
        all    every stage's output of every micro-batch until the step ends: v x m outputs per rank,
               b*s*h/t(SP) values each, the last stage's its logits (b*s*V/t values)
        last   the last stage's logits alone, m of them
        none   nothing beyond the stage's activations
    pipeline receive buffers (pp > 1)
        per micro-batch (job.pp_recv_per_micro_batch)   m activation buffers per stage but the first, m gradient
               buffers per stage but the last, less the activation buffers in flight (their first block's input)
        otherwise   2 messages in flight
"""
from planner.head import logits_per_micro_batch
from planner.inputs import PRECISION


def pipeline_outputs_bytes(job, lay, chunks, holds_last):
    """Stage outputs a pipeline runtime keeps until the step ends on a rank with `chunks` stages (holds_last: one of
    them is the model's last), m = micro-batches per step, in 16-bit values:
        all    chunks x m outputs: b*s/cp*h/(t under SP) values each, the last stage's its logits
               (logits_per_micro_batch) instead
        last   m logits on the last stage's rank
    torch.distributed.pipelining appended every stage's forward output to stage.output_chunks (for the step's return
    value) until pytorch/pytorch#153383 (May 2025) kept the last stage's alone, and until #165822's
    step(return_outputs=False), which torchtitan passes since e5ef99a (Oct 2025, "Update PP to release memory
    earlier"), the last stage's logits of every micro-batch (pytorch/pytorch#159251). The count is at the step's last
    forward, where 1F1B's steady state still holds its most micro-batches in flight."""
    if lay.pp == 1 or job.pp_outputs_kept == "none":
        return 0.0
    m = lay.grad_acc(job)
    logits = m * logits_per_micro_batch(job, lay) * PRECISION[job.precision][1] if holds_last else 0.0
    if job.pp_outputs_kept == "last":
        return logits
    return logits + (chunks - holds_last) * m * pipeline_message_bytes(job, lay)


def pipeline_message_bytes(job, lay):
    """One pipeline message, a micro-batch's hidden states or their gradient: b*s/cp*h values, /t under SP."""
    cfg = job.cfg
    values = lay.micro_batch_size * cfg.block_size // lay.cp * cfg.n_embd / (lay.tp if lay.sp else 1)
    return values * PRECISION[job.precision][1]


def pipeline_buffers_bytes(job, lay, chunks, holds_first, holds_last, held):
    """Receive buffers on a pipeline rank with `chunks` stages (holds_first / holds_last: one of them is the model's
    first / last) and `held` micro-batch-chunks in flight on its stages but the first, in pipeline messages:
        per micro-batch   m (chunks - holds_first) activation buffers + m (chunks - holds_last) gradient buffers
                          - held (each in-flight chunk's activation buffer is its first block's saved input,
                          counted with the activations)
        otherwise         2 (one message received, one sent; Megatron allocates each receive and frees it)
    torch.distributed.pipelining's PipelineStage makes one receive buffer per micro-batch for the activations
    (_prepare_forward_infra: args_recv_info[chunk_id] for every chunk id) and one for the gradients
    (_prepare_backward_infra: grad_recv_info[mb_index] for every micro-batch), at its first step, and keeps them."""
    if lay.pp == 1:
        return 0.0
    if not job.pp_recv_per_micro_batch:
        return 2 * pipeline_message_bytes(job, lay)
    m = lay.grad_acc(job)
    return (m * (2 * chunks - holds_first - holds_last) - held) * pipeline_message_bytes(job, lay)
