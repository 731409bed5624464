"""Side-by-side benchmark: cgbackend against eager and the stock torch.compile modes.

``python -m cgbackend bench [FLAGS]`` runs, in one
process, every chosen contender on every chosen reference model (``cgbackend.models``) in
inference and training, and writes JSON where ``--out`` says (default: a new folder under
``./cgbackend-results/``, named on stdout) plus a table on stdout.
``benchmarks/README.md`` documents the flags, what is measured and the JSON schema.

For each model x mode x contender the harness

1. takes a fresh deep copy of one seeded model (same weights for everybody), resets Dynamo
   (``--timing sequential``; alternating timing keeps the earlier contenders compiled), and compiles it (``CONTENDERS[name].make``);
2. runs ``--warmup`` calls (the first ones compile and, for CUDA-graph contenders, capture),
   timing each; ``compile_s`` is what they took beyond ``--warmup`` steady-state calls;
3. checks accuracy on ``--acc-batches`` batches (infer: the output; train: the loss and every
   parameter gradient of one step from the seed weights) against eager and against a float64 run
   of the same weights and inputs (``accuracy.py``: at most 2x eager's own error);
4. times ``--iters`` calls (fewer under ``--time-budget``), each on its own (CUDA events on CUDA,
   perf_counter on CPU), and reports median / p10 / p90. By default (``--timing alternate``) the
   case's contenders are kept after step 3 and timed in 5 alternating blocks, so that a drift of
   the machine's pace shows in all of them alike (``run_contenders``).

One job per module: ``settings`` (flags and defaults), ``contenders`` (the registry, including the
forms that rebuild a model from the same weights), ``models`` (the benchmark models: reference
models, real-size shapes with a ``--tokens`` sweep, transformers decode models), ``cases`` (one
model x mode: weights, inputs, references, the runner), ``accuracy`` (the float64 rule),
``timing`` (preparing and timing contenders, alternating blocks), ``render`` (tables, JSON),
``run`` (the entry point); ``decode``, ``serving`` (``serve-bench``) and ``dist`` (``bench-dist``, with
``dist_models``, ``dist_run``, ``dist_timing``, ``dist_accuracy`` and ``dist_check``) are the other modes. Any exception inside one contender marks that row ``error``
and the run goes on.
"""

from .run import main, run

__all__ = ["main", "run"]
