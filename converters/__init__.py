"""
converters/: what a script's main applies to its model by flag, before training, in one call: the fused kernels
(--kernels), FP8 GEMMs (--fp8) in model.py's Linear layers and inside train_tp's layers, ZeRO-3's gathers of FP8
weights, --compile, CP's fused block attention, and ZeRO-R's partitioned activations under TP. A rung's building
blocks never import it; it imports no rung (train_tp's layers are met by class name), so it sits below them.

    apply.py                   apply_kernels_and_fp8 (the one call), compiled, the FP8 all-gather's check
    fp8_tp.py                  FP8 GEMMs inside tensor-parallel layers (amax reductions over tp)
    tp_gemms.py                train_tp's layers given slots for other GEMMs (FP8) and a deferred dW (zero-bubble)
    fp8_gather.py              ZeRO-3's all-gather in FP8
    cp_kernels.py              CP's block attention on the fused kernels (aten's flash pair, Triton's, the CPU's)
    partition_activations.py   ZeRO-R's Pa under TP: 1/tp of each recomputed block's input kept, gathered back
"""
