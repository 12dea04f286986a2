"""Profile-driven asymmetric partitioner: which layers go in which stage.

A plan (roundpipe.shared.plan.Plan) cuts the model into forward stages, a fused tail and
backward stages. This package chooses one from per-layer costs, the workers' memory and the
PCIe bandwidth, and predicts what it will do with the discrete-event simulator
(``simulator``). docs/planning.md explains the model.

Modules (imports go down this list, never up):

* ``hardware``: ``HardwareSpec``, the workers a plan is for (``cpu_hardware``,
  ``gpu_hardware``).
* ``simulator``: the discrete-event simulation of a plan's schedule.
* ``model_flops``: a decoder layer's FLOPs per model family (active experts, linear
  attention).
* ``costs``: ``LayerCost``, ``estimate_costs`` and the cost model of a stage.
* ``gpus``: ``GpuModel``, what a GPU can do (data-sheet peaks and efficiencies).
* ``shape_costs``: ``estimate_costs_on_gpu``, layer costs priced by the shapes of the
  work on a ``GpuModel`` (``roundpipe plan --gpu``).
* ``search``: ``plan_stages``, ``evaluate_plan`` and the entry points the trainer calls,
  ``initial_plan`` and ``replan_if_better``; ``PlanResult``.
* ``sequence``: ``longest_sequence``, the longest sequence whose plan fits the workers'
  memory, and where that memory goes (``roundpipe plan --max-seq-len``).
* ``baselines``: the paper's bound baseline, for comparison.
* ``profile``: ``ProfileAggregator``, measured layer times back into ``LayerCost``s.
* ``data_parallel``: ``predict_data_parallel``, the step of several servers in a
  data-parallel group (``roundpipe plan --nodes``).
* ``command``: ``roundpipe plan``.

The model in short:

* ``LayerCost``: per layer and per microbatch, forward seconds and backward seconds
  (backward = recompute forward + backward, which is also what a layer costs inside the
  fused tail), the bytes a task uploads (compute-dtype weights) and downloads (fp32
  gradients), the layer's input activation and its working memory.
* ``estimate_costs``: cold-start costs from parameter counts and a FLOP model;
  ``estimate_costs_on_gpu`` the same from each GEMM's shape, attention, elementwise
  bytes and kernel counts on a described GPU.
* ``ProfileAggregator``: measured per-layer times from ``TaskDone.layer_times``
  (exponential average, warm-up dropped) turned back into ``LayerCost``s.
* ``plan_stages``: the search. A stage's time is
  ``max(compute of M microbatches + one microbatch's activation upload, host->device bytes
  / bandwidth, device->host bytes / bandwidth)``: what the worker's transfer engine
  overlaps (roundpipe.worker.transfer): the weights are prefetched during the previous
  task, microbatch m + 1 goes up while m computes and downloads run behind compute, so
  only the first microbatch's input waits on the bus; a stage fits when its
  weights, gradients and working set plus the largest other stage's weights and
  gradients (the prefetched one) fit the memory limit. The search minimises
  ``max(stages, N) x slowest stage`` over stage-time caps (exact min-max partitions for
  every stage count, greedy packing), tail lengths and weight budgets, then simulates the
  best candidates and keeps the fastest.
"""
