"""Checkpoints in the whole tensor's coordinates, whatever the layout that wrote them.

- :mod:`.chunks`: a rank's pieces of a tensor (tensor-parallel part, ZeRO range of it) as
  boxes of the whole tensor;
- :mod:`.dcp_chunks`, :mod:`.dcp_metadata`: those pieces through
  ``torch.distributed.checkpoint`` (DCP), read back into any other layout;
- :mod:`.optim_groups`: optimizer state made whole before a save;
- :mod:`.parallel_model`: the composed engine's save, load and consolidation.

ZeRO's standalone sharded checkpoint (:mod:`pycomm.parallel.zero.sharded_checkpoint`) is
built on these; the trainer's checkpoint folders (:mod:`pycomm.parallel.train.ckpt`) on
the engine's.
"""
