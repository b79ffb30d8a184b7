"""
compose/: the composition wing. What exists only because two techniques meet lives here, not in either rung:
train_5d.py imports it, a rung's main may apply its converters in one call, and no rung's building blocks do.

    converters.py              --kernels, --fp8 and --compile applied to a model in one call, inside TP's layers too
    grad_ready.py              DP's buckets launched by the pipeline schedule's last backward writing them
    kept_units.py              ZeRO-3 units kept gathered from a zero-bubble B until the W that reads them
    partition_activations.py   ZeRO-R's Pa under TP: 1/tp of each recomputed block's input kept, gathered back
    tp_gemms.py                train_tp's layers given slots for other GEMMs (FP8) and a deferred dW (zero-bubble)
    fp8_tp.py                  FP8 GEMMs inside tensor-parallel layers (amax reductions over tp)
    fp8_gather.py              ZeRO-3's all-gather in FP8
    dp_axis.py                 the dp x cp axis of a pipelined step, one object whatever its mode (replicas here)
    zero_pipeline.py           ZeRO-1/2 shards and ZeRO-3 units inside a pipeline (the tied weight's copies lined up)
    ep_grid.py                 experts on the grid: router metrics summed over the right ranks, checkpoint writers
    whole_model.py             the whole model gathered over ep and pp for the end-of-run sample
    cp_kernels.py              CP's block attention on the fused kernels (aten's flash pair, Triton's, the CPU's)
"""
