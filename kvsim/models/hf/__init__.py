"""Reading Hugging Face config.json files into model specs: fields, layer kinds, attention, state, context.

Imports kvsim.models.spec and kvsim.errors only; kvsim.models.hf_config is the entry point the rest of kvsim uses.
"""
