"""The schedule's runtime: walks a stage's action list over the boundary (and megatron's
forward-backward signature on top of it)."""
