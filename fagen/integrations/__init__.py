"""Adapters that plug fagen's kernels into other libraries. Each is an optional extra; none is
imported by `import fagen`.

    fagen.integrations.transformers   attn_implementation="fagen" for Hugging Face transformers models
"""
