"""The export phase: ONNX graphs and their variants, the PyTorch reference scorer, timing and the
benchmark driver."""
