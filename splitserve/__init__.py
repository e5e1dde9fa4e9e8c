"""splitserve: disaggregated prefill/decode LLM serving."""

__version__ = "0.1.0"
