"""
common/: the plumbing every rung shares, one small module per concern, and three rooms of its own. None of it is a
technique, and none of it imports a rung (train_*.py): read the ladder at the root first, come here for how a
detail is done.

    config.py        the one command line of every script, its checks and its dataclass
    comm.py          every collective, each one's bytes counted, the gradient norm over a group and profiler
                     labels (torch and the stdlib only: what a copied rung takes along, docs/copy_out.md)
    distributed.py   the process group of a run (torchrun's environment, gloo / NCCL, timeouts, failing together)
    errors.py        the one `error:` line and exit code 2 of every entry point; a Ctrl-C's one `interrupted:` line
    data.py          corpus preparation (python -m common.data) and deterministic global batches
    data_mix.py      --data_mix: weighted corpora in one deterministic batch, per-source metrics, offline corpora
    optim.py         AdamW groups, warmup + cosine, the non-finite guard
    precision.py     --dtype made concrete: compute and parameter dtypes, autocast, TF32
    model_setup.py   the GPT a run's flags build (the MoE flags and their checks), memory for a meta-built model
    startup.py       before the first step: the out_dir lock, the corpus, the loader, whether the model can fit
    evaluation.py    the validation loss and the end-of-run sample
    metrics.py       MFU, peak memory, metrics.jsonl and the progress line
    peaks.py         the peak FLOP/s MFU divides by: GPU datasheets, a CPU's measured matmul
    profiling.py     --profile: torch profiler traces and labels
    grid.py          train_5d's rank grid and its process groups
    routing.py       mixture-of-experts load balancing over a step (model.MoE's load) and the router metrics
    cp_layout.py     context parallelism's layouts: the positions each rank holds, the blocks it computes
    tp_shards.py     how a tensor-parallel slice maps to the full parameter
    tp_setup.py      what applying TP needs besides its layers: a degree's shape checks, per-rank random streams
    tp_grads.py      a tensor-parallel model's loss and gradients: the vocabulary-parallel cross-entropy, SP's
                     partial sums, each value counted once in the norm
    module_io.py     what a technique needs of a foreign model: tied parameters by identity, a module's input by
                     keyword and output in a tuple, SP's edges on them (train_tp's swaps and hooks)
    nccl_check.py    replays each rank's p2p launches under NCCL's grouping rules (tests)

    checkpoint/      the one save and load of every layout (its __init__): train_single's format, written in
                     parallel parts; files.py (paths, atomic writes, the out_dir lock), compat.py (whether a
                     checkpoint fits this run), rank_states.py (RNG streams per rank), fp8_state.py (FP8 histories)
    hf/              Hugging Face interop: interop.py (export, python -m common.hf export; --init_from),
                     convert.py (names, permutations, config.json), tokenizer.py, attention.py (an attention core
                     in transformers' attention registry: train_cp's, copied out)

Beside common/, one folder down from the root: planner/ (plan.py's model), pipeline/ (the schedules, stages and
split backward train_pp runs), converters/ and compose/ (the composition wing: what a main applies by flag, and
train_5d's glue where two rungs meet), kernels/ (fused Triton kernels and FP8).
"""
