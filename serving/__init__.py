"""The edge runner: scores images with an exported ONNX model and its model card.

Depends on onnxruntime, numpy and Pillow only; it never imports torch or ``pipeline`` so it can be
installed alone on a box next to the line (see ``serving/requirements.txt`` and the Dockerfile).
"""

__version__ = "0.1.0"
