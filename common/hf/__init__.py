"""
common/hf/: Hugging Face interop. interop.py exports a run to a GPTNeoXForCausalLM and starts one from it
(--init_from; `python -m common.hf export`), convert.py holds the names, permutations and config.json, tokenizer.py
the tokenizer files, attention.py an attention core as a function of transformers' attention registry.
"""
