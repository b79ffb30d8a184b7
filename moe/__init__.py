"""moe/: the mixture of experts' routing math that model.py's MoE block and train_ep.py share (router.py)."""
