"""Modules that PyTorch itself imports by name (a contract with PyTorch, not public torch_tpu API)."""
