"""What the test modules share (not tests themselves): importable as ``support`` because
tests/conftest.py puts tests/ on sys.path.

``support.cache``            the contract suite's axes (backends, policies), SCALE, assert_served
``support.reference_model``  the pure-Python model of the library that test_stateful.py runs beside it
``support.gguf_files``       tiny GGUF files written with gguf.GGUFWriter (needs the gguf package)
``support.sim_streams``      hand-made request streams and counter tuples for the simulator tests
``support.scripts``          benchmarks/ scripts loaded by path (they are not an importable package)
"""
