"""The lab beside the product: benchmarks (``bench``), synthetic real-shape checkpoints (``synthetic``) and the bounds
nothing may beat (``bounds``). It imports the product (``fate_edge``) and is never imported by it; ``fate-edge bench``,
``fate-edge synth`` and the other measuring commands dispatch here. Its plots and peers need ``pip install
'fate-edge[lab]'``.
"""
