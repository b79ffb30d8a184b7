"""
common/: the plumbing every rung shares, one small module per concern. None of it is a technique, and none of it
imports a rung (train_*.py): read the ladder at the root first, come here for how a detail is done.

    config.py        the one command line of every script, its checks and its dataclass
    comm.py          every collective, each one's bytes counted, the gradient norm over a group and profiler
                     labels (torch and the stdlib only: what a copied rung takes along, docs/copy_out.md)
    distributed.py   the process group of a run (torchrun's environment, gloo / NCCL, timeouts, failing together)
    errors.py        the one `error:` line and exit code 2 of every entry point
    data.py          corpus preparation (python -m common.data) and deterministic global batches
    data_mix.py      --data_mix: weighted corpora in one deterministic batch, per-source metrics, offline corpora
    optim.py         AdamW groups, warmup + cosine, the non-finite guard
    training.py      what every training loop shares: dtype, autocast, kernels / FP8, data setup, eval, sample
    checkpoint.py    the one save and load of every layout: train_single's format, written in parallel parts
    checkpoint_files.py   its files: paths, atomic writes, a full disk in one line, the out_dir lock
    checkpoint_compat.py  whether a checkpoint fits this run: model-defining fields, entries by name, inf/NaN
    rank_states.py   what a checkpoint keeps per rank: RNG streams, and its gather of any per-rank state
    fp8_state.py     FP8 delayed scaling's amax histories in a checkpoint, per rank
    hf.py            export to a Hugging Face GPTNeoXForCausalLM (python -m common.hf export), --init_from
    hf_convert.py, hf_tokenizer.py   its names, permutations and config.json; its tokenizer files
    metrics.py       MFU, peak memory, metrics.jsonl and the progress line
    peaks.py         the peak FLOP/s MFU divides by: GPU datasheets, a CPU's measured matmul
    profiling.py     --profile: torch profiler traces and labels
    grid.py          train_5d's rank grid and its process groups
    routing.py       mixture-of-experts routing (model.MoE and train_ep's experts)
    tp_shards.py     how a tensor-parallel slice maps to the full parameter
    tp_setup.py      what applying TP needs besides its layers: a degree's shape checks, per-rank random streams
    partition_activations.py   ZeRO-R's Pa under TP: 1/tp of each recomputed block's input kept, gathered back
    tp_grads.py      a tensor-parallel model's gradients: SP's partial sums, each value counted once in the norm
    pipeline_schedules.py, pipeline_stages.py, pipeline_tied.py, pipeline_weight_grads.py   the pipeline's
                     schedules as data, any model cut into stages, the tied weight across stages, the split
                     backward of zero-bubble schedules
    pipeline_grad_ready.py   which schedule action last writes each gradient, so DP's buckets launch right after it
    pipeline_kept_units.py   ZeRO-3 units kept gathered from a zero-bubble B until the W that reads their weights
    module_io.py     what a technique needs of a foreign model: tied parameters by identity, a module's input by
                     keyword and output in a tuple (train_tp's swaps and hooks)
    hf_attention.py  an attention core as a function of transformers' attention registry (train_cp's, copied out)
    nccl_check.py    replays each rank's p2p launches under NCCL's grouping rules (tests)
    plan_inputs.py, plan_memory.py   plan.py's inputs (GPUs, presets, layouts) and memory formulas
    plan_cli.py      plan.py's command line: flags, range checks, the Job and Layout they build
    plan_shape.py, plan_time.py      plan.py's model shapes (GQA, SwiGLU, untied, uneven stages) and the published
                     measurements its time rests on (kernel ceilings, NCCL latency, overlap defaults)
    plan_comm.py     plan.py's communication: each axis's link, bytes per step, NCCL latency and what overlaps
"""
