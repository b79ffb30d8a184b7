"""
pipeline/: the pieces train_pp.py runs. schedules.py: every schedule as data (action lists), their p2p plan, the
simulator and the pictures (python -m pipeline.schedules); stages.py: any model that is a chain of modules cut
into stages; tied.py: a weight tied across the first and last stage; weight_grads.py: the split backward (B, then
W) of the zero-bubble schedules.
"""
