# For static type checkers: at runtime privacy_engine.grad_samplers *is* the top-level package
# ``grad_samplers`` (the same module object; see privacy_engine/_namespaced.py).
from grad_samplers import *
