"""Helpers only tests (and test-like scripts) use; production code never imports this package.

One job per module:

* :mod:`.single_op`: one ONNX model per operator of DNNFusion's Table 2, with the mapping type
  the classifier must give it;
* :mod:`.random_dag`: a hypothesis strategy of small random ONNX DAGs for the planner's
  property tests;
* :mod:`.stock`: stock TVM's unfused build of a model, and the single-op models it cannot run;
* :mod:`.onnx_backend`: the onnx package's backend test data as end-to-end cases.
* :mod:`.notes`: which schedule each kernel of a built module took (its recorded notes).

Feeds and numerics checks, which the CLI and reports use too, live in :mod:`tvm_fusion.feeds`
and :mod:`tvm_fusion.numerics`.
"""
