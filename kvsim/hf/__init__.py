"""Reading Hugging Face config.json files into model specs: fields, layer kinds, attention, state, context.

Imports kvsim.models and kvsim.errors only; kvsim.hf_config is the entry point the rest of kvsim uses.
"""
