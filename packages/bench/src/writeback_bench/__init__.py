"""writeback-bench: the backends' benchmark harnesses, each run as ``python -m writeback_bench.<name>``.

- :mod:`writeback_bench.mlx`: the MLX delegate against eager, MLX written by hand and stock.
- :mod:`writeback_bench.mlx_vs`: its ``--vs-mlx`` comparison (rows, rounds, tables).
- :mod:`writeback_bench.mlx_vs_calls`: the models and timed calls that comparison runs.
- :mod:`writeback_bench.mlx_handwritten`: the built-in decoders written by hand in MLX (its baseline).
- :mod:`writeback_bench.passes_memory`: planned memory with and without early write-back.
- :mod:`writeback_bench.passes_scale`: the passes' time as the graph grows.
- :mod:`writeback_bench.pybind`: a step in writeback's runtime against ExecuTorch's bindings.
- :mod:`writeback_bench.pybind_load`: loading a ``.pte`` in both runtimes.
- :mod:`writeback_bench.trt`: the TensorRT copy-back rule's engine (needs a GPU and TensorRT).
"""
