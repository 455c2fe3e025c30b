"""The step's orchestration written once for both engines, over the core's maths: what a step
does with the evidence each engine's storage and kernels hand it. Each engine keeps its kernel
dispatch, its storage and when it calls this part; nothing here imports an engine.

- :mod:`sfi.step.probes`: a step's coverage probes, collected layer by layer and checked
  together after its last layer (the settings, the next-page and copy rules, the verdict).
"""
