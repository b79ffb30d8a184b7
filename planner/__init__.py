"""
planner/: the model behind plan.py (the root's entry point), one module per part of it.

    inputs.py           GPUs, model presets, the Job and Layout a plan is made of
    cli.py              plan.py's command line: flags, range checks, the Job and Layout they build
    shape.py            model shapes (GQA, SwiGLU, untied embeddings, uneven stages)
    memory.py           memory per rank; runtime_memory.py: the loss, pipeline buffers and outputs
    timing.py           step time from published kernel ceilings; elementwise.py: element-wise kernels by bytes
    comm.py             each axis's link, bytes per step, NCCL latency and what overlaps
"""
