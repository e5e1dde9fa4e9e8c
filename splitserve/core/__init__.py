"""The torch-free leaf every layer stands on: block hashing, sampling parameters, the
tokenizer wrapper, a checkpoint's model configuration and the engine's block events.
The router, the cluster bus and the operator import this, never the model runtime
(a contract test checks it: tests/test_layers.py)."""
