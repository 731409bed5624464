"""Static MoE dispatch, the feature the ``static_dispatch`` option switches: data-dependent expert
loops become sync-free code of fixed shapes, so a whole MoE layer is captured (docs/static-dispatch.md).

Before Dynamo traces (``cgbackend.compile``, ``cgbackend.explain``):

* ``source_rewrite.py``: skip-loops in a module's source (over ``nonzero()`` results or
  ``.tolist()`` counts) become fixed-length loops, where ``loop_proof.py`` proves the body leaves
  nothing behind for a skipped expert; ``fold_syntax.py`` and ``fold.py``: loops over many
  identical experts are traced for one expert only (folded).
* ``loop_forwards.py``: the rewritten forwards, put on the modules only while a compiled call runs.
* ``expert_layout.py``: per-module expert weights laid out as one block each, read by the grouped
  form without a copy.

In the graph Dynamo hands the backend (``graph_rewrite.py``, the first step of
``passes/pipeline.py``):

* ``match.py``: dispatch units (where-loops, sorted splits, ``grouped_mm_fallback``), proven
  row-independent by ``passes/rowdep.py``;
* ``form_choice.py`` (with ``costs.json``): the measured cost model that picks each unit's or
  layer's form;
* the forms: ``masked_dense.py``, ``grouped.py`` (also the small-batch form), ``fold_graph.py``
  (a folded loop's one traced expert over all experts), built with ``graph_builder.py``;
* ``keep_skips.py``: a unit of a rewritten loop left dynamic keeps the loop's skip;
* ``records.py``: one record per rewrite or unit left alone, read by the report.

The option arrives parsed (``cgbackend.config.DispatchMode``); no module here reads its text.
"""
