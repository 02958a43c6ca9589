"""ONNX decoder exports: import, planning and execution against onnxruntime."""
