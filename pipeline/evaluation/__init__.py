"""The evaluation phase: test-set figures and the val-chosen thresholds, the tile fusion, heatmaps."""
