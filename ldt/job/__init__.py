"""Jobs: Hydra composes the config, the job checks it, names the run folder and joins the
world (ldt-train, its elastic job, and an existing Megatron script under VTP)."""
