"""The training job of one rank: stage build, loop, optimizer pieces, checkpoints, outputs."""
