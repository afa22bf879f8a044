"""The torch side of the defect-detection pipeline: one module per concern, called by ``stages/``."""
