"""Who is where: ranks and stages (ranks), what a stage's device means (device), every group
and boundary route as data (routes), and the checks before the first collective
(validate)."""

from ldt.topology.ranks import RankInfo, Topology  # noqa: F401  (the public names)
