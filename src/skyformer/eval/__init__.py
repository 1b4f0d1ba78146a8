"""Experiments, by role. They call methods through the registry, never ``ops`` internals.

- ``measure``: timing, peak memory, FLOP counts, error metrics.
- ``data``: where Q/K/V come from (real MiniLM-L6 Q/K/V, text, GloVe, Gaussian).
- ``methods``: method names (registered or ``module:function``) -> prepared calls.
- one subpackage per experiment, each with its ``run`` and ``report`` modules:
  ``compare``, ``bench``, ``approx`` (the approximation study), ``hf`` (pretrained
  MiniLM with every method).
"""
