"""What ldt keeps on disk and how it is checked, below the training code.

:mod:`ldt.storage.checkpoint_files` owns a checkpoint folder's format (parts, manifest with a
sha256 per file, ``COMPLETE``), :mod:`ldt.models.tensor_files` reads and writes its tensors in one
process. The launcher's checks (:mod:`ldt.topology.validate`) and the tools read checkpoints through
these modules, without importing the training code.
"""
