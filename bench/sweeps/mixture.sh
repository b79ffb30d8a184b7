# Sweep "mixture": each source's sampled share of the global batches per step against its --data_mix weight, for
# GPT-3's five weights (bench/mixture_share.py -> bench/results/mixture_share.md and .png). Draws, not timings.
# Sourced by bench.sh (PYTHON is set there).
$PYTHON bench/mixture_share.py
