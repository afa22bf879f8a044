"""The data phase: ingest, synthetic images, new labeled batches, the validation gate, preparation,
augmentation, defect masks and the tile model's tile cutting and labels."""
