"""moe/: the mixture of experts model.py's GPT uses: the MoE block (layer.py) and the routing math it shares with
train_ep.py (router.py)."""
