"""Quantised weights and KV rows: the packed formats and the arithmetic on them.

``quant`` defines each format's bytes, quantise and dequantise; ``packed`` lays a block's
quantised linears out as one byte buffer and hands stages the weights they compute with.
Knows nothing about the plan or the executor.
"""
