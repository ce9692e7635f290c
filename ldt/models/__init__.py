"""Models: megatron-core GPTModel chunks per stage, layout-invariant init, TP sharding rules."""
