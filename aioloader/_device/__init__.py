"""Device: batches moved to an accelerator.

Owns: the accelerator backends and the pinned-buffer pool (``accelerator``), the stage that
pins, copies on a side stream and hands batches over safely (``stage``), its host copies
(``hostcopy``), and the decision of whether it runs (``plan``), shared by the loader and the
batcher. Never: batches, or reads the loader.
"""
