"""The training phase: the recipe (members, tile model, packing), fitting one model, the step loop,
checkpoint state and warm start."""
