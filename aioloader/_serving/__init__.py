"""Serving: dynamic batching of concurrent requests behind a model.

Owns: ``DynamicBatcher`` (``batcher``: its public surface, scope and admission), a request and its
states (``request``), the runner tasks that collect and run batches (``dispatch``), the waiting
requests and what a batch may hold (``pending``), its pure decisions (when to cut, which requests
wait, how outputs are split: ``policy``), the runners that collate and call the model
(``runner``), and its statistics (``stats``). Never: touches the ``DataLoader``.
"""
