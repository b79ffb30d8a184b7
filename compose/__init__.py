"""
compose/: the composition wing, train_5d.py's side of it. Glue that exists only because two rungs' building blocks
meet on one grid lives here, not in either rung; it imports the rungs, and only train_5d.py imports it. (What a
script's main applies to a model by flag, FP8 inside TP's layers included, is the wing's other room: converters/.)

    dp_axis.py                 the dp x cp axis of a pipelined step, one object whatever its mode (replicas here)
    zero_pipeline.py           ZeRO-1/2 shards and ZeRO-3 units inside a pipeline (the tied weight's copies lined up)
    grad_ready.py              DP's buckets launched by the pipeline schedule's last backward writing them
    kept_units.py              ZeRO-3 units kept gathered from a zero-bubble B until the W that reads them
    ep_grid.py                 experts on the grid: router metrics summed over the right ranks, checkpoint writers
    whole_model.py             the whole model gathered over ep and pp for the end-of-run sample
"""
