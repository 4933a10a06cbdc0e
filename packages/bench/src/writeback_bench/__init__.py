"""writeback-bench: the benchmarks, apart from the code they measure.

The ``writeback bench``, ``bench-generate`` and ``bench-scale`` commands (added by
:mod:`writeback_bench.plugin` through ``writeback_cli_commands``):

- :mod:`writeback_bench.bench_command`: ``writeback bench``, its options and tables.
- :mod:`writeback_bench.cache_sizes`: one decode step at each cache size, stock beside writeback.
- :mod:`writeback_bench.model_steps`: ``--model``: every contender on one model.
- :mod:`writeback_bench.contenders`: what those share: names, the stock lowering, the cells.
- :mod:`writeback_bench.plots`: ``--plot``.
- :mod:`writeback_bench.runner_generation`: ``writeback bench-generate``, through ExecuTorch's LLM runner.
- :mod:`writeback_bench.llama_scale`: ``writeback bench-scale``, a Llama of a given shape.

The harnesses, each run as ``python -m writeback_bench.<name>``:

- :mod:`writeback_bench.prefill_attention`: a prompt prefilled in one call, with and without the attention passes.
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
