"""
planner/device_memory.py: memory as a GPU reports it, beside the tensors planner/memory.py counts, and the verdict.

    reserved  = allocated + ALLOCATOR_RESERVE x (activations + other), at most usable where the allocated fit
                                                            torch.cuda.max_memory_reserved
    device    = reserved + CUDA_CONTEXT + NCCL_COMM_BYTES x communicators                     nvidia-smi
    usable    = the GPU's total capacity (HBM x DEVICE_SHARE) - CUDA_CONTEXT - NCCL_COMM_BYTES x communicators
    verdict   OOM where reserved > usable (with the cap: where the allocated tensors alone exceed it); a close call
              where the allocated tensors are within CLOSE_CALL of usable, either side: printed as such and counted
              apart, since a prediction that near the limit is not a certain one
Each constant and its source: below.
"""

# What a GPU's memory holds besides the tensors (docs/plan.md):
# DEVICE_SHARE: the share of the HBM the driver hands to a process, torch's "total capacity" in every CUDA OOM message
# ("79.15 GiB total capacity" on an A100 80GB, "31.74 GiB" on a V100 32GB: NVIDIA/Megatron-LM #525).
# CUDA_CONTEXT: the context and the loaded kernels, outside the caching allocator: "GPU memory occupied: 1343 MB" after
# the first tensor (Hugging Face transformers docs, "Model training anatomy": "the kernels alone take up 1.3GB").
# NCCL_COMM_BYTES: one communicator's buffers, outside the allocator: per channel a 10 MiB and a 2 MiB buffer, 32
# channels on 8 x H100 (NVIDIA/nccl #1685, NCCL_DEBUG_SUBSYS=ALLOC); "a Ring ... only has 2 connections regardless of
# the scale" and "memory usage is linearly tied to the number of channels" (#986): 32 x 12 MiB per communicator.
# ALLOCATOR_RESERVE: what the caching allocator reserves beyond the peak of live tensors, as a share of the tensors
# that come and go each step (activations, logits, buffers; model states are allocated once and do not fragment):
# 16 GiB stranded over 77 GiB of stashed activations at their peak (93 GiB reserved), meta-pytorch/torchrec #4584's
# study of HBM fragmentation, a measurement of the allocator, not of a run plan.py is compared with. The reserve is
# soft: where a cudaMalloc fails the allocator frees its cached blocks and retries (torch.cuda.memory_stats'
# num_alloc_retries), so reserved memory stops at what is usable and only the live tensors can run a GPU out.
DEVICE_SHARE = 79.15 / 80
CUDA_CONTEXT = 1343e6
NCCL_COMM_BYTES = 32 * 12 * 2 ** 20
ALLOCATOR_RESERVE = 16 / 77
# CLOSE_CALL: the band around the usable memory where a verdict is called close, not fits or OOM: 5% either side.
# What the tensors' count leaves out is of that size: the allocator's reserve above is one study's ratio (16 / 77, 21%
# of what churns), the CUDA context varies by driver and loaded kernels, and what torch.compile or a library fuses is
# not modelled; 5% of an 80 GB GPU is 4 GB, about one fp32 copy of the logits at 8K tokens and a 128K vocabulary.
CLOSE_CALL = 0.05


def communicators(dp, tp, cp, pp, ep):
    """NCCL communicators a rank holds buffers for: one per group of more than one rank (tp, cp, dp x cp, pp, ep)."""
    return (tp > 1) + (cp > 1) + (dp * cp > 1) + (pp > 1) + (ep > 1)


def usable_bytes(capacity, n_communicators):
    """What the caching allocator can reserve: the GPU's total capacity as torch reports it (HARDWARE's HBM x
    DEVICE_SHARE; torch.cuda.get_device_properties().total_memory on a GPU) less the CUDA context and NCCL's
    buffers, which live outside it."""
    return capacity - CUDA_CONTEXT - NCCL_COMM_BYTES * n_communicators


def capacity_of(job):
    """The GPU's total capacity as torch reports it: its HBM x DEVICE_SHARE."""
    return job.hw["mem"] * DEVICE_SHARE


def verdict(allocated, usable):
    """'OOM' where the allocated tensors exceed the usable memory (the reserve yields first: memory.memory caps it),
    'close' within CLOSE_CALL of it either side, else 'fits'. The side of a close call is the `oom` flag beside it."""
    if abs(allocated / usable - 1) <= CLOSE_CALL:
        return "close"
    return "OOM" if allocated > usable else "fits"
