"""Elastic runs: plan the cluster from the nodes torchrun's elastic agent brought, at every start.

``cluster.inventory`` set (``cluster=cpu_elastic``) and launched with ``torchrun --nnodes
MIN:MAX --rdzv-backend c10d --max-restarts N -m ldt.job.train ...``: each node names the kind of
its devices (``LDT_NODE_KIND``, :mod:`ldt.elastic.nodes`), the workers exchange that through
the store torchrun formed, and every rank plans the same pipeline with ``ldt.plan`` for the
nodes that are there (:mod:`ldt.elastic.replan`: pure, deterministic, the data owner's stage on
the data owner's node, the global batch kept), checks that every rank got the same plan, and
joins the world of the ranks the plan uses (:mod:`ldt.elastic.world`). With
``train.resume=auto`` each start continues from the run folder's newest checkpoint.
docs/elastic.md has the commands and what is guaranteed.
"""
