# Sweep "memory": memory per rank by layout, counted on CPU in live train_5d runs (model states after the run,
# the peak of saved activations in a step), against plan.py's prediction for the same layouts
# (bench/memory_chart.py -> bench/results/memory.md and memory.png). Counts, not timings: any machine load will do.
# Sourced by bench.sh (PYTHON is set there).
$PYTHON bench/memory_chart.py
# ZeRO-R's CB and MD: the allocator's peaks with and without them (bench/fragmentation.py ->
# bench/results/fragmentation_cpu.md; on a GPU `python bench/fragmentation.py --device cuda`, torch.cuda.memory_stats)
$PYTHON bench/fragmentation.py
