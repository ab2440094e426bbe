"""Serving: dynamic batching of concurrent requests behind a model.

Owns: ``DynamicBatcher`` (``batcher``), its pure decisions (when to cut, which requests wait,
how outputs are split: ``policy``), the runners that collate and call the model (``runner``),
and its statistics (``stats``). Never: touches the ``DataLoader``.
"""
