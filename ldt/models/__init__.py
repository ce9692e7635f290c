"""Models: megatron-core GPTModel chunks per stage built from the family in ModelConfig
(build, spec), layout-invariant init, TP sharding rules, vocabulary padding, architecture
checks (arch), Hugging Face import/export (hf)."""
