"""Scheduling: which sequences run in each step, and the one writer of what a step produced.

Modelled on vLLM v1's scheduler (``vllm/v1/core/sched``). The modules:

- ``scheduler``: :class:`~loraplex.engine.scheduling.scheduler.Scheduler`, the queues, the
  step's plan (``schedule``) and ``update_from_output``;
- ``preemption``: :class:`~loraplex.engine.scheduling.preemption.Preemptor`, the scheduler's
  member that picks victims and moves their KV (recompute, swap-out, swap-in);
- ``output_applier``: :class:`~loraplex.engine.scheduling.output_applier.OutputApplier`, the
  scheduler's member that ``update_from_output`` applies a step's result with;
- ``output``: what crosses the one-way step (``SchedulerOutput``, ``ModelRunnerOutput``,
  ``EngineCoreOutput``);
- ``budget``: the per-step prefill allowance shared between tenants (``PrefillBudget``);
- ``fair_queue``: the waiting queue in virtual-token-counter order (``FairQueue``).

docs/engine.md describes the step through these modules.
"""
