"""Models: make a model trainable with per-sample gradients (before it is wrapped).

=================  ====================================================================
file               what it holds
=================  ====================================================================
``validation.py``  what stands in the way (``UnsupportedModuleError``, ``find_problems``)
``fixer.py``       ``fix_module`` / ``ModuleValidator``: replace what can be replaced
=================  ====================================================================
"""
