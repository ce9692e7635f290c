"""Training data, owned by the data stages only (the cloud stages of a U-shape never read it)."""
