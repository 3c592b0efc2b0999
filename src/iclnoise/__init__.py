"""iclnoise: does stochastic gradient noise drive in-context learning?

A citation "method §N" in this package is section N of docs/method.md, where each formula is stated and derived.
"""
__version__ = "0.1.0"
