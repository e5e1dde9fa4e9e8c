"""Quantized safetensors checkpoints -> QuantizedWeight (kernels/quant_weight.py), one
module per format family; reader.py streams a checkpoint's weights through them."""

from splitserve.engine.quant.reader import iter_quantized_weights, quantized_linears

__all__ = ["iter_quantized_weights", "quantized_linears"]
