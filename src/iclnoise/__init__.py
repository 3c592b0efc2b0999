"""iclnoise: does stochastic gradient noise drive in-context learning?"""
__version__ = "0.1.0"
