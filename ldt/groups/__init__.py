"""Process groups: the VTP state ldt creates from the rank plan, and the cross-stage groups
megatron-core code asks parallel_state for."""
