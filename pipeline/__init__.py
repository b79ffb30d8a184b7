"""
pipeline/: the pieces train_pp.py runs (train_pp.py itself teaches AFAB, 1F1B and the stage runner; nothing here
imports it). schedules.py: the other schedules as data (action lists), every schedule's p2p plan, the simulator and
the pictures (python bench/print_schedule.py prints one); stages.py: any model that is a chain of modules cut into
stages; gpt_stages.py: model.py's GPT cut into stages, and sampling through them; tied.py: a weight tied across the
first and last stage; weight_grads.py: the split backward (B, then W) of the zero-bubble schedules.
"""
