# For static type checkers: at runtime privacy_engine.accountants *is* the top-level package
# ``accountants`` (the same module object; see privacy_engine/_namespaced.py).
from accountants import *
