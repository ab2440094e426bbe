"""Pipeline: one epoch, from the order of indices (or a stream) to ready batches.

Owns: the epoch's stages and their bounded hand-offs (``epoch``; its transform + collate
stage in ``transform``, its reorder + device + output stage in ``output``), the reads of a map
source's samples (``reads``), the fetch path's rules: timeout, retry, failure budget and pace
(``fetch``), the hand-off accounting (``flow``) and restoring order (``reorder``). Never: opens
worker pools or device streams (the loader's scope does), or reads the loader's arguments (it
is given a ``PipelineConfig``).
"""
